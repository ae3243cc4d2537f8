"""Which token a step emits, and which drafts a verify accepts: the one place both rules live, on the device.

The token at absolute position p of a request is `argmax_v(log pi_p(v) + g(seed, p, v))`. pi_p is
softmax(logits_p / T) after top-k, then top-p (on the renormalised top-k), then min-p (relative to the most likely
token); g is Gumbel noise from a counter-based generator keyed by (the request's seed, p, v) (`ops/sampling.py`).
That is an exact sample from pi_p (the Gumbel-max trick). It depends only on the logits at p, which decode and
verify compute identically for any batch (batch-invariant ops), and on (seed, p): so plain decoding and the verify
of a speculative step choose the same token at every position, whatever else runs. Greedy is T = 0: the argmax of
the fp32 logits (the first maximal index, as Hugging Face's greedy search picks), bit for bit as before sampling
existed: a step whose requests are all greedy and ask no logprobs runs exactly that (`Mode.greedy`).

Filtering is a threshold on the logits: the kept set is {v : logit_v >= tau} (ties with the last kept token are
kept), tau the largest of top-k's k-th largest logit, top-p's last kept logit and min-p's
`max logit + T * ln(min_p)`. Only steps where some sampled request filters compute it (`Mode.filtered`), each row
on its own and without a sort (`ops/sampling.py`: histograms of the logits' values, exact integer masses); a
row without filters gets tau = -inf there, so its token does not depend on which mode its step ran in.

Accept: a verify over `[t_n, d1..dK]` chooses `c_0..c_K`; draft `d_i` is accepted while every draft before it
was, and `d_i == c_{i-1}`. The request then emits `c_0..c_j` (j accepted drafts, then the bonus `c_j`): the
accepted drafts equal the chosen tokens, so the emitted tokens are always the chosen ones and MTP-on gives exactly
MTP-off's tokens, greedy or sampled. Drafts are coupled (`mtp.coupled_drafts`): the MTP head proposes
`argmax_v(log q_p(v) + g(seed, p, v))` over its own filtered distribution q with the *same* noise, so it agrees
with the target whenever the two perturbed argmaxes agree (with probability >= (1 - TV) / (1 + TV)).

Penalties (repetition, presence, frequency: `ops/penalties.py`) change the logits at p before all of that, from
the tokens the request emitted before p (`engine/penalties.py`): a verify's position i counts the drafts before it,
which are the emitted tokens whenever position i matters, so the rule above still holds word for word with the
penalized logits in place of the logits.

A structured output (`grammar.py`) sets every token its grammar forbids at p to -inf after the penalties: a
verify's position i gets the mask after the drafts before it, as it counts them for the penalties, so the rule
holds with the masked logits in place of the logits too.

Logprobs are on the unfiltered, unpenalized, unmasked temperature-1 distribution: `logit - logsumexp(logits)` for
the chosen token and for the `MAX_LOGPROBS` most likely ones (each request keeps the n it asked for). Everything
here is a function of device tensors with no host read, so it runs inside the decode, verify and draft graphs.

Under tensor parallelism the logits are the rank's vocabulary shard. A greedy step (a structured output's mask
included: each rank masks its own ids) takes the argmax across the ranks through `shard` (the model's
`vocab_shard`), breaking ties to the lowest id as `argmax` does. Any other step needs the whole vocabulary (the
softmax, the filters, the counts, the noise of each id): it gathers the rows (`VocabShard.gather`) and every rank
runs the same sampler on the same values, so the ranks choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from qwen_mtp.engine.grammar import apply_token_mask
from qwen_mtp.engine.params import MAX_LOGPROBS, SamplingParams
from qwen_mtp.engine.penalties import PenaltyInputs
from qwen_mtp.ops import sampling as sampling_ops
from qwen_mtp.ops.penalties import apply_penalties

if TYPE_CHECKING:
    from qwen_mtp.parallel.vocab import VocabShard

# the per-request sampler inputs; a step passes the penalties' only when some request is penalized (`row_fields`)
SAMPLER_FIELDS = ("inv_temperature", "top_k", "top_p", "min_p_offset", "seed")
PENALTY_FIELDS = ("repetition", "frequency", "presence", "min_end")


class Mode(NamedTuple):
    """What a step's sampler must compute, from its requests' parameters (host values, never read back): the
    key of its CUDA graph next to the bucket."""

    noise: bool = False  # some request samples (temperature > 0)
    filtered: bool = False  # some sampling request filters (top-k, top-p or min-p): a threshold per row
    logprobs: bool = False  # some request reports logprobs
    penalized: bool = False  # some request has a repetition, presence or frequency penalty
    constrained: bool = False  # some request has a structured output: a mask of allowed tokens per position

    @property
    def greedy(self) -> bool:
        return not (self.noise or self.filtered or self.logprobs or self.penalized or self.constrained)

    def for_drafts(self, coupled: bool) -> Mode:
        """The draft chain's mode: the same noise, filters and penalties when coupled (a draft guesses what the
        target will choose), else greedy argmax of the head's own logits; never a grammar's mask (the host makes
        those, from tokens it has read). Either way only acceptance can change, never a token."""
        return Mode(self.noise, self.filtered, False, self.penalized) if coupled else GREEDY


GREEDY = Mode()


def row_fields(mode: Mode) -> tuple[str, ...]:
    """The per-request inputs a step of `mode` takes (none when greedy): each is a static buffer of its graph,
    copied every step, so an unpenalized step does not carry the penalties'."""
    if mode.greedy:
        return ()
    return SAMPLER_FIELDS + (PENALTY_FIELDS if mode.penalized else ()) + (("allowed",) if mode.constrained else ())


