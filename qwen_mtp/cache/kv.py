"""Paged KV cache: every full-attention layer (and the MTP block's layer) stores keys/values in fixed-size
pages from one shared pool; each request owns a page table that grows as its sequence grows.

Admission *reserves* a request's worst-case page count up front and the scheduler takes pages from that
reservation before each step, for every position the step may write, so a running request never runs out of
pages (no preemption, no recomputation, which would break exactness). Finishing or cancelling returns both the
pages and the unused reservation at once. The pool is host bookkeeping plus one device tensor; page tables
reach the device through the runner's pinned staging.
"""

from __future__ import annotations

import torch

from qwen_mtp.ops.paged_attention import gather_kv


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagePool:
    def __init__(
        self,
        layers: list[str],
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layer_index = {name: i for i, name in enumerate(layers)}
        self.num_pages = num_pages
        self.page_size = page_size
        # [layers, 2 (k, v), pages, page_size, kv_heads, head_dim]: one allocation at a fixed address. One page
        # more than the budget: `scratch_page`, which no request owns, takes the writes of a CUDA graph's
        # padding rows.
        self.scratch_page = num_pages
        self.storage = torch.zeros(
            len(layers), 2, num_pages + 1, page_size, kv_heads, head_dim, dtype=dtype, device=device
        )
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out low page ids first
        self.tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # request -> pages it may still take

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available_pages(self) -> int:
        """Pages neither allocated nor promised to a running request."""
        return len(self._free) - sum(self._reserved.values())

    @property
    def bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def can_reserve(self, num_tokens: int) -> bool:
        return pages_for(num_tokens, self.page_size) <= self.available_pages

    def reserve(self, request: int, num_tokens: int) -> None:
        """Promise `request` enough pages for `num_tokens` positions; pages are taken later by `grow`."""
        need = pages_for(num_tokens, self.page_size)
        if need > self.available_pages:
            raise RuntimeError(f"cannot reserve {need} pages: only {self.available_pages} available")
        self.tables[request] = []
        self._reserved[request] = need

    def grow(self, request: int, num_tokens: int) -> None:
        """Make the request's page table cover positions [0, num_tokens)."""
        table = self.tables[request]
        while len(table) * self.page_size < num_tokens:
            if self._reserved[request] == 0:
                raise RuntimeError(f"request {request} grew past its reservation ({len(table)} pages)")
            self._reserved[request] -= 1
            table.append(self._free.pop())

    def release(self, request: int) -> None:
        """Return the request's pages and its unused reservation to the pool."""
        self._free.extend(reversed(self.tables.pop(request, [])))
        self._reserved.pop(request, None)

    def layer_kv(self, layer: str) -> torch.Tensor:
        """The layer's cache memory [2 (k, v), pages, page_size, KV, D] (a contiguous view)."""
        return self.storage[self.layer_index[layer]]

    def block_rows(self, requests: list[int]) -> list[list[int]]:
        """Page tables of `requests`, each padded to the longest with the scratch page (never read): the rows of
        a step's [B, max pages] table."""
        width = max(len(self.tables[r]) for r in requests)
        return [self.tables[r] + [self.scratch_page] * (width - len(self.tables[r])) for r in requests]

    def read(self, layer: str, request: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length): each [length, KV, D] (for tests and tools)."""
        table = torch.tensor(self.tables[request], dtype=torch.int32, device=self.storage.device)
        return gather_kv(self.layer_kv(layer), table, length)
