"""Mixture-of-experts kernels: expert GEMVs, the one-launch expert MLP, the grouped GEMM, routing ops."""