def mode_of(params: Sequence[SamplingParams]) -> Mode:
    sampled = [p for p in params if not p.greedy]
    filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled)
    logprobs = any(p.logprobs is not None for p in params)
    constrained = any(p.structured is not None for p in params)
    return Mode(bool(sampled), filtered, logprobs, any(p.penalized for p in params), constrained)


@dataclass
class SamplingRows:
    """One step's sampler inputs: its `mode` and per-request device tensors [B] named as in `row_fields(mode)`
    (1/T, 0 for greedy; top-k, 0 = off; top-p, 1 = off; T * ln(min_p), -inf = off; seed; when penalized, the
    repetition, frequency and presence penalties, 1 / 0 / 0 = off, and the position where `min_tokens` ends, the
    prompt's length plus it; when constrained, `allowed` [B, T, words]: each chosen position's token mask)."""

    mode: Mode
    tensors: dict[str, torch.Tensor]


def rows_of(
    params: Sequence[SamplingParams],
    to_device: Callable[[list, torch.dtype], torch.Tensor],
    prompt_lengths: Sequence[int] | None = None,
    allowed: torch.Tensor | None = None,
) -> SamplingRows:
    """The sampler inputs of requests with `params` (seeds already drawn) and prompts of `prompt_lengths` (where
    `min_tokens` ends: default 0), through two host->device copies; `allowed`: the token masks of a step with a
    structured output (`Grammars.masks`, on the device)."""
    mode = mode_of(params)
    if mode.greedy:
        return SamplingRows(mode, {})
    floats = [[_inverse(p.temperature) for p in params], [p.top_p for p in params], [_min_p_offset(p) for p in params]]
    if mode.penalized:
        floats += [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                   [p.presence_penalty for p in params]]  # fmt: skip
    floats = to_device(floats, torch.float32)
    ints = [[p.top_k if not p.greedy else 0 for p in params], [p.seed or 0 for p in params]]
    if mode.penalized:
        lengths = prompt_lengths or [0] * len(params)
        ints.append([n + p.min_tokens for n, p in zip(lengths, params, strict=True)])
    ints = to_device(ints, torch.long)
    values = (floats[0], ints[0], floats[1], floats[2], ints[1], *floats[3:], *ints[2:])
    if mode.constrained:
        if allowed is None:
            raise ValueError("a step with a structured output needs its token masks (`Grammars.masks`)")
        values += (allowed,)
    names = dict(zip(row_fields(mode), values, strict=True))
    return SamplingRows(mode, names)


def _inverse(temperature: float) -> float:
    return 1.0 / temperature if temperature > 0 else 0.0


def _min_p_offset(params: SamplingParams) -> float:
    """min-p in logit space: keep logit >= max logit + T * ln(min_p), i.e. p >= min_p * p_max at temperature T."""
    if params.greedy or params.min_p == 0.0:
        return float("-inf")
    return params.temperature * math.log(params.min_p)


def padding_rows(
    size: int, device: torch.device, mode: Mode, length: int = 1, words: int = 0
) -> dict[str, torch.Tensor]:
    """Sampler inputs of padding rows (greedy, no filters, no penalties, every token allowed) for a step of `mode`
    choosing `length` positions per row over `words` mask words: static buffers' defaults."""
    rows = {
        "inv_temperature": torch.zeros(size, dtype=torch.float32, device=device),
        "top_k": torch.zeros(size, dtype=torch.long, device=device),
        "top_p": torch.ones(size, dtype=torch.float32, device=device),
        "min_p_offset": torch.full((size,), float("-inf"), dtype=torch.float32, device=device),
        "seed": torch.zeros(size, dtype=torch.long, device=device),
        "repetition": torch.ones(size, dtype=torch.float32, device=device),
        "frequency": torch.zeros(size, dtype=torch.float32, device=device),
        "presence": torch.zeros(size, dtype=torch.float32, device=device),
        "min_end": torch.zeros(size, dtype=torch.long, device=device),
        "allowed": torch.full((size, length, words), -1, dtype=torch.int32, device=device),
    }
    return {name: rows[name] for name in row_fields(mode)}


Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # chosen [...], top ids [..., N], top logprobs [..., N]


