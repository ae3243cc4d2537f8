"""Generation: requests in, tokens out."""

from qwen_mtp.engine.engine import Engine, Result, Update

__all__ = ["Engine", "Result", "Update"]
