"""Exceptions a user can meet, raised at the boundaries (recipe, checkpoint, request admission)."""


class QwenMTPError(Exception):
    """Base class of every error qwen-mtp raises on purpose."""


class RecipeError(QwenMTPError, ValueError):
    """A recipe key is unknown, or its value is of the wrong type or out of range."""


class ConfigError(QwenMTPError, ValueError):
    """A Hugging Face config.json we cannot read, or a model family we do not support (yet)."""


class CheckpointError(QwenMTPError, ValueError):
    """A checkpoint tensor is missing, unexpected, mis-shaped, of an unusable dtype, or a file is unreadable."""


class RequestError(QwenMTPError, ValueError):
    """A generation request that can never run: empty prompt, unknown token id, too long, bad limits."""
