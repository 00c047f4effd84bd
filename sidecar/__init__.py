"""Session-routing sidecar: keeps every turn of an LLM session on the worker that holds its KV cache."""

__version__ = "0.1.0"
