"""The MoE ops (`qwen_mtp::moe_route`, `qwen_mtp::moe`): the Triton kernels equal their references, and a
token's result never depends on the other tokens of the launch or on how many pairs went to each expert."""

import pytest
import torch
from op_helpers import DEVICE, DTYPES, check_op, rand

from qwen_mtp.ops.linear import dequantize_weight
from qwen_mtp.ops.moe import moe_reference, moe_triton, route_reference, route_triton
from qwen_mtp.quant.fp8 import quantize_fp8_block

EXPERTS, HIDDEN, INTER, TOP_K = 6, 40, 24, 2  # H and I leave partial K blocks and column tiles


def moe_inputs(tokens, dtype, seed=0, ids=None):
    """Inputs of the MoE op: random routing (or the `ids` given), 3-D experts, a shared output and its gate."""
    logits = rand(tokens, EXPERTS, seed=seed)
    weights, routed = route_reference(logits, TOP_K, True)
    ids = routed if ids is None else ids
    return (
        rand(tokens, HIDDEN, dtype=dtype, seed=seed + 1),
        rand(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, seed=seed + 2, scale=HIDDEN**-0.5),
        rand(EXPERTS, HIDDEN, INTER, dtype=dtype, seed=seed + 3, scale=INTER**-0.5),
        weights.to(dtype),
        ids,
        rand(tokens, HIDDEN, dtype=dtype, seed=seed + 4),
        rand(tokens, 1, dtype=dtype, seed=seed + 5),
    )


def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_kernel_matches_reference(dtype):
    args = moe_inputs(9, dtype)
    ours = moe_triton(*args)
    close(ours, moe_reference(*args, invariant=True), dtype)
    close(ours, moe_reference(*args, invariant=False), dtype)


def test_moe_reference_paths_agree():
    """The grouped (prefill) and row-wise (decode) references compute the same function."""
    args = moe_inputs(11, torch.float32)
    close(moe_reference(*args, invariant=False), moe_reference(*args, invariant=True), torch.float32)


@pytest.mark.parametrize(
    "routing",
    [
        "random",
        "one expert",  # every token's slot 0 to expert 4: 40 pairs, three tiles of 16 rows
        "spread",  # each token alone on its experts
    ],
)
def test_moe_kernel_rows_never_depend_on_the_batch(routing):
    """A token alone gives bit for bit what it gives among 40 tokens, however the 80 pairs fall on the experts
    (an expert with 40 rows runs three row tiles; one with 1 row a tile of 15 empty rows)."""
    tokens = 40
    ids = None
    if routing == "one expert":
        ids = torch.stack([torch.full((tokens,), 4), torch.arange(tokens) % 4], dim=1).to(DEVICE)
    elif routing == "spread":
        ids = torch.stack([torch.arange(tokens) % 3, 3 + torch.arange(tokens) % 3], dim=1).to(DEVICE)
    args = moe_inputs(tokens, torch.float32, seed=3, ids=ids)
    full = moe_triton(*args)
    close(full, moe_reference(*args, invariant=True), torch.float32)
    for rows in (slice(0, 1), slice(7, 8), slice(39, 40), slice(5, 21)):
        part = moe_triton(*(a[rows] if a.shape[0] == tokens else a for a in args))
        assert torch.equal(part, full[rows]), f"tokens {rows} differ from the same tokens in the batch"


def test_route_kernel_matches_reference_and_is_row_invariant():
    logits = rand(37, 10, seed=7)  # 10 experts: masked lanes in a block of 16
    for normalize in (True, False):
        weights, ids = route_triton(logits, 3, normalize)
        ref_weights, ref_ids = route_reference(logits, 3, normalize)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
        for i in (0, 20, 36):
            alone = route_triton(logits[i : i + 1], 3, normalize)
            assert torch.equal(alone[0], weights[i : i + 1]) and torch.equal(alone[1], ids[i : i + 1])


def test_route_kernel_breaks_ties_to_the_lowest_expert():
    """Equal router logits: the kernel takes the lowest expert ids, a rule of the row alone (torch.topk's choice
    among ties, which the CPU reference keeps for Hugging Face parity, depends on its algorithm)."""
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 6] = 1.0
    logits[2, 5] = logits[2, 2] = 0.5
    weights, ids = route_triton(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [6, 0, 1], [2, 5, 0]]
    assert torch.equal(weights[0], torch.full((3,), 1 / 3, device=DEVICE))


def fp8_experts(weight):
    """[E, N, K] -> (e4m3 [E, N, K], fp32 block scales [E, ceil(N/128), ceil(K/128)]), each expert quantized."""
    pairs = [quantize_fp8_block(expert.float().cpu()) for expert in weight]
    return torch.stack([q for q, _ in pairs]).to(DEVICE), torch.stack([s for _, s in pairs]).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_moe_kernel_equals_the_kernel_on_dequantized_experts(dtype):
    """FP8 block experts (H = 136, I = 72: 2 x 2 scale blocks per gate/up weight, the up rows starting inside
    block 0, partial edge blocks) give bit for bit what the same kernels give on the dequantized experts, and
    stay batch-invariant; the reference with scales equals the reference on the dequantized experts."""
    hidden, inter, tokens = 136, 72, 12
    x = rand(tokens, hidden, dtype=dtype, seed=11)
    gate_up, gate_up_scale = fp8_experts(rand(EXPERTS, 2 * inter, hidden, seed=12, scale=hidden**-0.5))
    down, down_scale = fp8_experts(rand(EXPERTS, hidden, inter, seed=13, scale=inter**-0.5))
    weights, ids = route_reference(rand(tokens, EXPERTS, seed=14), TOP_K, True)
    shared, gate = rand(tokens, hidden, dtype=dtype, seed=15), rand(tokens, 1, dtype=dtype, seed=16)
    dense = (dequantize_weight(gate_up, gate_up_scale, dtype), dequantize_weight(down, down_scale, dtype))
    routed = (weights.to(dtype), ids, shared, gate)
    fp8 = moe_triton(x, gate_up, down, *routed, gate_up_scale, down_scale)
    assert torch.equal(fp8, moe_triton(x, *dense, *routed))
    for rows in (slice(0, 1), slice(5, 9)):
        alone = moe_triton(x[rows], gate_up, down, *(a[rows] for a in routed), gate_up_scale, down_scale)
        assert torch.equal(alone, fp8[rows]), f"tokens {rows} differ from the same tokens in the batch"
    for invariant in (True, False):
        ref = moe_reference(x, gate_up, down, *routed, invariant, gate_up_scale, down_scale)
        assert torch.equal(ref, moe_reference(x, *dense, *routed, invariant))
    close(fp8, moe_reference(x, *dense, *routed, True), dtype)


def test_moe_ops_pass_opcheck():
    args = moe_inputs(5, torch.float32)
    check_op(torch.ops.qwen_mtp.moe, (*args, True))
    check_op(torch.ops.qwen_mtp.moe, (*args, False))
    check_op(torch.ops.qwen_mtp.moe_route, (rand(5, EXPERTS), TOP_K, True))
    x, gate_up, down, *rest = args
    (gate_up, gate_up_scale), (down, down_scale) = fp8_experts(gate_up), fp8_experts(down)
    fp8 = (x, gate_up, down, *rest, True, gate_up_scale, down_scale)
    # test_schema would multiply the e4m3 weights, which torch does not implement on CPU (as for linear_fp8)
    torch.library.opcheck(torch.ops.qwen_mtp.moe, fp8, test_utils=("test_faketensor",))
