"""`qwen_mtp::apply_penalties`: a logit bias, repetition, presence and frequency penalties, and `min_tokens`' ban
on stop tokens, on a batch of logit rows.

Logit row r belongs to the request on state row `rows[r]`; its counts are that row's output counts (`counts`
[S, V] int32: how many times the request emitted each token) plus one for each token of `drafts[r]` (the drafts
a verify position reads before it, -1 for none: `engine/penalties.py` says why), `seen` [S, V] marks its
prompt's tokens, `bias` [S, V] float32 holds its logit bias and `stops` [S, V] bool its stop tokens (EOS unless
ignored, and its `stop_token_ids`). The row chooses the token at `positions[r]`; before `min_end[r]` (the prompt's
length plus `min_tokens`) its stop tokens are banned. With its request's three penalties, per element, in float32
and in this order:

    x = logit + bias                                        where the bias is not 0
    x = x / repetition if x > 0 else x * repetition       where the token is in the prompt or its count > 0
    x = x - frequency * count                               (the product rounded to fp32, then the difference)
    x = x - presence * (count > 0)
    x = -inf                                                where a stop token and positions[r] < min_end[r]

Hugging Face's `RepetitionPenaltyLogitsProcessor` applies the first rule to the tokens of its input ids (prompt and
output); vLLM applies all three so (presence and frequency to output tokens only, as the OpenAI API defines them).
The OpenAI API adds `logit_bias` before sampling, as vLLM does before its penalties. Neutral values (no bias, 1, 0,
0) give back every logit bit for bit (x / 1, x * 1 and x - 0 are exact, and a zero bias is not added, which would
turn -0.0 into +0.0), so a row without penalties chooses in a penalized step as it would in any other.

Every element's result depends only on its own logit, count and its row's values, so a row's numbers never depend
on the other rows, in a 1-token decode or a verify. The kernel reads the counts by state row and adds the drafts
itself, so a verify never builds a [rows x (K+1), V] copy of its requests' counts; it rounds every operation as
torch does (a correctly rounded division, launched with `fp_fusion=False` so no product is contracted into an FMA),
so it equals the reference bit for bit. As a custom op it stays opaque to `torch.compile`, which could otherwise fuse
the reference's operations differently in one compiled step than in another.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced


def apply_penalties_reference(
    logits: torch.Tensor,  # [R, V]
    counts: torch.Tensor,  # [S, V] int32: each state row's output token counts
    seen: torch.Tensor,  # [S, V] bool: each state row's prompt tokens
    bias: torch.Tensor,  # [S, V] float32: each state row's logit bias
    stops: torch.Tensor,  # [S, V] bool: each state row's stop tokens
    rows: torch.Tensor,  # [R] long: the state row of each logit row
    drafts: torch.Tensor,  # [R, D] long: tokens counted once more for the row (-1: none)
    positions: torch.Tensor,  # [R] long: the position of the token the row chooses
    repetition: torch.Tensor,  # [R] float32, 1 = off
    frequency: torch.Tensor,  # [R] float32, 0 = off
    presence: torch.Tensor,  # [R] float32, 0 = off
    min_end: torch.Tensor,  # [R] long: stop tokens are banned at positions before it (0 = off)
) -> torch.Tensor:
    """The penalized logits [R, V] in float32 (the rule above)."""
    x = logits.float()
    row_bias = bias[rows]
    x = torch.where(row_bias != 0, x + row_bias, x)
    count = counts[rows]
    if drafts.shape[1]:
        count.scatter_add_(1, drafts.clamp(min=0), (drafts >= 0).to(count.dtype))
    emitted = count > 0
    scaled = torch.where(x > 0, x / repetition[:, None], x * repetition[:, None])
    x = torch.where(seen[rows] | emitted, scaled, x)
    x = x - frequency[:, None] * count.float()
    x = x - presence[:, None] * emitted.float()
    banned = stops[rows] & (positions < min_end)[:, None]
    return torch.where(banned, float("-inf"), x)


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _penalty_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def penalize_rows(
        logits_ptr, counts_ptr, seen_ptr, bias_ptr, stops_ptr, rows_ptr, drafts_ptr, pos_ptr, rep_ptr, freq_ptr,
        pres_ptr, end_ptr, out_ptr, V, s_logits, s_counts, s_seen, s_bias, s_stops, s_drafts, D,
        BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        state = tl.load(rows_ptr + r).to(tl.int64)
        x = tl.load(logits_ptr + r.to(tl.int64) * s_logits + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + state * s_bias + cols, mask=mask, other=0.0)
        x = tl.where(bias != 0, x + bias, x)
        count = tl.load(counts_ptr + state * s_counts + cols, mask=mask, other=0)
        for d in range(D):
            count += (cols == tl.load(drafts_ptr + r * s_drafts + d)).to(tl.int32)
        seen = tl.load(seen_ptr + state * s_seen + cols, mask=mask, other=0) != 0
        repetition, frequency = tl.load(rep_ptr + r), tl.load(freq_ptr + r)
        presence = tl.load(pres_ptr + r)
        emitted = count > 0
        scaled = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
        x = tl.where(seen | emitted, scaled, x)
        x = x - frequency * count.to(tl.float32)
        x = x - presence * emitted.to(tl.float32)
        if tl.load(pos_ptr + r) < tl.load(end_ptr + r):
            stop = tl.load(stops_ptr + state * s_stops + cols, mask=mask, other=0) != 0
            x = tl.where(stop, float("-inf"), x)
        tl.store(out_ptr + r.to(tl.int64) * V + cols, x, mask=mask)

    return penalize_rows


def apply_penalties_triton(
    logits,
    counts,
    seen,
    bias,
    stops,
    rows,
    drafts,
    positions,
    repetition,
    frequency,
    presence,
    min_end,
    block: int = 2048,
):
    """Triton version of `apply_penalties_reference` (same arguments and result): a program per row and block of
    `block` tokens."""
    import triton

    count, vocab = logits.shape
    out = torch.empty(count, vocab, dtype=torch.float32, device=logits.device)
    if count == 0:
        return out
    assert all(t.stride(1) == 1 for t in (logits, counts, seen, bias, stops))
    per_row = (rows, positions, repetition, frequency, presence, min_end)
    rows, positions, repetition, frequency, presence, min_end = (t.contiguous() for t in per_row)
    width = drafts.shape[1]
    drafts = drafts.contiguous() if width else rows[:, None]  # no drafts: any valid pointer (never read)
    _penalty_kernel()[(count, triton.cdiv(vocab, block))](
        logits, counts, seen.view(torch.uint8), bias, stops.view(torch.uint8), rows, drafts, positions, repetition,
        frequency, presence, min_end, out, vocab, logits.stride(0), counts.stride(0), seen.stride(0), bias.stride(0),
        stops.stride(0), drafts.stride(0), width,
        BLOCK=block, **triton_utils.launch(logits.device, fp_fusion=False),
    )  # fmt: skip
    return out


@torch.library.custom_op("qwen_mtp::apply_penalties", mutates_args=())
def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    bias: torch.Tensor,
    stops: torch.Tensor,
    rows: torch.Tensor,
    drafts: torch.Tensor,
    positions: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    min_end: torch.Tensor,
) -> torch.Tensor:
    """Custom op: `apply_penalties_reference` on CPU, the Triton kernel on CUDA (equal bit for bit)."""
    return apply_penalties_reference(
        logits, counts, seen, bias, stops, rows, drafts, positions, repetition, frequency, presence, min_end
    )


@cuda_kernel(apply_penalties)
def _(logits, counts, seen, bias, stops, rows, drafts, positions, repetition, frequency, presence, min_end):
    args = (logits, counts, seen, bias, stops, rows, drafts, positions, repetition, frequency, presence, min_end)
    if reference_forced("apply_penalties"):
        return apply_penalties_reference(*args)
    return apply_penalties_triton(*args)


@apply_penalties.register_fake
def _(logits, counts, seen, bias, stops, rows, drafts, positions, repetition, frequency, presence, min_end):
    return logits.new_empty(logits.shape, dtype=torch.float32)
