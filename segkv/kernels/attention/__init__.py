"""Attention kernels: the paged stage 1 (GQA and latent), its tiles, the in-kernel and separate merges."""
