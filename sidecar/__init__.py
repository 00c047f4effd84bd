"""Session-routing sidecar: keeps every turn of an LLM session on the worker that holds its KV cache."""

import os

__version__ = "0.1.0"

# SIDECAR_PURE_PYTHON=1 runs the .py sources even where the compiled modules (setup.py) are
# installed: for profilers that only see Python frames, and for testing both builds.
if os.environ.get("SIDECAR_PURE_PYTHON") == "1":
    from sidecar._pure import prefer_sources

    prefer_sources()
