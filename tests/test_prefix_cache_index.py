"""The prefix cache's bookkeeping on its own: refcounted pages, hits that end on a snapshot, exact token keys,
LRU eviction of unheld leaves first, and nothing held after clearing."""

import torch

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.prefix import PrefixCache
from qwen_mtp.cache.state import StatePool, StateSnapshots

CHUNK = 4


def make_cache(num_pages=16, slots=4):
    pages = PagePool(["attn"], num_pages, CHUNK, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    states = StatePool(["gdn"], 2, 3, 4, 1, 2, 2, 0, torch.float32, torch.float32, "cpu")
    return PrefixCache(pages, StateSnapshots(states, slots), CHUNK), pages


def compute(cache, pages, request, tokens, chunks, snapshots=None):
    """`request` computes `chunks` full chunks of `tokens` from the start (no hit) and adds them, the first
    `snapshots` (default: all) with a state snapshot."""
    pages.reserve(request, chunks * CHUNK)
    pages.grow(request, chunks * CHUNK)
    cache.hold(request, cache.lookup([], False))
    for c in range(chunks):
        slot = cache.snapshot_slot() if snapshots is None or c < snapshots else None
        cache.add(request, tuple(tokens[c * CHUNK : (c + 1) * CHUNK]), pages.tables[request][c : c + 1], slot, None)


def finish(cache, pages, request):
    pages.release(request)
    cache.release(request)


def test_pages_return_when_the_last_holder_lets_go():
    cache, pages = make_cache()
    tokens = list(range(10, 30))
    compute(cache, pages, 1, tokens, 2)
    finish(cache, pages, 1)
    assert pages.free_pages == 14 and cache.cached_pages == 2  # the cache still holds the two chunks
    hit = cache.lookup(tokens[:9], False)
    assert hit.length == 2 * CHUNK
    cache.hold(2, hit)
    pages.reserve(2, 12, hit.pages)
    assert pages.available_pages == 14 - 1  # the reservation counts only the page request 2 will own
    assert cache.clear() == 0  # both chunks are held by request 2
    finish(cache, pages, 2)
    assert cache.clear() == 2 and pages.free_pages == pages.available_pages == 16
    assert cache.snapshots.free_slots == 4 and cache.num_nodes == 0


def test_a_hit_ends_on_a_snapshot_and_leaves_a_token_to_compute():
    cache, pages = make_cache()
    tokens = list(range(10, 30))
    compute(cache, pages, 1, tokens, 3, snapshots=2)  # the third chunk's pages are cached, its state is not
    assert cache.lookup(tokens, False).length == 2 * CHUNK
    assert cache.lookup(tokens[: 2 * CHUNK], False).length == CHUNK  # the last prompt token is always computed
    assert cache.lookup(tokens[: 2 * CHUNK + 1], False).length == 2 * CHUNK


def test_same_length_different_tokens_never_share():
    cache, pages = make_cache()
    tokens = list(range(10, 30))
    compute(cache, pages, 1, tokens, 3)
    for position in range(3 * CHUNK):
        other = list(tokens)
        other[position] += 100
        assert cache.lookup(other, False).length == position // CHUNK * CHUNK


def test_speculative_hits_need_the_token_after_each_chunk():
    cache, pages = make_cache()
    tokens = list(range(10, 30))
    pages.reserve(1, 8)
    pages.grow(1, 8)
    cache.hold(1, cache.lookup([], True))
    for c in range(2):
        chunk = tuple(tokens[c * CHUNK : (c + 1) * CHUNK])
        cache.add(1, chunk, pages.tables[1][c : c + 1], cache.snapshot_slot(), tokens[(c + 1) * CHUNK])
    assert cache.lookup(tokens, True).length == 2 * CHUNK
    other = tokens[: 2 * CHUNK] + [99] + tokens[2 * CHUNK + 1 :]
    assert cache.lookup(other, True).length == CHUNK and cache.lookup(other, False).length == 2 * CHUNK


def test_lru_evicts_unheld_leaves_first():
    cache, pages = make_cache(slots=3)
    a, c = list(range(10, 30)), list(range(50, 70))
    compute(cache, pages, 1, a, 2)  # chunks a0 -> a1
    compute(cache, pages, 2, c, 1)  # chunk c0, used after a0 and a1
    finish(cache, pages, 1)
    finish(cache, pages, 2)
    assert cache.snapshots.free_slots == 0
    compute(cache, pages, 3, list(range(80, 90)), 1)  # needs a slot: a1 (the LRU leaf) goes, a0 stays
    assert cache.lookup(a, False).length == CHUNK and cache.lookup(c, False).length == CHUNK
    cache.hold(4, cache.lookup(c, False))  # c0 held: not evictable
    finish(cache, pages, 3)
    assert cache.clear() == 2 and cache.num_nodes == 1 and cache.lookup(c, False).length == CHUNK
    assert cache.stats.evictions == 3
    cache.release(4)
    assert cache.clear() == 1 and pages.free_pages == 16
