"""nn.Module building blocks: norms, rotary embeddings, linear layers, attention, sampler."""
