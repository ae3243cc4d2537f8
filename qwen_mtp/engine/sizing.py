"""How big the KV page pool and the state pool are: explicit counts from `cache.*`, or (GPU) a share of the
free memory after the model is loaded, or (CPU) enough for `max_batch` sequences of up to 4096 tokens."""

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
MiB = 1 << 20


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    page_size: int
    num_state_rows: int
    spec_tokens: int
    state_dtype: str

    def describe(self, kv_bytes: int, state_bytes: int) -> str:
        return (
            f"KV cache: {self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} "
            f"positions ({kv_bytes / MiB:.1f} MiB); state pool: {self.num_state_rows} rows x "
            f"{1 + self.spec_tokens} SSM slots, {self.state_dtype} ({state_bytes / MiB:.1f} MiB)"
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
    if cache.num_pages is not None:
        pages = cache.num_pages
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cache.memory_fraction - rows * state_row_bytes(
            shapes, config.layer_types.count("gdn"), spec_tokens, dtype, state_dtype
        )
        pages = int(budget // page_bytes(shapes, attention_layers, cache.page_size, dtype))
        if pages < 1:
            raise RecipeError(
                f"cache.memory_fraction={cache.memory_fraction} leaves no GPU memory for KV pages after "
                f"{rows} state rows; lower cache.num_state_rows / cache.max_batch or raise the fraction"
            )
    else:
        pages = rows * pages_for(min(config.max_position_embeddings, CPU_DEFAULT_TOKENS), cache.page_size)
    return PoolSizes(pages, cache.page_size, rows, spec_tokens, state_dtype)
