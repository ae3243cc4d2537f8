"""`QwenHybridForCausalLM`: embeddings -> decoder layers (GDN / attention per the plan) -> norm -> lm_head,
plus the MTP head. Parameter names equal the Hugging Face text checkpoint's, so `state_dict()` can be saved
back to HF format."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.attention import GatedAttention
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.decoder import DecoderLayer, run_layers
from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.layers import MLP, RMSNorm, RotaryEmbedding
from qwen_mtp.model.mtp import MTPHead
from qwen_mtp.model.plan import plan_model
from qwen_mtp.model.shapes import RankShapes


class QwenHybridModel(nn.Module):
    """The decoder stack; `forward` returns the hidden state after the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.plan = plan_model(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, f"layers.{spec.index}") for spec in self.plan.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: ForwardCache | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        return run_layers(self.layers, x, rope, cache, self.norm)


class QwenHybridForCausalLM(nn.Module):
    """A Qwen3.5 dense hybrid model with its MTP head.

    - `model(input_ids)` -> logits [B, T, V] for the whole sequence (training / evaluation).
    - `hidden_states(...)` + `logits(...)` let generation compute the lm_head only where it needs it.
    - `mtp_hidden_states(...)` / `mtp_logits(...)` run the MTP head.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.shapes = RankShapes.of(config)
        self.model = QwenHybridModel(config)
        self.tied = config.tie_word_embeddings
        # With tied embeddings there is no `lm_head.weight`: the embedding matrix serves both.
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTPHead(config, self.model.plan.mtp_layers) if config.mtp_num_hidden_layers else None

    @property
    def attention_cache_layers(self) -> list[str]:
        """Cache names of the attention layers, the target's then the MTP head's: the KV page pool's layers."""
        return [module.name for module in self.modules() if isinstance(module, GatedAttention)]

    @property
    def gdn_cache_layers(self) -> list[str]:
        """Cache names of the GDN layers: the state pool's layers."""
        return [module.name for module in self.modules() if isinstance(module, GatedDeltaNet)]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: ForwardCache | None = None
    ) -> torch.Tensor:
        """Post-final-norm hidden states [B, T, H]; with a cache, the tokens continue the cached sequences."""
        length = input_ids.shape[1]
        if positions is None:
            if cache is not None:
                positions = cache.positions(length)
            else:
                positions = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], length)
        hidden = self.model(input_ids, positions, cache)
        if cache is not None:
            cache.advance(length)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: ForwardCache | None = None
    ) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, cache))

    def mtp_hidden_states(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ForwardCache | None = None,
    ) -> torch.Tensor:
        """MTP head at positions i: `next_ids` [B, T] hold token i+1, `hidden` [B, T, H] the target's
        post-norm hidden state at i (or the previous draft step's output). Returns post-`mtp.norm` [B, T, H]."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP head (mtp_num_hidden_layers = 0)")
        embeds = self.model.embed_tokens(next_ids)
        rope = self.model.rotary_emb(positions, embeds.dtype)
        return self.mtp(embeds, hidden, rope, cache)

    def mtp_logits(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ForwardCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for token i+2 at each position i (see `mtp_hidden_states`)."""
        return self.logits(self.mtp_hidden_states(next_ids, hidden, positions, cache))

    def fuse_projections(self) -> None:
        """One GEMM where several projections read the same input: GDN in_proj qkv/z/b/a, attention q/k/v,
        MLP gate/up (inference on CUDA: fewer launches per step; see `layers.fuse_linears`)."""
        for module in self.modules():
            if isinstance(module, (MLP, GatedAttention, GatedDeltaNet)):
                module.fuse_projections()

    def init_non_persistent_buffers(self, device: torch.device | str) -> None:
        """Buffers that no checkpoint holds (rotary inverse frequencies): computed after a meta-device load."""
        rotary = self.model.rotary_emb
        rotary.inv_freq = rotary.compute_inv_freq(device)
