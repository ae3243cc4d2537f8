"""Per-rank shapes: what one tensor-parallel rank of a model holds, derived once from the config and the TP
degree. Layers and cache pools size themselves from here, so sharding changes one place (which rows and columns
of each checkpoint tensor a rank holds is `qwen_mtp/parallel/plan.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from qwen_mtp.config import ModelConfig
from qwen_mtp.errors import ConfigError


@dataclass(frozen=True)
class RankShapes:
    tp: int  # tensor-parallel degree
    hidden_size: int  # replicated on every rank
    vocab_size: int  # vocabulary rows on this rank (embedding and lm_head are vocab-parallel)
    heads: int  # attention query heads on this rank
    kv_heads: int  # attention KV heads on this rank (1, replicated, when there are fewer KV heads than ranks)
    head_dim: int
    gdn_key_heads: int  # GDN key heads on this rank
    gdn_value_heads: int  # GDN value heads on this rank (those of its key heads)
    gdn_key_head_dim: int
    gdn_value_head_dim: int
    conv_kernel: int
    intermediate_size: int  # MLP columns on this rank
    expert_intermediate_size: int = 0  # MoE: each routed expert's columns on this rank (0: no MoE)
    shared_expert_intermediate_size: int = 0  # MoE: the shared expert's columns on this rank

    @classmethod
    def of(cls, config: ModelConfig, tp: int = 1) -> RankShapes:
        """The shapes of one of `tp` ranks; a ConfigError names what `tp` does not divide."""
        if tp < 1:
            raise ConfigError(f"tensor parallel degree must be >= 1, got {tp}")
        moe = config.moe
        counts = {
            "vocab_size": config.vocab_size,
            "num_attention_heads": config.num_attention_heads,
            "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "intermediate_size": config.intermediate_size,
        }
        if moe is not None:  # each expert split like a dense MLP (every rank holds a slice of every expert)
            counts["moe_intermediate_size"] = moe.intermediate_size
            counts["shared_expert_intermediate_size"] = moe.shared_intermediate_size
        kv_heads = config.num_key_value_heads
        if kv_heads >= tp:
            counts["num_key_value_heads"] = kv_heads
        for name, count in counts.items():
            if count % tp:
                raise ConfigError(
                    f"tensor parallel degree {tp} does not divide {name}={count}: use a parallel.tp that divides it"
                )
        if kv_heads < tp and tp % kv_heads:  # replicated KV heads: each rank's query heads must share one KV head
            raise ConfigError(
                f"tensor parallel degree {tp} is above num_key_value_heads={kv_heads} and not a multiple of it: "
                "KV heads cannot be replicated evenly; use a degree that divides or is a multiple of the KV heads"
            )
        return cls(
            tp=tp,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size // tp,
            heads=config.num_attention_heads // tp,
            kv_heads=max(kv_heads // tp, 1),
            head_dim=config.head_dim,
            gdn_key_heads=config.linear_num_key_heads // tp,
            gdn_value_heads=config.linear_num_value_heads // tp,
            gdn_key_head_dim=config.linear_key_head_dim,
            gdn_value_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            intermediate_size=config.intermediate_size // tp,
            expert_intermediate_size=0 if moe is None else moe.intermediate_size // tp,
            shared_expert_intermediate_size=0 if moe is None else moe.shared_intermediate_size // tp,
        )

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_key_heads * self.gdn_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_value_heads * self.gdn_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv on this rank: `[q | k | v]` before the split."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim
