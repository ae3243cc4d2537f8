"""The one table of dtype names a recipe, a checkpoint or a caller may use, and their torch dtypes."""

from __future__ import annotations

import typing
from typing import Literal

import torch

DtypeName = Literal["float32", "bfloat16", "float16"]  # model weights and activations
StateDtypeName = Literal["float32", "bfloat16"]  # the GDN recurrent state

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in typing.get_args(DtypeName)}
STATE_DTYPES: dict[str, torch.dtype] = {name: DTYPES[name] for name in typing.get_args(StateDtypeName)}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16` (a torch dtype passes through); KeyError for a name not in `DTYPES`."""
    return name if isinstance(name, torch.dtype) else DTYPES[name]
