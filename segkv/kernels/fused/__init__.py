"""Fused elementwise kernels (norms, RoPE, cache writes, activations) and sampling reductions."""
