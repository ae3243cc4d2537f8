"""What one engine step hands the model: `StepBatch` (the step's tensors) and `PagedStepCache`, the
`ForwardCache` through which the layers read and write the shared KV page pool and state pool. No
module-global context: a step's tensors travel in the `StepBatch`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.sampling import SamplingRows
from qwen_mtp.ops.conv import conv_update
from qwen_mtp.ops.gdn import gdn_recurrent
from qwen_mtp.ops.paged_attention import paged_attention
from qwen_mtp.ops.prefill_attention import paged_prefill_attention


class StepKind(enum.Enum):
    PREFILL = "prefill"  # one request's prompt chunk, chunked delta rule
    DECODE = "decode"  # T tokens per request, token by token: plain decode (T=1) and verify (T=K+1)


@dataclass
class StepBatch:
    """One forward: each of B requests feeds T consecutive tokens."""

    kind: StepKind
    token_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    state_rows: torch.Tensor  # [B] rows of the state pool
    block_tables: torch.Tensor  # [B, max pages] int32: each request's KV pages
    context_lens: torch.Tensor  # [B] int32: positions cached after this step
    fresh: bool  # the sequences start here: no conv window or SSM state yet
    sampling: SamplingRows | None = None  # the requests' sampler inputs (decode-kind steps)


class PagedStepCache:
    """The `ForwardCache` the model sees during one engine step: reads and writes the shared pools through
    the custom ops (`qwen_mtp::paged_attention`, `conv_update`, `gdn_recurrent`; Triton on CUDA)."""

    def __init__(self, batch: StepBatch, pages: PagePool, states: StatePool):
        self.batch, self.pages, self.states = batch, pages, states
        # Decode, verify and draft rows share a step with whatever else is running: their linears must compute
        # each row as it would be alone. A prefill chunk runs one request alone.
        self.batch_invariant = batch.kind is StepKind.DECODE
        self.prefill_plans = False

    def positions(self, num_tokens: int) -> torch.Tensor:
        return self.batch.positions

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        batch, kv = self.batch, self.pages.layer_kv(layer)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, heads, D]
        # Decode / verify: one query at a time over exactly its visible keys, so position p of a (K+1)-token
        # verify is computed as a 1-token decode at p computes it. Prefill: a chunk's queries in tiles.
        op = paged_attention if batch.kind is StepKind.DECODE else paged_prefill_attention
        out = op(q, k, v, kv, batch.block_tables, batch.context_lens, batch.positions, scale)
        return out.transpose(1, 2)

    def sequences(self) -> list[tuple[slice, PagedStepCache]]:
        return [(slice(None), self)]  # one request per batch row

    def gdn_recurrent(self, num_tokens: int) -> bool:
        return self.batch.kind is StepKind.DECODE

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.batch.fresh:
            return None, None  # the layer's zero-initial path, exactly as a whole-sequence forward
        return self.states.read(layer, self.batch.state_rows)

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        self.states.write(layer, self.batch.state_rows, window, ssm)

    def gdn_conv_update(self, layer: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        pool = self.states.layer_conv(layer)
        return conv_update(x, weight, pool, self.batch.state_rows, self.states.committed)

    def gdn_delta_rule(self, layer, q, k, v, a, b, A_log, dt_bias) -> torch.Tensor:  # noqa: N803
        pool, rows, committed = self.states.layer_ssm(layer), self.batch.state_rows, self.states.committed
        return gdn_recurrent(q, k, v, a, b, A_log, dt_bias, pool, rows, committed)
