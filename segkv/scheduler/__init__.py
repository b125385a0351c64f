"""Continuous-batching decisions (CPU only)."""
