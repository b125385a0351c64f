"""segkv: an LLM inference engine built on a segmented KV cache and exact split attention."""

__version__ = "0.1.0"
