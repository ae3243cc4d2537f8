"""How big the KV page pool, the state pool and the prefix cache's snapshot slots are: explicit counts from
`cache.*`, or (GPU) a share of the free memory after the model is loaded, or (CPU) enough for `max_batch`
sequences of up to 4096 tokens. With prefix caching the snapshot slots come out of the same budget as the pages:
on the GPU `PREFIX_SNAPSHOT_SHARE` of it unless `cache.prefix_snapshots` says how many."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen_mtp.cache.kv import pages_for
from qwen_mtp.config import ModelConfig
from qwen_mtp.dtypes import torch_dtype
from qwen_mtp.errors import RecipeError
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.recipe import CacheSection

CPU_DEFAULT_TOKENS = 4096
KERNEL_INDEX_LIMIT = 2**31  # the CUDA kernels address an activation with 32-bit element offsets
# Share of the GPU cache budget (after state rows) given to GDN state snapshots when prefix caching sizes them:
# at 27B a snapshot (~147 MiB fp32) is ~4x a 512-token chunk's KV, so pages still get most of the memory.
PREFIX_SNAPSHOT_SHARE = 0.2
MiB = 1 << 20


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    page_size: int
    num_state_rows: int
    spec_tokens: int
    state_dtype: str
    num_snapshots: int = 0  # prefix cache GDN state snapshot slots (0: prefix caching off)

    def describe(self, kv_bytes: int, state_bytes: int, snapshot_bytes: int = 0) -> str:
        snapshots = (
            f"; prefix cache: {self.num_snapshots} state snapshots ({snapshot_bytes / MiB:.1f} MiB)"
            if self.num_snapshots
            else ""
        )
        return (
            f"KV cache: {self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} "
            f"positions ({kv_bytes / MiB:.1f} MiB); state pool: {self.num_state_rows} rows x "
            f"{1 + self.spec_tokens} SSM slots, {self.state_dtype} ({state_bytes / MiB:.1f} MiB){snapshots}"
        )


def _element_size(dtype: str | torch.dtype) -> int:
    return torch_dtype(dtype).itemsize


def page_bytes(shapes: RankShapes, num_attention_layers: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page on this rank: keys and values of every attention layer."""
    return num_attention_layers * 2 * page_size * shapes.kv_heads * shapes.head_dim * _element_size(dtype)


def state_row_bytes(shapes: RankShapes, gdn_layers: int, spec_tokens: int, dtype: torch.dtype, state_dtype: str) -> int:
    """Bytes of one state-pool row on this rank: every GDN layer's conv window and 1 + K SSM slots."""
    conv = shapes.gdn_conv_dim * (shapes.conv_kernel - 1 + spec_tokens) * _element_size(dtype)
    ssm_slot = shapes.gdn_value_heads * shapes.gdn_key_head_dim * shapes.gdn_value_head_dim
    return gdn_layers * (conv + (1 + spec_tokens) * ssm_slot * _element_size(state_dtype))


def size_pools(
    config: ModelConfig,
    shapes: RankShapes,
    cache: CacheSection,
    dtype: torch.dtype,
    state_dtype: str,
    device: torch.device,
    spec_tokens: int,
) -> PoolSizes:
    """Pool sizes for a model of `config` (`shapes` on this rank) in `dtype` (KV and conv windows) with SSM states
    in `state_dtype`."""
    rows = cache.num_state_rows or cache.max_batch
    attention_layers = config.layer_types.count("attn") + config.mtp_num_hidden_layers
    gdn_layers = config.layer_types.count("gdn")
    snapshot = state_row_bytes(shapes, gdn_layers, 0, dtype, state_dtype)  # one row's committed state
    snapshots = (cache.prefix_snapshots or 0) if cache.prefix_caching else 0
    if cache.num_pages is not None:
        pages = cache.num_pages
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        row = state_row_bytes(shapes, gdn_layers, spec_tokens, dtype, state_dtype)
        budget = free * cache.memory_fraction - rows * row
        if cache.prefix_caching and cache.prefix_snapshots is None:
            snapshots = max(1, int(budget * PREFIX_SNAPSHOT_SHARE // snapshot))
        budget -= snapshots * snapshot
        pages = int(budget // page_bytes(shapes, attention_layers, cache.page_size, dtype))
        if pages < 1:
            raise RecipeError(
                f"cache.memory_fraction={cache.memory_fraction} leaves no GPU memory for KV pages after "
                f"{rows} state rows; lower cache.num_state_rows / cache.max_batch or raise the fraction"
            )
    else:
        pages = rows * pages_for(min(config.max_position_embeddings, CPU_DEFAULT_TOKENS), cache.page_size)
    if cache.prefix_caching and not snapshots:  # one snapshot per chunk the page pool can hold
        snapshots = max(1, pages * cache.page_size // cache.prefill_chunk)
    return PoolSizes(pages, cache.page_size, rows, spec_tokens, state_dtype, snapshots)


def check_forward_rows(tokens: int, widest: int, setting: str) -> None:
    """One prefill forward carries `tokens` tokens (`setting` names where that number comes from); its widest
    activation row has `widest` elements (the largest projection output: at 27B the MLP's gate_up, 34816). On CUDA
    the Triton kernels address activations with 32-bit element offsets, so tokens x widest must stay below 2^31:
    past it a kernel would read and write the wrong rows. A RecipeError says the most tokens that fit."""
    if tokens * widest >= KERNEL_INDEX_LIMIT:
        most = (KERNEL_INDEX_LIMIT - 1) // widest
        raise RecipeError(
            f"{setting} ({tokens}) tokens in one forward x its widest activation row ({widest} elements) is "
            f"{tokens * widest}, past the 2^31 elements the CUDA kernels index: use at most {most}"
        )
