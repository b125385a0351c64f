"""Benchmarks (kernel, wrapper, serving, memory): scripts, never run by the tests."""
