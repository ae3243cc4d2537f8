"""Tensors in, tokens out: builds a `StepBatch` for the scheduler's choice and runs the target model or the
MTP head on the paged caches. It decides nothing (that is the scheduler's and the speculator's job).

Everything runs the pure-tensor functions of `steps.py`. Prefill chunks, one request at a time, eagerly or
compiled for any chunk length (`compile.enabled` + `compile.prefill`). Decode-path steps (plain decode, verify,
MTP draft) through `graphs.py` (batch buckets, torch.compile, CUDA graphs) when the recipe turns that on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.graphs import StepGraphs, compile_chunk_step
from qwen_mtp.engine.paged_cache import StepBatch, StepKind
from qwen_mtp.engine.request import Request
from qwen_mtp.engine.steps import DecodeSteps, PrefillSteps
from qwen_mtp.model import QwenHybridForCausalLM

__all__ = ["Runner", "StepBatch", "StepKind"]


class Runner:
    def __init__(
        self, model: QwenHybridForCausalLM, pages: PagePool, states: StatePool, device: torch.device, k: int = 0
    ):
        self.model, self.pages, self.states, self.device = model, pages, states, device
        self.steps = DecodeSteps(model, pages, states, k)
        self.graphs: StepGraphs | None = None  # set by the engine when compile.* is on
        self.prefill_steps = PrefillSteps(model, pages, states)
        self.prefill_target, self.prefill_head = self.prefill_steps.target, self.prefill_steps.mtp

    def compile_prefill(self, backend: str, log: Callable[[str], None]) -> None:
        """Prefill through `torch.compile(fullgraph=True)`, one graph for every chunk length (`compile_chunk_step`)."""
        self.prefill_target = compile_chunk_step(self.prefill_steps.target, backend, "prefill", log)
        self.prefill_head = compile_chunk_step(self.prefill_steps.mtp, backend, "MTP prefill", log)

    def batch(self, kind: StepKind, requests: list[Request], tokens: list[list[int]], starts: list[int]) -> StepBatch:
        """A step over `requests`, request b feeding `tokens[b]` at positions starting at `starts[b]`."""
        length = len(tokens[0])
        for request, first in zip(requests, starts, strict=True):
            self.pages.grow(request.id, first + length)
        offsets = torch.arange(length, device=self.device)
        return StepBatch(
            kind=kind,
            token_ids=torch.tensor(tokens, device=self.device),
            positions=torch.tensor(starts, device=self.device)[:, None] + offsets,
            state_rows=torch.tensor([self.states.rows[r.id] for r in requests], device=self.device),
            block_tables=self.pages.block_table([r.id for r in requests]),
            context_lens=torch.tensor([first + length for first in starts], dtype=torch.int32, device=self.device),
            fresh=kind is StepKind.PREFILL and all(first == 0 for first in starts),
        )

    # ---- prefill (one request's chunk; compiled for any length when enabled, never in graphs) ---------------
    def prefill(self, batch: StepBatch) -> torch.Tensor:
        """Target model over a prompt chunk: post-norm hidden states [1, T, H]."""
        return self.prefill_target(
            batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens, batch.fresh
        )

    def prefill_mtp(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """MTP head over a prompt chunk's positions (writing its own KV there): `token_ids` hold the *next*
        tokens (token i+1 at position i), `hidden` [1, T, H] the target's. Returns post-`mtp.norm` hidden."""
        args = (batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)
        return self.prefill_head(batch.token_ids, hidden, *args)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token ids of `hidden` [..., H] (a prefill's last position). Argmax of fp32 logits picks the
        first maximal index, as Hugging Face's greedy search does."""
        return self.model.logits(hidden).float().argmax(dim=-1)

    def chain(self, batch: StepBatch, hidden: torch.Tensor, first: torch.Tensor, override, use_override):
        """The MTP draft chain (eager) after a prefill: see `DecodeSteps.chain`."""
        return self.steps.chain(hidden, first, batch.state_rows, batch.block_tables, override, use_override)

    # ---- decode path (graphs when enabled) -------------------------------------------------------------------
    def decode(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Target over a decode or verify batch: hidden [B, T, H] and greedy tokens [B, T]."""
        run = self.graphs.target if self.graphs is not None else self.steps.target
        return run(batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)

    def draft(self, batch: StepBatch, hidden, accepted, override, use_override) -> torch.Tensor:
        """MTP catch-up over a verified batch plus the draft chain: drafts [B, K] (see `DecodeSteps.draft`)."""
        run = self.graphs.draft if self.graphs is not None else self.steps.draft
        return run(
            batch.token_ids, hidden, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens,
            accepted, override, use_override,
        )  # fmt: skip
