"""pdserve: an LLM serving runtime with prefill/decode disaggregation (shared libraries)."""

__version__ = "0.1.0"
