"""Kernel, layer and model benchmarks (public APIs only; not tests). Run from the repository root,
e.g. ``python -m benchmarks.decode_attention --help``. The serving load generator stays in the
package as ``segkv.bench.serve`` (``segkv bench serve``)."""
