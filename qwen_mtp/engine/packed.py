"""A packed prefill step (mixed steps, `cache.mixed_steps`): several requests' prompt chunks laid end to end in
one [1, N] forward. `PackedChunks` holds the step's tensors and its layout (host ints), `PackedStepCache` is the
`ForwardCache` the model sees.

Exactness: a request's numbers must not depend on what it is packed with. The linears, norms and the MLP run
once over all N tokens, batch-invariant (`batch_invariant`: each row computed as it is alone, whatever N; on CUDA
with the prefill plans, `ops.linear.prefill_rows`); the
ops with a sequence axis run on each chunk's own state and pages: the prefill attention per chunk (`attend` loops
here) with the kernel an unpacked chunk runs; the GDN's conv, gates and delta rule as one varlen call each over
all chunks (`cu_seqlens`), whose kernels compute each sequence as alone. So a chunk
computes the same whether 0 or 31 other chunks share its forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.paged_cache import PagedStepCache, StepBatch, StepKind


@dataclass
class PackedChunks:
    """S chunks, chunk i feeding `lengths[i]` tokens of its request at its next positions."""

    token_ids: torch.Tensor  # [1, N] the chunks end to end
    positions: torch.Tensor  # [1, N]
    state_rows: torch.Tensor  # [S] each chunk's state pool row
    block_tables: torch.Tensor  # [S, max pages] int32
    context_lens: torch.Tensor  # [S] int32: positions cached after the chunk
    cu_seqlens: torch.Tensor  # [S + 1] int32: where each chunk starts in the token dim, then N
    lengths: tuple[int, ...]  # host: tokens of each chunk (N = their sum)
    fresh: tuple[bool, ...]  # host: the chunk starts its sequence (no conv window or SSM state to read)

    def slices(self) -> list[slice]:
        """Each chunk's slice of the token dim."""
        ends = itertools.accumulate(self.lengths)
        return [slice(end - length, end) for end, length in zip(ends, self.lengths, strict=True)]

    def chunk(self, i: int, part: slice) -> StepBatch:
        """Chunk i as the one-request prefill batch it would be unpacked."""
        rows = slice(i, i + 1)
        return StepBatch(
            StepKind.PREFILL, self.token_ids[:, part], self.positions[:, part], self.state_rows[rows],
            self.block_tables[rows], self.context_lens[rows], self.fresh[i],
        )  # fmt: skip


class PackedStepCache:
    """The `ForwardCache` of a packed prefill step over the shared pools. The GDN layers read each chunk's state
    through `sequences()` (`cache_api.packed_gdn_states`: a fresh chunk has none) and write all chunks' states at
    once (`set_gdn_state`)."""

    batch_invariant = True  # the linears see N rows of several requests: each row must be computed on its own
    prefill_plans = True  # with the prefill plans (`ops.linear.prefill_rows`)

    def __init__(self, batch: PackedChunks, pages: PagePool, states: StatePool):
        self.batch, self.states = batch, states
        self.parts = batch.slices()
        self.chunks = [
            PagedStepCache(batch.chunk(i, part), pages, states) for i, part in enumerate(self.parts)
        ]  # each chunk's own cache, exactly the one its unpacked prefill step would use

    def positions(self, num_tokens: int) -> torch.Tensor:
        return self.batch.positions

    def sequences(self) -> list[tuple[slice, PagedStepCache]]:
        return list(zip(self.parts, self.chunks, strict=True))

    def cu_seqlens(self) -> torch.Tensor:
        return self.batch.cu_seqlens

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """Every chunk's state after the step (window [S, C, kernel-1], ssm [S, Hv, dk, dv], in `sequences()`
        order) into its row: one write for all S, as each chunk's own cache would write its row."""
        self.states.write(layer, self.batch.state_rows, window, ssm)

    def gdn_recurrent(self, num_tokens: int) -> bool:
        return False  # prompt chunks: the chunked delta rule over the packed chunks

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, N, D], k, v [1, KV, N, D]: each chunk over its own pages (the unpacked chunk's op call)."""
        return torch.cat(
            [chunk.attend(layer, q[:, :, s], k[:, :, s], v[:, :, s], scale) for s, chunk in self.sequences()], dim=2
        )
