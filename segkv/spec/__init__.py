"""Speculative decoding: proposers (MTP layers, n-gram lookup, a draft model) and rejection sampling."""
