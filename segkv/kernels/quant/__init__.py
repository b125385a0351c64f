"""Quantized-weight products: FP8 (e4m3) weights with float32 block scales."""
