"""Exceptions a user can meet, raised at the boundaries (recipe, checkpoint, request admission, installation)."""

import importlib.util


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


class MissingExtraError(QwenMTPError, ImportError):
    """A command needs packages of an optional extra (pyproject.toml) that are not installed."""


def require_extra(extra: str, modules: tuple[str, ...]) -> None:
    """Raise a `MissingExtraError` naming the install command when any of `modules` cannot be imported: checked
    before a command loads a model, so a missing package costs no load and shows no traceback."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"this needs {', '.join(missing)}, from the '{extra}' extra: pip install 'qwen-mtp[{extra}]' "
            f"(in a checkout: pip install -e '.[{extra}]')"
        )
