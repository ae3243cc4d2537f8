"""The sampler's Triton kernels equal their plain-torch references (under the CPU interpreter here): the noise bit
for bit, the chosen tokens, the log-sum-exp, the filters' threshold (which keeps a top-p set, checked from first
principles); and a row's result does not depend on the other rows."""

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


NO_MIN_P = float("-inf")


def filter_rows(count, seed=5, dtype=torch.float32):
    """Logits with ties (rounded to 1/4) and a -inf, and filters: top-p alone, top-k alone, both, with min-p,
    greedy and unfiltered rows (whose tau is -inf)."""
    logits = (rand(count, VOCAB, seed=seed, scale=2.0) * 4).round() / 4
    logits[:, 7] = float("-inf")
    logits = logits.to(dtype)
    pattern = [  # (top-k's k, 1/T, top_p, min-p offset)
        (VOCAB, 1.0, 0.9, NO_MIN_P), (10, 1 / 0.7, 0.5, NO_MIN_P), (500, 1 / 1.3, 0.95, NO_MIN_P),
        (VOCAB, 1.0, 0.99, -1.5), (3, 2.0, 1.0, NO_MIN_P), (1, 0.5, 0.3, NO_MIN_P), (VOCAB, 1.0, 1.0, NO_MIN_P),
        (VOCAB, 0.0, 0.9, NO_MIN_P), (40, 1 / 0.7, 1e-6, NO_MIN_P), (VOCAB, 1 / 0.3, 0.999, NO_MIN_P),
    ]  # fmt: skip
    keep, inv_t, top_p, min_p = (torch.tensor(v, device=DEVICE) for v in zip(*pattern[:count], strict=True))
    return logits, keep, inv_t.float(), top_p.float(), min_p.float()


METHODS = [(torch.float32, "radix"), (torch.bfloat16, "radix"), (torch.bfloat16, "counts")]


@pytest.mark.parametrize("dtype,method", METHODS)
def test_filter_threshold_kernel_equals_reference(dtype, method):
    args = filter_rows(10, dtype=dtype)
    ref = sampling.filter_threshold_reference(*args)
    assert torch.equal(sampling.filter_threshold_triton(*args, block=BLOCK, method=method), ref)
    assert torch.isinf(ref[6]) and torch.isinf(ref[7])  # no filters; greedy (top-p alone)
    assert torch.isfinite(ref[[0, 1, 2, 3, 4, 5, 8, 9]]).all()


@pytest.mark.parametrize("dtype,method", [METHODS[0], METHODS[2]])
def test_filter_threshold_keeps_a_top_p_set_from_first_principles(dtype, method):
    """The kept set {logit >= tau}, in float64 from the definitions: the top-k tokens (ties with the k-th kept),
    and among them the smallest set of most likely tokens, ties kept together, whose renormalised probability
    reaches top_p (within fp32 rounding: a set one tie group smaller must fall short by more than 1e-6)."""
    logits, keep, inv_t, top_p, min_p = filter_rows(10, dtype=dtype)
    tau = sampling.filter_threshold_triton(logits, keep, inv_t, top_p, min_p, block=BLOCK, method=method)
    for r in [0, 1, 2, 3, 4, 5, 8, 9]:
        x = logits[r].double()
        values = x.unique(sorted=True).flip(0)  # distinct logits, largest first
        floor_k = values[(x[None, :] >= values[:, None]).sum(dim=1) >= keep[r]][0] if keep[r] < VOCAB else -torch.inf
        inside = x >= floor_k
        probs = torch.where(inside, torch.softmax(torch.where(inside, x * inv_t[r].double(), -torch.inf), 0), 0.0)
        if top_p[r] < 1:
            at_least = torch.stack([probs[x >= v].sum() for v in values])  # mass at or above each distinct logit
            reach = int((at_least < top_p[r].double() - 1e-6).sum())  # groups that clearly fall short
            short = int((at_least < top_p[r].double() + 1e-6).sum())  # groups that fall short within rounding
            candidates = values[reach : short + 1]  # tau_p is one of these (usually the only one)
        else:
            candidates = torch.tensor([-torch.inf], dtype=torch.float64, device=x.device)
        floor_min_p = x.max() + min_p[r].double()
        expected = torch.maximum(
            torch.maximum(candidates, torch.as_tensor(floor_k, device=x.device).double()), floor_min_p
        )
        assert (expected == tau[r].double()).any(), (r, tau[r], expected)


