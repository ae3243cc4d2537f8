"""The ops are registered with the engine and run their references on CPU."""

import torch
from op_helpers import paged_setup, rand

import qwen_mtp.engine.runner  # noqa: F401  (registers the ops)


def test_custom_ops_registered_and_dispatch_to_reference_on_cpu():
    q, kv, tables, lens = paged_setup(1, torch.float32)
    k, v = rand(3, 1, 2, 32, seed=3), rand(3, 1, 2, 32, seed=4)
    positions = lens[:, None].long() - 1
    for op in ("paged_attention", "conv_update", "gdn_recurrent"):
        assert hasattr(torch.ops.qwen_mtp, op)
    torch.library.opcheck(
        torch.ops.qwen_mtp.paged_attention.default, (q, k, v, kv.clone(), tables, lens, positions, 0.1)
    )
