"""Prefix cache: an index of full prefill chunks -> the KV pages holding them (target and MTP layers) and a
snapshot of the GDN state after them, so a request whose prompt starts with a cached prefix restores it instead
of computing it, with the numbers a cold run computes.

- **Keys.** A chunk is `cache.prefill_chunk` tokens starting at a multiple of it. The index is a tree: each
  node is one chunk, keyed under its parent by the chunk's whole token tuple, so a node stands for the exact
  token sequence from the prompt start to its end (different tokens never share, whatever their hash).
- **What a node holds.** The chunk's KV pages (shared by refcount: nobody writes a full chunk's pages again, so
  there is no copy-on-write), optionally a `StateSnapshots` slot with the GDN state after the chunk (a hit
  must end on one: a GDN state cannot be rebuilt from KV), and `mtp_next`: the MTP layer's KV entry for
  position p is computed from (token p+1, the target's hidden state at p), so the entry of a chunk's last
  position depends on the token *after* the chunk. A speculative request uses a node only when that token is
  its own next token; then every MTP KV entry it reads is the one a cold run writes, and so is its first draft.
- **Hits.** `lookup` finds the longest chain of usable nodes ending on a snapshot, leaving at least the
  prompt's last token to compute (its logits choose the first output token).
- **Who holds what.** A running request holds the nodes of its hit and of every full chunk it added
  (`hold` / `add`); held nodes are never evicted. Eviction is LRU over unheld leaves (leaves first: a node's
  children extend it), whenever admission needs pages or a new chunk needs a snapshot slot.
The scheduler drives it (admission, slots for chunks); it touches no tensors: restoring and saving snapshots
are the engine's device copies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StateSnapshots


@dataclass(eq=False)
class PrefixNode:
    parent: PrefixNode | None
    tokens: tuple[int, ...]  # the chunk's tokens
    end: int  # positions from the prompt start through this chunk
    pages: list[int]  # the chunk's KV pages
    snapshot: int | None  # slot of the GDN state after the chunk; None: pages only, not a hit's end
    mtp_next: int | None  # the token after the chunk that its MTP KV was computed with; None: no MTP KV
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)
    users: int = 0  # running requests holding the node (never evicted while > 0)
    last_used: int = 0


@dataclass(frozen=True)
class PrefixHit:
    nodes: tuple[PrefixNode, ...] = ()

    @property
    def length(self) -> int:
        """Prompt positions restored from the cache."""
        return self.nodes[-1].end if self.nodes else 0

    @property
    def pages(self) -> list[int]:
        return [page for node in self.nodes for page in node.pages]

    @property
    def snapshot(self) -> int | None:
        return self.nodes[-1].snapshot if self.nodes else None


@dataclass
class PrefixStats:
    lookups: int = 0  # requests admitted with prefix caching on
    hits: int = 0  # of them, those that restored a prefix
    tokens_saved: int = 0  # prompt positions restored instead of computed
    evictions: int = 0  # nodes evicted (LRU) or cleared


class PrefixCache:
    def __init__(self, pages: PagePool, snapshots: StateSnapshots, chunk: int):
        if chunk % pages.page_size:
            raise ValueError(f"prefill chunk {chunk} must be a multiple of the page size {pages.page_size}")
        self.pages, self.snapshots, self.chunk = pages, snapshots, chunk
        self.stats = PrefixStats()
        self._root: dict[tuple[int, ...], PrefixNode] = {}
        self._nodes: set[PrefixNode] = set()
        self._held: dict[int, list[PrefixNode]] = {}  # request -> its chain of nodes, from the prompt start
        self._clock = itertools.count(1)
        self._pages_per_chunk = chunk // pages.page_size
        # counts kept as nodes change, so `stats` never walks the tree (another thread may read them mid-step)
        self.cached_snapshots = 0
        self._unheld = 0  # nodes no running request holds

    # ---- lookup and holding ------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], speculative: bool) -> PrefixHit:
        """The longest cached prefix of `tokens` that ends on a snapshot and leaves at least one token to
        compute; a `speculative` request also needs each node's MTP KV computed with its own next token."""
        children, chain, usable = self._root, [], 0
        for start in range(0, len(tokens) - self.chunk, self.chunk):
            node = children.get(tuple(tokens[start : start + self.chunk]))
            if node is None or (speculative and node.mtp_next != tokens[node.end]):
                break
            chain.append(node)
            if node.snapshot is not None:
                usable = len(chain)
            children = node.children
        return PrefixHit(tuple(chain[:usable]))

    def hold(self, request: int, hit: PrefixHit) -> None:
        """`request` runs on `hit`'s nodes: none of them is evicted until `release`."""
        self._held[request] = list(hit.nodes)
        for node in hit.nodes:
            self._use(node)
        self._touch(hit.nodes)

    def release(self, request: int) -> None:
        for node in self._held.pop(request, []):
            node.users -= 1
            self._unheld += node.users == 0

    def _use(self, node: PrefixNode) -> None:
        self._unheld -= node.users == 0
        node.users += 1

    def record(self, hit: PrefixHit) -> None:
        """Count a user request's admission (internal cache fills are not counted)."""
        self.stats.lookups += 1
        if hit.nodes:
            self.stats.hits += 1
            self.stats.tokens_saved += hit.length

    def held_length(self, request: int) -> int:
        """Positions from the prompt start that `request`'s held chain covers."""
        chain = self._held.get(request)
        return chain[-1].end if chain else 0

    # ---- adding chunks -----------------------------------------------------------------------------------
    def wants_snapshot(self, request: int, tokens: tuple[int, ...]) -> bool:
        """Whether the request's next full chunk `tokens` lacks a cached snapshot (so one is worth taking)."""
        node = self._children(request).get(tokens)
        return node is None or node.snapshot is None

    def add(
        self, request: int, tokens: tuple[int, ...], pages: list[int], snapshot: int | None, mtp_next: int | None
    ) -> None:
        """`request` computed the full chunk `tokens` right after its held chain, into `pages`, with the GDN
        state after it in `snapshot` (or None) and its MTP KV computed with `mtp_next` (or None). The chunk
        becomes (or joins) the node after the chain, and the request holds it."""
        chain = self._held.setdefault(request, [])
        parent = chain[-1] if chain else None
        children = self._children(request)
        node = children.get(tokens)
        if node is None:
            end = (parent.end if parent else 0) + self.chunk
            node = PrefixNode(parent, tokens, end, list(pages), snapshot, mtp_next)
            self.pages.share(pages)
            children[tokens] = node
            self._nodes.add(node)
            self._unheld += 1
            self.cached_snapshots += snapshot is not None
        else:  # computed again (it was not a hit): keep what the node lacks
            if node.snapshot is None and snapshot is not None:
                node.snapshot, snapshot = snapshot, None
                self.cached_snapshots += 1
            if node.mtp_next is None and mtp_next is not None:  # these pages hold the MTP KV too
                self.pages.share(pages)
                self.pages.unshare(node.pages)
                node.pages, node.mtp_next = list(pages), mtp_next
            if snapshot is not None:
                self.snapshots.release(snapshot)
        self._use(node)
        chain.append(node)
        self._touch([node])

    def discard(self, snapshot: int | None) -> None:
        """A slot taken for a chunk that failed."""
        if snapshot is not None:
            self.snapshots.release(snapshot)

    def _children(self, request: int) -> dict[tuple[int, ...], PrefixNode]:
        chain = self._held.get(request)
        return chain[-1].children if chain else self._root

    # ---- memory --------------------------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        """Pages that evicting every unheld node would return to the pool (only the cache holds an unheld
        node's pages: a request that has a cached chunk's pages in its table holds the node)."""
        return self._unheld * self._pages_per_chunk

    def make_room(self, pages: int) -> bool:
        """Evict LRU unheld leaves until `pages` pages are available; False if that cannot be reached."""
        if self.pages.available_pages >= pages:
            return True
        if self.pages.available_pages + self.evictable_pages() < pages:
            return False
        while self.pages.available_pages < pages and self._evict_one():
            pass
        return self.pages.available_pages >= pages

    def snapshot_slot(self) -> int | None:
        """A free snapshot slot, evicting LRU unheld leaves for one if needed; None when all are held."""
        slot = self.snapshots.allocate()
        while slot is None and self._evict_one():
            slot = self.snapshots.allocate()
        return slot

    def clear(self) -> int:
        """Evict every node no running request holds; returns how many."""
        count = 0
        while self._evict_one():
            count += 1
        return count

    def _evict_one(self) -> bool:
        leaves = [node for node in self._nodes if node.users == 0 and not node.children]
        if not leaves:
            return False
        node = min(leaves, key=lambda n: n.last_used)
        siblings = node.parent.children if node.parent is not None else self._root
        del siblings[node.tokens]
        self._nodes.remove(node)
        self._unheld -= 1
        self.pages.unshare(node.pages)
        if node.snapshot is not None:
            self.snapshots.release(node.snapshot)
            self.cached_snapshots -= 1
        self.stats.evictions += 1
        return True

    def _touch(self, nodes) -> None:
        for node in nodes:
            node.last_used = next(self._clock)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def cached_pages(self) -> int:
        return len(self._nodes) * self._pages_per_chunk