def choose(
    logits: torch.Tensor,  # [B, V] or [B, T, V]
    mode: Mode = GREEDY,
    positions: torch.Tensor | None = None,  # [B] or [B, T] long: the absolute position of each token chosen
    inv_temperature: torch.Tensor | None = None,  # [B] per request (see `SamplingRows`)
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p_offset: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    repetition: torch.Tensor | None = None,  # [B] per request: the penalties (`SamplingRows`)
    frequency: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
    min_end: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,  # [B, W] or [B, T, W] int32: constrained, each position's token mask
    penalty_inputs: PenaltyInputs | None = None,  # penalized: what each row's penalties read
    shard: VocabShard | None = None,  # tensor parallel: `logits` are this rank's vocabulary shard [..., V/tp]
) -> tuple[torch.Tensor, Logprobs | None]:
    """The emitted token ids [B] or [B, T], and (with `mode.logprobs`) their logprobs. With `mode.penalized`,
    `penalty_inputs` holds what each row's penalties read (`PenaltyState.inputs`); with `mode.constrained`,
    `allowed` the tokens each position may take. The choice is made on the penalized, masked logits, the logprobs
    stay those of the model's own distribution."""
    if shard is not None:
        if mode.greedy or mode == Mode(constrained=True):  # an argmax: each rank's best, then the best of those
            values = logits.float()
            if mode.constrained:  # this rank's ids of each position's mask
                values = apply_token_mask(values, allowed, shard.start)
            return shard.argmax(values), None
        logits = shard.gather(logits)  # sampling, penalties, logprobs: the whole rows, the same on every rank
    if mode.greedy:
        return logits.float().argmax(dim=-1), None
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)

    def per_row(values: torch.Tensor) -> torch.Tensor:  # [B] -> one per row of `flat`
        return values.view(-1, *([1] * (len(lead) - 1))).expand(lead).reshape(-1)

    inv_t = per_row(inv_temperature)
    raw = flat
    if mode.penalized:
        penalties = tuple(per_row(t).contiguous() for t in (repetition, frequency, presence, min_end))
        flat = apply_penalties(flat, *penalty_inputs, *penalties)
    if mode.constrained:
        flat = apply_token_mask(flat, allowed)
    threshold = None
    if mode.filtered:
        threshold = filter_threshold(flat, inv_t, per_row(top_k), per_row(top_p), per_row(min_p_offset))
    tokens, lse = sampling_ops.sample_tokens(flat, inv_t, threshold, per_row(seed), positions.reshape(-1))
    if not mode.logprobs:
        return tokens.view(lead), None
    if flat is not raw:  # logprobs are the model's own distribution's: its normaliser, not the penalized one's
        lse = sampling_ops.sample_tokens(raw, torch.zeros_like(inv_t), None, per_row(seed), positions.reshape(-1))[1]
    chosen = raw.gather(1, tokens[:, None])[:, 0].float() - lse
    top = raw.topk(min(MAX_LOGPROBS, vocab), dim=-1)
    top_logprobs = top.values.float() - lse[:, None]
    return tokens.view(lead), (chosen.view(lead), top.indices.view(*lead, -1), top_logprobs.view(*lead, -1))


def filter_threshold(
    logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p_offset: torch.Tensor
) -> torch.Tensor:
    """tau [R] for logits [R, V]: the smallest logit the filters keep (-inf for a row without filters), through
    `qwen_mtp::filter_threshold` (histograms on CUDA: no sort of the vocabulary, which cost the sampled
    verify more than the rest of the sampler)."""
    vocab = logits.shape[-1]
    keep = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    return sampling_ops.filter_threshold(logits, keep, inv_t, top_p, min_p_offset)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, n: int) -> Logprobs:
    """Logprobs on the temperature-1 distribution of `targets` [R] under `logits` [R, V], and the n most likely
    tokens: what prompt positions report (a prefill chunk, one request: plain torch, no invariance needed)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
    return logprobs.gather(1, targets[:, None])[:, 0], top.indices, top.values


def accept(drafts: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request [B] (long) for `drafts` [B, K] and the verify's chosen tokens [B, K+1]:
    the length of the prefix where `drafts[:, i] == chosen[:, i]`."""
    matches = drafts == chosen[:, : drafts.shape[1]]
    return matches.long().cumprod(dim=1).sum(dim=1)
