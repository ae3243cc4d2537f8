"""Tensors in, tokens out: builds a `StepBatch` for the scheduler's choice and runs the model on the paged
caches. It decides nothing (that is the scheduler's job) and keeps no module-global context: the step's
tensors travel in the `StepBatch` and reach the layers through a `PagedStepCache`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.request import Request
from qwen_mtp.engine.scheduler import PrefillChunk
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.ops.attention import causal_attention
from qwen_mtp.ops.linear import batch_invariant_linears


@dataclass
class StepBatch:
    """One forward: each of B requests feeds T consecutive tokens."""

    request_ids: list[int]
    token_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    state_rows: torch.Tensor  # [B] rows of the state pool
    context_lens: list[int]  # per request: positions cached after this step (host side, no sync)
    fresh: bool  # the sequences start here: no conv window or SSM state yet


class PagedStepCache:
    """The `ForwardCache` the model sees during one engine step: reads and writes the shared pools."""

    def __init__(self, batch: StepBatch, pages: PagePool, states: StatePool):
        self.batch, self.pages, self.states = batch, pages, states

    def positions(self, num_tokens: int) -> torch.Tensor:
        return self.batch.positions

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        outs = []
        for b, request in enumerate(self.batch.request_ids):
            self.pages.write(layer, request, self.batch.positions[b], k[b].transpose(0, 1), v[b].transpose(0, 1))
            keys, values = self.pages.read(layer, request, self.batch.context_lens[b])  # [S, KV, D]
            # One request at a time: its attention never depends on the others' lengths.
            outs.append(causal_attention(q[b : b + 1], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale))
        return torch.cat(outs, dim=0)

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.batch.fresh:
            return None, None  # the layer's zero-initial path, exactly as a whole-sequence forward
        return self.states.read(layer, self.batch.state_rows)

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        self.states.write(layer, self.batch.state_rows, window, ssm)

    def advance(self, num_tokens: int) -> None:
        """Progress is tracked on the requests by the engine."""


class Runner:
    def __init__(self, model: QwenHybridForCausalLM, pages: PagePool, states: StatePool, device: torch.device):
        self.model, self.pages, self.states, self.device = model, pages, states, device

    def _batch(self, requests: list[Request], tokens: list[list[int]], start: list[int], fresh: bool) -> StepBatch:
        length = len(tokens[0])
        for request, first in zip(requests, start, strict=True):
            self.pages.grow(request.id, first + length)
        offsets = torch.arange(length, device=self.device)
        return StepBatch(
            request_ids=[r.id for r in requests],
            token_ids=torch.tensor(tokens, device=self.device),
            positions=torch.tensor(start, device=self.device)[:, None] + offsets,
            state_rows=torch.tensor([self.states.rows[r.id] for r in requests], device=self.device),
            context_lens=[first + length for first in start],
            fresh=fresh,
        )

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        # Argmax of fp32 logits picks the first maximal index, as Hugging Face's greedy search does.
        return self.model.logits(hidden).float().argmax(dim=-1).tolist()

    def prefill(self, chunk: PrefillChunk) -> int | None:
        """Run one prompt chunk; returns the first generated token when the chunk ends the prompt."""
        request = chunk.request
        tokens = request.prompt[chunk.start : chunk.start + chunk.length]
        batch = self._batch([request], [tokens], [chunk.start], fresh=chunk.start == 0)
        hidden = self.model.hidden_states(
            batch.token_ids, batch.positions, PagedStepCache(batch, self.pages, self.states)
        )
        if chunk.start + chunk.length < len(request.prompt):
            return None
        return self._greedy(hidden[:, -1])[0]

    def decode(self, requests: list[Request]) -> list[int]:
        """One token for each request (its last token goes in, the next comes out)."""
        tokens = [[r.tokens[r.num_computed]] for r in requests]
        batch = self._batch(requests, tokens, [r.num_computed for r in requests], fresh=False)
        with batch_invariant_linears():
            cache = PagedStepCache(batch, self.pages, self.states)
            hidden = self.model.hidden_states(batch.token_ids, batch.positions, cache)
            return self._greedy(hidden[:, -1])
