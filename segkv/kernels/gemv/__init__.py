"""One-row products for decode: the dense split-K GEMV, the output head and the MLA x product."""
