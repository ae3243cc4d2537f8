"""A fresh model for training: the Hugging Face `config.json` of a `train:` shape and the initial weights."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.recipe import TrainSection

INIT_STD = 0.02
RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj")  # write into the residual stream: scaled down by depth


def model_config(train: TrainSection, eos_id: int) -> dict[str, Any]:
    """The checkpoint's `config.json` (text layout, `qwen3_5_text`, tied embeddings, one MTP layer)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": train.vocab_size,
        "hidden_size": train.hidden_size,
        "intermediate_size": train.intermediate_size,
        "num_hidden_layers": train.num_layers,
        "full_attention_interval": train.full_attention_interval,
        "num_attention_heads": train.attention_heads,
        "num_key_value_heads": train.kv_heads,
        "head_dim": train.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": train.gdn_head_dim,
        "linear_value_head_dim": train.gdn_head_dim,
        "linear_num_key_heads": train.gdn_key_heads,
        "linear_num_value_heads": train.gdn_value_heads,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos_id,
    }


@torch.no_grad()
def init_weights(model: QwenHybridForCausalLM, seed: int) -> None:
    """GPT-style initialisation: projections and embeddings N(0, 0.02), projections into the residual stream
    scaled by 1/sqrt(2 * layers); zero-centred norms at 0 (a scale of 1); GDN decays as Hugging Face initialises
    them (A in [1, 16], dt log-uniform in [1e-3, 1e-1] through softplus). Every tensor is drawn from `seed`'s
    generator, so a run's initial weights depend on the seed alone."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    depth = model.config.num_hidden_layers + model.config.mtp_num_hidden_layers

    def normal_(tensor: torch.Tensor, std: float) -> None:
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)

    for name, module in model.named_modules():
        if isinstance(module, Linear | MergedLinear):
            residual = name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS
            normal_(module.weight, INIT_STD / math.sqrt(2 * depth) if residual else INIT_STD)
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, INIT_STD)
        elif isinstance(module, nn.Conv1d):  # depthwise: nn.Conv1d's own default, U(-1/sqrt(k), 1/sqrt(k))
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            module.weight.copy_(torch.empty(module.weight.shape).uniform_(-bound, bound, generator=generator))
        elif isinstance(module, GatedDeltaNet):
            heads = module.A_log.shape[0]
            module.A_log.copy_(torch.empty(heads).uniform_(1.0, 16.0, generator=generator).log())
            dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def fresh_model(config: dict[str, Any], seed: int, device: torch.device, dtype: torch.dtype) -> QwenHybridForCausalLM:
    """A model of `config` with `init_weights`, in `dtype` on `device` (the rotary frequencies stay fp32)."""
    model = QwenHybridForCausalLM(ModelConfig.from_dict(config))
    init_weights(model, seed)
    model = model.to(device=device, dtype=dtype)
    model.init_non_persistent_buffers(device)
    return model