@pytest.mark.parametrize("dtype,method", [METHODS[0], METHODS[2]])
def test_filter_threshold_rows_are_batch_invariant(dtype, method):
    """A row's tau is the same alone, in any batch and at any place in it (the verify's rows, padding rows)."""
    args = filter_rows(10, seed=8, dtype=dtype)
    together = sampling.filter_threshold_triton(*args, block=BLOCK, method=method)
    for rows in ([3], [9, 0], [5, 5, 1, 2]):
        index = torch.tensor(rows, device=DEVICE)
        alone = sampling.filter_threshold_triton(*(a[index] for a in args), block=BLOCK, method=method)
        assert torch.equal(alone, together[index])


def edge_rows(vocab=777):
    """bf16 rows the counted threshold must get right (777 tokens: no multiple of the chunk), each (logits, k, 1/T,
    top_p, min-p offset): kept sets across a block of 1024 values (1.0 and 2.0 end one) and across the sign, ties,
    all-equal logits, a peaked head, each filter alone, top_p tiny, filters off, and a greedy row's top-k."""
    noise = rand(vocab, seed=11)
    peaked = noise.clone()
    peaked[:5] += 12.0
    ties = (noise * 2).round() / 2
    ties[:40] = 3.0
    cases = [
        (2.0 + 0.05 * noise, vocab, 1 / 0.05, 0.5, NO_MIN_P),  # across 2.0
        (1.0 + 0.05 * noise, 300, 1 / 0.02, 0.7, NO_MIN_P),  # top-k and top-p across 1.0
        (0.02 * noise, vocab, 1 / 0.01, 0.9, NO_MIN_P),  # across the sign
        (torch.zeros(vocab, device=noise.device), vocab, 1.0, 0.9, NO_MIN_P),  # all equal: every token kept
        (torch.zeros(vocab, device=noise.device), 10, 1.0, 1.0, NO_MIN_P),  # all equal, top-k: still every token
        (ties, vocab, 1.0, 0.8, NO_MIN_P),  # a tie group of 40 holding most of the mass
        (ties, 45, 1 / 0.7, 0.99, NO_MIN_P),  # top-k's k-th inside a tie group
        (peaked, vocab, 1 / 0.7, 0.95, NO_MIN_P),  # a peaked head: a small window
        (peaked, 3, 1 / 0.7, 1.0, NO_MIN_P),  # top-k alone
        (noise, vocab, 1 / 0.7, 0.9, NO_MIN_P),  # top-p alone
        (noise, vocab, 1 / 0.7, 1.0, -1.0),  # min-p alone
        (noise, vocab, 1 / 0.7, 1e-6, NO_MIN_P),  # top_p tiny: the largest logit
        (noise, vocab, 1 / 0.7, 1.0, NO_MIN_P),  # filters off
        (noise, 20, 0.0, 0.9, NO_MIN_P),  # greedy: top-k alone (top-p needs a temperature)
        (noise * 8, vocab, 1 / 1.5, 0.999, NO_MIN_P),  # a wide row, most of its mass far down
        (noise, vocab - 1, 2.0, 0.95, -0.5),  # every filter
    ]
    logits = torch.stack([c[0] for c in cases]).to(torch.bfloat16)
    keep, inv_t, top_p, min_p = (torch.tensor(v, device=DEVICE) for v in list(zip(*cases, strict=True))[1:])
    return logits, keep, inv_t.float(), top_p.float(), min_p.float()


