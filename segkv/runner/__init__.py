"""Batch to tensors, CUDA graphs and model execution."""
