"""Generation: requests in, tokens out."""

from qwen_mtp.engine.engine import Engine, Result

__all__ = ["Engine", "Result"]
