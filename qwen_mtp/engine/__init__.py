"""Generation: requests in, tokens out."""

from qwen_mtp.engine.engine import Engine, Result
from qwen_mtp.engine.params import SamplingParams, StructuredOutput
from qwen_mtp.engine.update import Update

__all__ = ["Engine", "Result", "SamplingParams", "StructuredOutput", "Update"]
