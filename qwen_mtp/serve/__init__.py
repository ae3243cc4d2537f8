"""`qwen-mtp serve`: the OpenAI-compatible HTTP server over one engine (see docs/serving.md)."""

from qwen_mtp.serve.app import create_app

__all__ = ["create_app"]
