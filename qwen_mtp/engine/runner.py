"""Tensors in, tokens out: turns the scheduler's choice into a `StepBatch` and runs the target model or the MTP
head on the paged caches. It decides nothing and allocates nothing (pages and rows are the scheduler's; the
pages a step writes are grown before it runs).

Everything runs the pure-tensor functions of `steps.py`. Prefill chunks, one request at a time, eagerly or
compiled for any chunk length (`compile.enabled` + `compile.prefill`); with mixed steps all of a step's chunks
in one packed forward (`prefill_packed`, eager). Decode-path steps (plain decode, verify,
MTP draft) through `graphs.py` (batch buckets, torch.compile, CUDA graphs) when the engine turns that on.
Host inputs reach the device through pinned memory with non-blocking copies (`to_device`), and a step's results
come back in one copy (`start_read`, then its `values()`): the step's one device->host synchronisation, queued
behind the step and waited for later, so the lookahead can launch the next step in between.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine import grammar, sampling
from qwen_mtp.engine.graphs import ChunkGraphs, StepGraphs, compile_chunk_step
from qwen_mtp.engine.packed import PackedChunks
from qwen_mtp.engine.paged_cache import StepBatch, StepKind
from qwen_mtp.engine.penalties import PenaltyState
from qwen_mtp.engine.request import Request
from qwen_mtp.engine.scheduler import PrefillChunk
from qwen_mtp.engine.steps import DecodeSteps, PrefillSteps
from qwen_mtp.model import QwenHybridForCausalLM


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on the device without a synchronisation: on CUDA through a pinned buffer and a non-blocking
    copy. The pinned buffer comes from torch's caching host allocator, which keeps it from reuse until the copy
    that reads it has run, so the host can move on at once."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class PendingRead:
    """A step's results on their way to the host (`Runner.start_read`): the flat copy, the parts' sizes and
    kinds, and on CUDA the event the copy completes."""

    flat: torch.Tensor | None
    sizes: list[int]
    floating: list[bool]
    copied: torch.cuda.Event | None = None

    def values(self) -> list[list]:
        """Wait for the copy; each part as a list (ints; floats for floating parts)."""
        if self.flat is None:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        flat = self.flat.tolist()
        if any(self.floating):
            kinds = [floating for floating, size in zip(self.floating, self.sizes, strict=True) for _ in range(size)]
            flat = [value if floating else int(value) for value, floating in zip(flat, kinds, strict=True)]
        values, offset = [], 0
        for size in self.sizes:
            values.append(flat[offset : offset + size])
            offset += size
        return values


class Runner:
    def __init__(
        self, model: QwenHybridForCausalLM, pages: PagePool, states: StatePool, device: torch.device, k: int = 0
    ):
        self.model, self.pages, self.states, self.device = model, pages, states, device
        self.coupled_drafts = True  # drafts from the same noise as the target's choice (`mtp.coupled_drafts`)
        self.grammars: grammar.Grammars | None = None  # structured outputs' token masks (set by the engine)
        self.steps = DecodeSteps(model, pages, states, k)
        # the counts cover the whole vocabulary: under tensor parallelism a penalized step gathers its rows
        self.penalties = PenaltyState(states.num_rows + 1, model.vocab_rows, device)
        self.steps.penalties = self.penalties
        self.graphs: StepGraphs | None = None  # set by the engine when compile.* is on
        self.chunk_graphs: ChunkGraphs | None = None  # full prefill chunks in graphs (compile.prefill_graphs)
        self.prefill_steps = PrefillSteps(model, pages, states)
        self.prefill_target, self.prefill_head = self.prefill_steps.target, self.prefill_steps.mtp

    def compile_prefill(self, backend: str, log: Callable[[str], None]) -> None:
        """Prefill through `torch.compile(fullgraph=True)`, one graph for every chunk length (`compile_chunk_step`)."""
        self.prefill_target = compile_chunk_step(self.prefill_steps.target, backend, "prefill", log)
        self.prefill_head = compile_chunk_step(self.prefill_steps.mtp, backend, "MTP prefill", log)

    def tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without a synchronisation (as `to_device`)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def sampling(self, requests: list[Request], drafts: list[list[int]] | None = None) -> sampling.SamplingRows:
        """The requests' sampler inputs on the device (nothing to copy when they are all greedy). With a structured
        output among them, the token masks of each request's position after its output and after each of
        `drafts[b]` (`Grammars.masks`)."""
        allowed = None
        if grammar.constrained(requests):
            allowed = self.upload(self.grammars.masks(requests, drafts))
        lengths = [len(r.prompt) for r in requests]
        return sampling.rows_of([r.params for r in requests], self.tensor, lengths, allowed)

    def chain_sampling(self, requests: list[Request]) -> sampling.SamplingRows:
        """The sampler inputs of a draft chain run on its own (after a prompt's last chunk, or a catch-up): as
        `sampling`, without the grammar masks, which a draft chain never applies (`Mode.for_drafts`), so none is
        computed; the chain's mode and inputs are the same."""
        params = [replace(r.params, structured=None) if r.params.structured is not None else r.params for r in requests]
        return sampling.rows_of(params, self.tensor, [len(r.prompt) for r in requests])

    def batch(
        self,
        kind: StepKind,
        requests: list[Request],
        tokens: list[list[int]] | torch.Tensor,
        starts: list[int],
        shift: torch.Tensor | None = None,
    ) -> StepBatch:
        """A step over `requests`, request b feeding `tokens[b]` (host ids, or a [B, T] device tensor) at
        positions starting at `starts[b]`, plus `shift[b]` when given (a device tensor [B]: a lookahead verify
        starts where the verify in flight will have accepted up to). Their pages must already cover those
        positions. Decode-kind steps carry the requests' sampler inputs (with a structured output, the masks after
        each request's output and its drafts `tokens[b][1:]`, which must then be host ids)."""
        on_device = isinstance(tokens, torch.Tensor)
        if kind is StepKind.DECODE and on_device and grammar.constrained(requests):
            raise ValueError(
                "a step with a structured output needs its tokens on the host (it is never launched ahead)"
            )
        length = tokens.shape[1] if on_device else len(tokens[0])
        positions = self.tensor([list(range(first, first + length)) for first in starts])
        lens = self.tensor([first + length for first in starts], torch.int32)
        if shift is not None:
            positions, lens = positions + shift[:, None], lens + shift.to(torch.int32)
        return StepBatch(
            kind=kind,
            token_ids=tokens if on_device else self.tensor(tokens),
            positions=positions,
            state_rows=self.tensor([self.states.rows[r.id] for r in requests]),
            block_tables=self.tensor(self.pages.block_rows([r.id for r in requests]), torch.int32),
            context_lens=lens,
            fresh=kind is StepKind.PREFILL and all(first == 0 for first in starts),
            sampling=self.sampling(requests, None if on_device else [t[1:] for t in tokens])
            if kind is StepKind.DECODE
            else None,
        )

    def start_read(self, parts: Sequence[torch.Tensor]) -> PendingRead:
        """A step's results on their way to the host, in one device->host copy queued now, behind the work that
        computes `parts`; `values()` waits for it alone and gives each part flattened to a list (of ints; of floats
        for floating parts, which travel as float64 with the integers, exact for both). Work launched in between
        (the lookahead's next step) runs on meanwhile."""
        if not parts:
            return PendingRead(None, [], [])
        floating = [part.is_floating_point() for part in parts]
        dtype = torch.float64 if any(floating) else torch.long
        flat = torch.cat([part.reshape(-1).to(dtype) for part in parts])
        if flat.device.type != "cuda":
            return PendingRead(flat, [part.numel() for part in parts], floating)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)  # pinned: the copy does not block
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return PendingRead(host, [part.numel() for part in parts], floating, copied)

    # ---- prefill (one request's chunk; compiled for any length when enabled, or full chunks in graphs) -------
    def prefill(self, batch: StepBatch) -> torch.Tensor:
        """Target model over a prompt chunk: post-norm hidden states [1, T, H]."""
        args = (batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)
        if self.chunk_graphs is not None and self.chunk_graphs.fits(batch.token_ids, batch.block_tables):
            return self.chunk_graphs.target(*args, batch.fresh)
        return self.prefill_target(*args, batch.fresh)

    def packed(self, parts: Sequence[tuple[Request, int, list[int]]]) -> PackedChunks:
        """Several requests' spans end to end as one packed step, each part (request, first position, the tokens
        fed there); a span from position 0 is fresh (only the GDN layers read that: no state before it)."""
        ids = [request.id for request, _, _ in parts]
        ranges = [range(first, first + len(tokens)) for _, first, tokens in parts]
        lengths = tuple(len(span) for span in ranges)
        return PackedChunks(
            token_ids=self.tensor([[t for _, _, tokens in parts for t in tokens]]),
            positions=self.tensor([[p for span in ranges for p in span]]),
            state_rows=self.tensor([self.states.rows[i] for i in ids]),
            block_tables=self.tensor(self.pages.block_rows(ids), torch.int32),
            context_lens=self.tensor([span.stop for span in ranges], torch.int32),
            cu_seqlens=self.tensor([0, *itertools.accumulate(lengths)], torch.int32),
            lengths=lengths,
            fresh=tuple(span.start == 0 for span in ranges),
        )

    def prefill_packed(self, chunks: Sequence[PrefillChunk]) -> list[torch.Tensor]:
        """Target model over several requests' prompt chunks in one packed forward (mixed steps; eager: the
        layout changes every step): each chunk's post-norm hidden states [1, T_i, H], views of one tensor."""
        batch = self.packed([(c.request, c.start, c.request.prompt[c.start : c.start + c.length]) for c in chunks])
        if (
            len(chunks) == 1
            and self.chunk_graphs is not None
            and self.chunk_graphs.fits(batch.token_ids, batch.block_tables)
        ):
            args = (batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)
            return [self.chunk_graphs.packed_alone(*args, batch.fresh[0])]
        hidden = self.prefill_steps.packed(batch)
        return [hidden[:, part] for part in batch.slices()]

    def prefill_mtp_spans(self, spans: Sequence[tuple[Request, int, list[int], torch.Tensor]]) -> torch.Tensor:
        """The MTP head over spans of positions of several requests, each span (request, first position, the next
        tokens there: token i+1 at position i, the target's hidden states there [T, H]), writing their MTP KV, in
        one packed forward (one span: as a prompt chunk). Returns the post-`mtp.norm` hidden state at each span's
        last position [S, H], where a draft chain starts."""
        if len(spans) == 1:
            request, first, following, hidden = spans[0]
            batch = self.batch(StepKind.PREFILL, [request], [following], [first])
            return self.prefill_mtp(batch, hidden[None])[:, -1]
        batch = self.packed([(request, first, following) for request, first, following, _ in spans])
        out = self.prefill_steps.mtp_packed(batch, torch.cat([hidden for *_, hidden in spans])[None])
        return out[0, [part.stop - 1 for part in batch.slices()]]

    def prefill_mtp(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """MTP head over a prompt chunk's positions (writing its own KV there): `token_ids` hold the *next*
        tokens (token i+1 at position i), `hidden` [1, T, H] the target's. Returns post-`mtp.norm` hidden."""
        args = (batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)
        if self.chunk_graphs is not None and self.chunk_graphs.fits(batch.token_ids, batch.block_tables):
            return self.chunk_graphs.mtp(batch.token_ids, hidden, *args)
        return self.prefill_head(batch.token_ids, hidden, *args)

    def choose(
        self, hidden: torch.Tensor, request: Request, position: int, stop_ids: set[int] | frozenset = frozenset()
    ) -> tuple[torch.Tensor, sampling.Logprobs | None]:
        """The token [1] chosen from `hidden` [1, H] (a prefill's last position) for the token at `position`, and
        its logprobs if the request asks: see `sampling.choose`. A penalized request's counts start here, with
        `stop_ids` the tokens that would end it (EOS unless ignored, its stop token ids: what `min_tokens` bans)."""
        rows = self.sampling([request])
        logits = self.model.logits(hidden)
        position = self.tensor([position])
        penalized, state_row, row = None, None, self.states.rows[request.id]
        if rows.mode.penalized:
            state_row = self.tensor([row])
            bias = request.params.logit_bias
            ids, values = self.tensor([t for t, _ in bias]), self.tensor([b for _, b in bias], torch.float32)
            vocab = self.penalties.counts.shape[1]  # a stop id past the logits can never be chosen anyway
            stops = self.tensor(sorted(t for t in stop_ids if t < vocab))
            self.penalties.start(row, self.tensor(request.prompt), ids, values, stops)
            penalized = self.penalties.inputs(state_row, position)
        elif self.penalties is not None:
            self.penalties.neutral(row)  # it will share penalized steps' bias reads
        shard = self.model.vocab_shard
        chosen = sampling.choose(logits, rows.mode, position, **rows.tensors, penalty_inputs=penalized, shard=shard)
        if state_row is not None:
            self.penalties.count(state_row, chosen[0][:, None])
        return chosen

    def count_emitted(self, batch: StepBatch, chosen: torch.Tensor, accepted: torch.Tensor | None = None) -> None:
        """After a penalized decode or verify step (`chosen` [B, T]; a verify's `accepted` [B]): its emitted tokens
        join the counts the next steps' penalties read (`PenaltyState.count`)."""
        if batch.sampling is not None and batch.sampling.mode.penalized:
            self.penalties.count(batch.state_rows, chosen, accepted)

    def prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], n: int) -> sampling.Logprobs:
        """Logprobs of `targets` (the prompt tokens after each of the chunk's first len(targets) positions)
        under a prefill chunk's logits (`hidden` [1, T, H]), and the n most likely tokens, computed a slice of
        positions at a time (a chunk of logits at 248k tokens is large)."""
        ids = self.tensor(targets)
        parts = []
        for start in range(0, len(targets), 128):
            logits = self.model.logits(hidden[0, start : min(start + 128, len(targets))])
            if self.model.vocab_shard is not None:  # tensor parallel: the whole rows, the same on every rank
                logits = self.model.vocab_shard.gather(logits)
            parts.append(sampling.token_logprobs(logits, ids[start : start + 128], n))
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def chain(self, batch: StepBatch, hidden: torch.Tensor, first: torch.Tensor, override, use_override):
        """The MTP draft chain (eager) after a prefill: see `DecodeSteps.chain`."""
        rows, mode = self.sampling_for_drafts(batch)
        return self.steps.chain(
            hidden, first, batch.state_rows, batch.block_tables, override, use_override, mode=mode, **rows
        )

    def sampling_for_drafts(self, batch: StepBatch) -> tuple[dict[str, torch.Tensor], sampling.Mode]:
        rows = batch.sampling
        mode = rows.mode.for_drafts(self.coupled_drafts) if rows is not None else sampling.GREEDY
        return {name: rows.tensors[name] for name in sampling.row_fields(mode)}, mode

    # ---- decode path (graphs when enabled) -------------------------------------------------------------------
    def decode(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, sampling.Logprobs | None]:
        """Target over a decode or verify batch: hidden [B, T, H], chosen tokens [B, T] and, when a request asks,
        their logprobs (see `sampling.choose`)."""
        run = self.graphs.target if self.graphs is not None else self.steps.target
        rows = batch.sampling or sampling.SamplingRows(sampling.GREEDY, {})
        return run(
            batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens,
            mode=rows.mode, **rows.tensors,
        )  # fmt: skip

    def draft(self, batch: StepBatch, hidden, accepted, override, use_override) -> torch.Tensor:
        """MTP catch-up over a verified batch plus the draft chain: drafts [B, K] (see `DecodeSteps.draft`)."""
        run = self.graphs.draft if self.graphs is not None else self.steps.draft
        rows, mode = self.sampling_for_drafts(batch)
        return run(
            batch.token_ids, hidden, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens,
            accepted, override, use_override, mode=mode, **rows,
        )  # fmt: skip
