"""The serving load generator behind ``segkv bench serve``; the kernel, layer and model benchmarks
live in the repository's top-level ``benchmarks/``."""
