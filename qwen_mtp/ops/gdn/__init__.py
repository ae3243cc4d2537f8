"""Gated DeltaNet's delta rule, laid out as flash-linear-attention lays out `fla/ops/gated_delta_rule/`:
- `naive.py`: the plain-torch math (recurrent and chunked forms, gates, l2norm): the reference and CPU's path;
- `recurrent.py`: decode / verify over pooled states: its Triton kernel and the op `qwen_mtp::gdn_recurrent`;
- `chunked.py`: prefill: its Triton kernels and the ops `qwen_mtp::gdn_chunked` and `gdn_chunked_varlen` (packed
  sequences);
- `gates.py`: a packed step's gates, the op `qwen_mtp::gate_values_varlen`.
Importing the package registers the ops.
"""

from qwen_mtp.ops.gdn.chunked import gdn_chunked, gdn_chunked_varlen
from qwen_mtp.ops.gdn.gates import gate_values_varlen
from qwen_mtp.ops.gdn.naive import (
    chunked_gated_delta_rule,
    chunked_gated_delta_rule_varlen,
    gate_values,
    recurrent_gated_delta_rule,
)
from qwen_mtp.ops.gdn.recurrent import gdn_recurrent, gdn_recurrent_reference

__all__ = [
    "chunked_gated_delta_rule",
    "chunked_gated_delta_rule_varlen",
    "gate_values",
    "gate_values_varlen",
    "gdn_chunked",
    "gdn_chunked_varlen",
    "gdn_recurrent",
    "gdn_recurrent_reference",
    "recurrent_gated_delta_rule",
]
