"""Random-weight models at the real Qwen3.5 / Qwen3-Next shapes, created directly on the target device (no checkpoint):
decode speed does not depend on weight values, so benchmarks use these."""

from __future__ import annotations

import math

import torch

from qwen_mtp.config import ModelConfig

_COMMON = {
    "model_type": "qwen3_5_text",
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 248044,
}

# Dimensions from the published configs (shared/reference/qwen-arch.md, section 1.3).
SYNTHETIC: dict[str, dict] = {
    "qwen3.5-27b": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "intermediate_size": 17408,
                    "tie_word_embeddings": False},
    "qwen3.5-9b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "intermediate_size": 12288,
                   "tie_word_embeddings": False},
    "qwen3.5-0.8b": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 16, "intermediate_size": 3584,
                     "tie_word_embeddings": True},
}  # fmt: skip
# FP8 variants (`<name>-fp8`): the config of a Qwen FP8 release; the projections it quantizes are FP8 128x128
# blocks (`quant.fp8.quantize_` of the random bf16 weights, on the device).
FP8_RELEASE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SYNTHETIC.update(
    {f"{name}-fp8": {**dims, "quantization_config": FP8_RELEASE} for name, dims in list(SYNTHETIC.items())}
)

# The MoE families (same section of the note): Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B. In bf16 the 35B takes
# ~70 GB, the 80B ~160 GB (one H200 needs its FP8 form). The "-8l" variants keep every per-layer shape with 8
# layers (6 GDN + 2 attention), for GPU exactness tests and kernel timing at the real expert shapes.
_MOE = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False}  # fmt: skip
SYNTHETIC.update({
    "qwen3.5-35b-a3b": {**_MOE, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "num_experts": 256,
                        "num_experts_per_tok": 8},
    "qwen3-next-80b-a3b": {**_MOE, "model_type": "qwen3_next", "num_hidden_layers": 48, "num_experts": 512,
                           "num_experts_per_tok": 10, "norm_topk_prob": True, "intermediate_size": 5120,
                           "vocab_size": 151936, "eos_token_id": 151645},
})  # fmt: skip
for _name in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):
    SYNTHETIC[f"{_name}-8l"] = {**SYNTHETIC[_name], "num_hidden_layers": 8}


def synthetic_config(name: str) -> ModelConfig:
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic model {name!r}; choose from {sorted(SYNTHETIC)}")
    return ModelConfig.from_dict({**_COMMON, **SYNTHETIC[name]})


@torch.no_grad()
def synthetic_model(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0, parallel=None):
    """A `QwenHybridForCausalLM` with random weights of the right scale, allocated on `device` directly; with
    `parallel` (a `TensorParallel` rank) that rank's shard, its collectives applied. Every rank draws the same
    values for the same shapes, so the replicated weights agree across ranks."""
    from qwen_mtp.model import QwenHybridForCausalLM

    config = synthetic_config(name)
    with torch.device("meta"):
        model = QwenHybridForCausalLM(config, 1 if parallel is None else parallel.degree)
    model = model.to(dtype).to_empty(device=device)  # never materialize an fp32 copy (27B: 108 GB)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, param in model.named_parameters():
        if pname.endswith("A_log"):
            param.uniform_(0.0, math.log(16.0), generator=gen)
        elif pname.endswith("dt_bias") or pname.endswith("linear_attn.norm.weight"):
            param.fill_(1.0)
        elif pname.endswith("norm.weight") or "norm_" in pname:
            param.zero_()
        elif pname.endswith("embed_tokens.weight"):
            param.normal_(0.0, 0.5, generator=gen)
        else:
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=gen)
    model.init_non_persistent_buffers(device)
    if config.weight_block_size is not None:
        from qwen_mtp.quant.fp8 import quantize_

        quantize_(model)
    if parallel is not None and parallel.degree > 1:
        from qwen_mtp.parallel.apply import apply_tensor_parallel

        apply_tensor_parallel(model, parallel)
    return model.eval()
