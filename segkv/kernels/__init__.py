"""Triton kernels and their launchers (GPU); imports torch and triton only."""
