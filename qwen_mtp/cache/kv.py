"""Paged KV cache: every full-attention layer (and the MTP block's layer) stores keys/values in fixed-size
pages from one shared pool; each request owns a page table that grows as its sequence grows.

Admission *reserves* a request's worst-case page count up front and the scheduler takes pages from that
reservation before each step, for every position the step may write, so a running request never runs out of
pages (no preemption, no recomputation, which would break exactness). Finishing or cancelling returns both the
pages and the unused reservation at once. The pool is host bookkeeping plus one device tensor; page tables
reach the device through the runner's pinned staging.

Pages are refcounted: with prefix caching a page table may start with full pages that the prefix cache holds
(`share`) and other requests read too. Nobody writes into a shared page again (a request writes only positions
past its restored prefix), so copy-on-write is never needed. A reservation counts only the pages the request
will own; a page returns to the free list when its last holder lets it go.
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
        self._holders = [0] * num_pages  # per page: page tables + prefix-cache entries holding it
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

    def pages_to_reserve(self, num_tokens: int, shared: int = 0) -> int:
        """Pages a request of `num_tokens` positions must own when its first `shared` pages are shared."""
        return max(pages_for(num_tokens, self.page_size) - shared, 0)

    def can_reserve(self, num_tokens: int, shared: int = 0) -> bool:
        return self.pages_to_reserve(num_tokens, shared) <= self.available_pages

    def reserve(self, request: int, num_tokens: int, shared: list[int] | tuple[int, ...] = ()) -> None:
        """Promise `request` enough pages for `num_tokens` positions; its table starts with the `shared` pages
        (a cached prefix, held for it) and the rest are taken later by `grow`."""
        need = self.pages_to_reserve(num_tokens, len(shared))
        if need > self.available_pages:
            raise RuntimeError(f"cannot reserve {need} pages: only {self.available_pages} available")
        self.share(shared)
        self.tables[request] = list(shared)
        self._reserved[request] = need

    def grow(self, request: int, num_tokens: int) -> None:
        """Make the request's page table cover positions [0, num_tokens)."""
        table = self.tables[request]
        while len(table) * self.page_size < num_tokens:
            if self._reserved[request] == 0:
                raise RuntimeError(f"request {request} grew past its reservation ({len(table)} pages)")
            self._reserved[request] -= 1
            page = self._free.pop()
            self._holders[page] = 1
            table.append(page)

    def release(self, request: int) -> None:
        """Let go of the request's pages (those nobody else holds return to the pool) and its unused reservation."""
        self.unshare(reversed(self.tables.pop(request, [])))
        self._reserved.pop(request, None)

    def share(self, pages) -> None:
        """One more holder (a page table or a prefix-cache entry) for each of `pages`, all allocated."""
        for page in pages:
            if self._holders[page] == 0:
                raise RuntimeError(f"page {page} is free: only allocated pages can be shared")
            self._holders[page] += 1

    def unshare(self, pages) -> None:
        """One holder fewer for each of `pages`; a page nobody holds any more returns to the free list."""
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)

    def holders(self, page: int) -> int:
        return self._holders[page]

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