@pytest.mark.parametrize("method", ["counts", "radix"])
def test_filter_threshold_edge_rows_equal_reference(method):
    args = edge_rows()
    ref = sampling.filter_threshold_reference(*args)
    assert torch.equal(sampling.filter_threshold_triton(*args, block=BLOCK, method=method), ref)
    assert torch.isinf(ref[12]) and ref[3] == 0 and ref[4] == 0  # filters off; all equal: all kept


def test_value_counts_hold_the_top_of_a_row_and_little_of_a_peaked_one():
    """The window is a top set of each row: its counts (from the row's `low` up to its largest value) equal the
    row's own above their lowest counted value, and they hold every kept token; a peaked row's window is a small
    part of it, a flat row's all of it."""
    logits, keep, inv_t, top_p, min_p = edge_rows()
    tau = sampling.filter_threshold_reference(logits, keep, inv_t, top_p, min_p)
    row_max = logits.amax(dim=-1).float()
    counts, window, low, _ = sampling._windowed_counts(logits, keep, inv_t, top_p, row_max, BLOCK)
    keys = sampling.value_keys(logits)
    counted = {}
    for r in range(len(logits)):
        if window[r] < 0:
            assert keep[r] == logits.shape[1] and (top_p[r] == 1 or inv_t[r] == 0)  # no top-k, no top-p
            continue
        own = torch.bincount(keys[r], minlength=1 << 16)
        bottom, top = int(low[r]), int(keys[r].max())
        mine = counts[r, bottom : top + 1].long()
        lowest = bottom + int(mine.nonzero().min())
        assert torch.equal(counts[r, lowest : top + 1].long(), own[lowest : top + 1]), r
        counted[r] = int(mine.sum())
        assert counted[r] >= (logits[r].float() >= tau[r]).sum(), r
    assert counted[7] < 50 and counted[8] < 50  # the peaked head's 5 tokens and little else
    assert counted[3] == logits.shape[1]  # all equal: one value, every token


def test_counted_threshold_reads_only_what_it_wrote(monkeypatch):
    """The kernels' buffers come from `torch.empty` (a CUDA graph's pool holds the last step's numbers): filled with
    garbage here, tau is still the reference's."""
    empty = torch.empty

    def garbage(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 12345)

    args = edge_rows()
    ref = sampling.filter_threshold_reference(*args)
    monkeypatch.setattr(torch, "empty", garbage)
    assert torch.equal(sampling.filter_threshold_triton(*args, block=BLOCK, method="counts"), ref)


def test_fixed_point_mass_is_the_exponential():
    """The portable exp (Cody-Waite reduction, a polynomial with one rounding per operation, an integer shift) is
    exp to about 1 ulp, in integers: the most likely token weighs exactly 2^MASS_BITS."""
    x = torch.linspace(-40, 0, 20001)[None, :]
    mass = sampling.fixed_point_mass(x, torch.zeros(1), torch.ones(1))
    exact = torch.exp(x.double()) * 2.0**sampling.MASS_BITS
    assert mass.dtype == torch.long and mass[0, -1] == 2**sampling.MASS_BITS
    assert ((mass - exact).abs() <= exact * 1e-7 + 1).all()  # ~1 ulp, and the floor


def test_kernels_take_one_requests_parameters_expanded_over_its_verify_rows():
    """A verify of one request (B = 1, T = K + 1 rows) hands the kernels its parameters as stride-0 views, which
    `sampling.choose` gets by expanding [B] over the rows, sitting in one tensor beside the other parameters
    (`sampling.rows_of`). Every row must read the request's own values, not its neighbours in memory."""
    logits = rand(4, VOCAB, seed=6, scale=3.0)
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
    minus_inf = packed[3].expand(4)
    cut = sampling.filter_threshold_triton(logits, keep, sampled[0].expand(4), top_p, minus_inf, BLOCK)
    own_min_p = torch.full((4,), float("-inf"), device=DEVICE)
    assert torch.equal(cut, sampling.filter_threshold_reference(logits, keep, own[0], own[1], own_min_p))
