"""Tensors in, tokens out: turns the scheduler's choice into a `StepBatch` and runs the target model or the MTP
head on the paged caches. It decides nothing and allocates nothing (pages and rows are the scheduler's; the
pages a step writes are grown before it runs).

Everything runs the pure-tensor functions of `steps.py`. Prefill chunks, one request at a time, eagerly or
compiled for any chunk length (`compile.enabled` + `compile.prefill`). Decode-path steps (plain decode, verify,
MTP draft) through `graphs.py` (batch buckets, torch.compile, CUDA graphs) when the engine turns that on.
Host inputs reach the device through pinned memory with non-blocking copies (`to_device`), and a step's results
come back in one copy (`read_back`): the step's one device->host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine import sampling
from qwen_mtp.engine.graphs import StepGraphs, compile_chunk_step
from qwen_mtp.engine.paged_cache import StepBatch, StepKind
from qwen_mtp.engine.request import Request
from qwen_mtp.engine.steps import DecodeSteps, PrefillSteps
from qwen_mtp.model import QwenHybridForCausalLM


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on the device without a synchronisation: on CUDA through a pinned buffer and a non-blocking
    copy. The pinned buffer comes from torch's caching host allocator, which keeps it from reuse until the copy
    that reads it has run, so the host can move on at once."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


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

    def tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def batch(
        self, kind: StepKind, requests: list[Request], tokens: list[list[int]] | torch.Tensor, starts: list[int]
    ) -> StepBatch:
        """A step over `requests`, request b feeding `tokens[b]` (host ids, or a [B, T] device tensor) at
        positions starting at `starts[b]`. Their pages must already cover those positions."""
        length = tokens.shape[1] if isinstance(tokens, torch.Tensor) else len(tokens[0])
        return StepBatch(
            kind=kind,
            token_ids=tokens if isinstance(tokens, torch.Tensor) else self.tensor(tokens),
            positions=self.tensor([list(range(first, first + length)) for first in starts]),
            state_rows=self.tensor([self.states.rows[r.id] for r in requests]),
            block_tables=self.tensor(self.pages.block_rows([r.id for r in requests]), torch.int32),
            context_lens=self.tensor([first + length for first in starts], torch.int32),
            fresh=kind is StepKind.PREFILL and all(first == 0 for first in starts),
        )

    def read_back(self, parts: Sequence[torch.Tensor]) -> list[list[int]]:
        """A step's integer results on the host, in one device->host copy: each part flattened to a list."""
        if not parts:
            return []
        flat = torch.cat([part.reshape(-1).long() for part in parts]).tolist()
        values, offset = [], 0
        for part in parts:
            values.append(flat[offset : offset + part.numel()])
            offset += part.numel()
        return values

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

    def choose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tokens chosen from `hidden` [..., H] (a prefill's last position): see `sampling.choose`."""
        return sampling.choose(self.model.logits(hidden), self.model.vocab_shard)

    def chain(self, batch: StepBatch, hidden: torch.Tensor, first: torch.Tensor, override, use_override):
        """The MTP draft chain (eager) after a prefill: see `DecodeSteps.chain`."""
        return self.steps.chain(hidden, first, batch.state_rows, batch.block_tables, override, use_override)

    # ---- decode path (graphs when enabled) -------------------------------------------------------------------
    def decode(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Target over a decode or verify batch: hidden [B, T, H] and chosen tokens [B, T]."""
        run = self.graphs.target if self.graphs is not None else self.steps.target
        return run(batch.token_ids, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens)

    def draft(self, batch: StepBatch, hidden, accepted, override, use_override) -> torch.Tensor:
        """MTP catch-up over a verified batch plus the draft chain: drafts [B, K] (see `DecodeSteps.draft`)."""
        run = self.graphs.draft if self.graphs is not None else self.steps.draft
        return run(
            batch.token_ids, hidden, batch.positions, batch.state_rows, batch.block_tables, batch.context_lens,
            accepted, override, use_override,
        )  # fmt: skip
