"""The sampler's Triton kernels equal their plain-torch references (under the CPU interpreter here): the noise bit
for bit, the chosen tokens, the log-sum-exp, the top-p cut; and a row's result does not depend on the other rows."""

import pytest
import torch
from op_helpers import DEVICE, rand

from qwen_mtp.ops import sampling

VOCAB, BLOCK = 1000, 256  # four chunks per row: the cross-chunk combine runs


def rows(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    inv_t = torch.tensor([0.0, 1 / 0.7, 1 / 1.3, 1.0, 2.0, 0.5, 1.0, 0.0])[:count]
    seeds = torch.randint(0, 2**63 - 1, (count,), generator=gen)
    seeds[0] = 2**63 - 1  # the largest seed: both 32-bit halves used
    positions = torch.randint(0, 2**18, (count,), generator=gen)
    return inv_t.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)


def test_uniform_noise_is_a_pure_function_of_seed_position_token():
    seed, position = torch.tensor([5, 5, 6]), torch.tensor([10, 11, 10])
    u = sampling.uniform_noise(seed, position, 64)
    assert torch.equal(u, sampling.uniform_noise(seed, position, 64))
    assert torch.equal(sampling.uniform_noise(seed[:1], position[:1], 64), u[:1])  # alone == in a batch
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert u.min() > 0 and u.max() < 1
    many = sampling.uniform_noise(torch.arange(2000), torch.zeros(2000, dtype=torch.long), 50)
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.002


@pytest.mark.parametrize("filtered", [False, True])
def test_sample_kernel_equals_reference(filtered):
    logits = rand(8, VOCAB, seed=1, scale=3.0)
    inv_t, seeds, positions = rows(8)
    threshold = rand(8, seed=2).clamp(-1, 2) if filtered else None
    if filtered:
        threshold[3] = float("-inf")
    ref_tokens, ref_lse = sampling.sample_tokens_reference(logits, inv_t, threshold, seeds, positions, BLOCK)
    tokens, lse = sampling.sample_tokens_triton(logits, inv_t, threshold, seeds, positions, BLOCK)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(tokens[0], logits[0].argmax()) and torch.equal(tokens[7], logits[7].argmax())  # greedy rows
    if filtered:
        kept = logits.gather(1, tokens[:, None])[:, 0] >= threshold
        assert kept[inv_t > 0].all()


def test_sample_kernel_noise_equals_reference_bit_for_bit():
    """With flat logits the noise alone decides: over many (seed, position) rows the kernel picks the token the
    reference's noise ranks first, and the reference's Gumbel argmax is the argmax of its uniforms."""
    count = 64
    seeds = torch.arange(count, device=DEVICE) * 7919 + 2**33
    positions = torch.arange(count, device=DEVICE) * 31
    flat = torch.zeros(count, VOCAB, device=DEVICE)
    inv_t = torch.ones(count, device=DEVICE)
    tokens, _ = sampling.sample_tokens_triton(flat, inv_t, None, seeds, positions, BLOCK)
    assert torch.equal(tokens, sampling.uniform_noise(seeds, positions, VOCAB).argmax(dim=-1))


def test_sample_kernel_rows_are_batch_invariant():
    logits = rand(8, VOCAB, seed=3, scale=2.0)
    inv_t, seeds, positions = rows(8, seed=4)
    threshold = torch.full((8,), -0.5, device=DEVICE)
    tokens, lse = sampling.sample_tokens_triton(logits, inv_t, threshold, seeds, positions, BLOCK)
    for r in (0, 5):
        one = slice(r, r + 1)
        args = (logits[one], inv_t[one], threshold[one], seeds[one], positions[one])
        alone = sampling.sample_tokens_triton(*args, BLOCK)
        assert torch.equal(alone[0], tokens[one]) and torch.equal(alone[1], lse[one])


def test_top_p_kernel_equals_reference():
    ordered = rand(6, VOCAB, seed=5, scale=2.0).sort(dim=-1, descending=True).values
    keep = torch.tensor([VOCAB, 10, 500, VOCAB, 3, 1], device=DEVICE)
    inv_t = torch.tensor([1.0, 1 / 0.7, 1 / 1.3, 1.0, 2.0, 0.5], device=DEVICE)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 1.0, 0.3], device=DEVICE)
    ref = sampling.top_p_threshold_reference(ordered, keep, inv_t, top_p, BLOCK)
    assert torch.equal(sampling.top_p_threshold_triton(ordered, keep, inv_t, top_p, BLOCK), ref)
    # the cut, from first principles: the smallest prefix of the top-k whose mass reaches top_p
    for r in range(6):
        probs = torch.softmax(ordered[r, : keep[r]].double() * inv_t[r], dim=0)
        before = torch.cumsum(probs, dim=0) - probs
        last = int((before < top_p[r]).sum()) - 1
        assert ref[r] == ordered[r, last]


def test_kernels_take_one_requests_parameters_expanded_over_its_verify_rows():
    """A verify of one request (B = 1, T = K + 1 rows) hands the kernels its parameters as stride-0 views, which
    `sampling.choose` gets by expanding [B] over the rows, sitting in one tensor beside the other parameters
    (`sampling.rows_of`). Every row must read the request's own values, not its neighbours in memory."""
    logits = rand(4, VOCAB, seed=6, scale=3.0)
    ordered = logits.sort(dim=-1, descending=True).values
    packed = torch.tensor([[0.0], [1.0], [0.9], [float("-inf")]], device=DEVICE)  # 1/T (greedy), then others
    ints = torch.tensor([[12345], [678]], device=DEVICE)  # seed, then another request's
    inv_t, seed = packed[0].expand(4), ints[0].expand(4)
    top_p, keep = packed[2].expand(4), torch.full((4,), VOCAB, device=DEVICE)
    positions = torch.arange(100, 104, device=DEVICE)
    assert inv_t.stride(0) == 0  # what the kernels must cope with
    tokens, _ = sampling.sample_tokens_triton(logits, inv_t, None, seed, positions, BLOCK)
    assert torch.equal(tokens, logits.argmax(dim=-1))  # greedy on every row
    own = (torch.full((4,), 1 / 0.7, device=DEVICE), torch.full((4,), 0.9, device=DEVICE))
    sampled = packed.clone()
    sampled[0] = 1 / 0.7
    tokens, _ = sampling.sample_tokens_triton(logits, sampled[0].expand(4), None, seed, positions, BLOCK)
    ref, _ = sampling.sample_tokens_reference(logits, own[0], None, seed.contiguous(), positions, BLOCK)
    assert torch.equal(tokens, ref)
    cut = sampling.top_p_threshold_triton(ordered, keep, sampled[0].expand(4), top_p, BLOCK)
    assert torch.equal(cut, sampling.top_p_threshold_reference(ordered, keep, own[0], own[1], BLOCK))
