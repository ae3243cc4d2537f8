"""`QwenHybridForCausalLM`: embeddings -> decoder layers (GDN / attention per the plan) -> norm -> lm_head,
plus the MTP head. `state_dict()` keys are the Hugging Face text checkpoint's names (merged projections split
back into their HF tensors: `model/weights.py`), so it saves back to HF format, and `load_state_dict` takes
HF-named tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.attention import GatedAttention
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.decoder import DecoderLayer, run_layers
from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.layers import RMSNorm, RotaryEmbedding
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.model.mtp import MTPHead
from qwen_mtp.model.next_layout import interleaved_gdn_slots
from qwen_mtp.model.plan import plan_model
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.model.weights import WeightSlot, checkpoint_aliases, weight_slots
from qwen_mtp.ops.linear import linear


class IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class QwenHybridModel(nn.Module):
    """The decoder stack; `forward` returns the hidden state after the final norm."""

    def __init__(self, config: ModelConfig, shapes: RankShapes):
        super().__init__()
        self.plan = plan_model(config)
        eps = config.rms_norm_eps
        self.embed_tokens = nn.Embedding(shapes.vocab_size, shapes.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(shapes, eps, spec, f"layers.{spec.index}") for spec in self.plan.layers
        )
        self.norm = RMSNorm(shapes.hidden_size, eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: ForwardCache | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        return run_layers(self.layers, x, rope, cache, self.norm)


class QwenHybridForCausalLM(nn.Module):
    """A Qwen3.5 (dense or MoE) or Qwen3-Next hybrid model with its MTP head.

    - `model(input_ids)` -> logits [B, T, V] for the whole sequence (training / evaluation).
    - `hidden_states(...)` + `logits(...)` let generation compute the lm_head only where it needs it.
    - `mtp_hidden_states(...)` / `mtp_logits(...)` run the MTP head.

    `tp` > 1 builds one tensor-parallel rank's shard (`RankShapes.of(config, tp)`); `qwen_mtp.parallel` loads
    its slices and applies the collectives. Its `logits` are then the rank's vocabulary shard [..., V/tp], and
    `vocab_shard` chooses greedy tokens across the ranks.
    """

    def __init__(self, config: ModelConfig, tp: int = 1):
        super().__init__()
        self.config = config
        self.shapes = RankShapes.of(config, tp)
        self.parallel = None  # the rank's TensorParallel, once `parallel.apply_tensor_parallel` ran
        self.vocab_shard = None  # the lm_head's part of the vocabulary under tensor parallelism (VocabShard)
        self.model = QwenHybridModel(config, self.shapes)
        self.tied = config.tie_word_embeddings
        # With tied embeddings there is no `lm_head.weight`: the embedding matrix serves both.
        self.lm_head = None if self.tied else Linear(self.shapes.hidden_size, self.shapes.vocab_size)
        mtp_layers = self.model.plan.mtp_layers
        self.mtp = MTPHead(self.shapes, config.rms_norm_eps, mtp_layers) if config.mtp_num_hidden_layers else None

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

    @property
    def vocab_rows(self) -> int:
        """The lm_head's rows over every rank: the ids a token can take (under tensor parallelism this rank holds
        `lm_head_weight`'s V / tp of them, from `vocab_shard.start`)."""
        return self.lm_head_weight.shape[0] * (1 if self.parallel is None else self.parallel.degree)

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
        return self.model(input_ids, positions, cache)

    def logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """lm_head: [..., H] -> [..., V]; `invariant` for the decode path's greedy tokens (see `ops/linear.py`)."""
        return linear(hidden, self.lm_head_weight, invariant)

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

    def use_one_gemm(self, enabled: bool | None = True) -> None:
        """Run every `MergedLinear` as one GEMM (True), as one product per projection (False), or by device
        (None, the default: one GEMM on CUDA). For tests of the CUDA layout on CPU."""
        for module in self.modules():
            if isinstance(module, MergedLinear):
                module.one_gemm = enabled

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """Hugging Face tensor name -> where this model keeps it (the table the loader writes through)."""
        slots = weight_slots(self)
        if self.config.interleaved_gdn_projections:  # Qwen3-Next: in_proj_qkvz / in_proj_ba
            slots = interleaved_gdn_slots(self, slots)
        return slots

    def checkpoint_aliases(self) -> dict[str, tuple[str, WeightSlot]]:
        """Tensors a checkpoint may store in another layout (per-expert MoE weights): alias name -> (the
        `checkpoint_slots` name it is part of, its slot)."""
        return checkpoint_aliases(self)

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """The checkpoint's tensors under their Hugging Face names; merged projections give views of their rows."""
        destination = {} if destination is None else destination
        for name, slot in self.checkpoint_slots().items():
            tensor = slot.tensor()
            destination[prefix + name] = tensor if keep_vars else tensor.detach()
        return destination

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Copy Hugging Face-named tensors into the model (each cast to the parameter's dtype and device). With
        tied embeddings an `lm_head.weight` entry (HF's state_dict lists the tie under both names) is skipped.
        Missing or unexpected names are an error when `strict`, as in `nn.Module.load_state_dict`."""
        if assign:
            raise ValueError("assign=True cannot assign into merged projections: load into an allocated model")
        slots = self.checkpoint_slots()
        names = [name for name in state_dict if not (self.tied and name == "lm_head.weight")]
        keys = IncompatibleKeys(sorted(set(slots) - set(names)), sorted(set(names) - set(slots)))
        mismatched = [
            f"{name}: checkpoint {list(state_dict[name].shape)}, model {list(slots[name].shape)}"
            for name in names
            if name in slots and tuple(state_dict[name].shape) != slots[name].shape
        ]
        problems = [f"size mismatch for {m}" for m in mismatched]
        if strict and (keys.missing_keys or keys.unexpected_keys):
            problems += [f"missing keys: {keys.missing_keys}", f"unexpected keys: {keys.unexpected_keys}"]
        if problems:
            raise RuntimeError("error loading state_dict into QwenHybridForCausalLM: " + "; ".join(problems))
        for name in names:
            if name in slots:
                slots[name].load(state_dict[name])
        return keys

    def init_non_persistent_buffers(self, device: torch.device | str) -> None:
        """Buffers that no checkpoint holds (rotary inverse frequencies): computed after a meta-device load."""
        rotary = self.model.rotary_emb
        rotary.inv_freq = rotary.compute_inv_freq(device)
