"""qwen-mtp: exact (lossless) MTP speculative decoding for Qwen3.5 hybrid models."""

from qwen_mtp.config import ModelConfig
from qwen_mtp.engine import Engine, Result, SamplingParams, StructuredOutput, Update
from qwen_mtp.errors import CheckpointError, ConfigError, QwenMTPError, RecipeError, RequestError
from qwen_mtp.loader import load_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Engine",
    "ModelConfig",
    "QwenMTPError",
    "RecipeError",
    "RequestError",
    "Result",
    "SamplingParams",
    "StructuredOutput",
    "Update",
    "load_model",
]
