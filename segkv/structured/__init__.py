"""Constrained decoding (structured output) with xgrammar: grammars compiled per tokenizer, a
matcher per sequence that masks the logits and follows the sampled tokens."""
