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

# FP8 variants of every preset (`<name>-fp8`, e.g. `qwen3.5-35b-a3b-fp8`, `qwen3-next-80b-a3b-8l-fp8`): the
# config of a Qwen FP8 release; the projections and experts it quantizes are FP8 128x128 blocks, created in FP8
# on the device (the 80B-A3B fits one H200 only so: its bf16 form would take ~160 GB).
FP8_RELEASE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SYNTHETIC.update(
    {f"{name}-fp8": {**dims, "quantization_config": FP8_RELEASE} for name, dims in list(SYNTHETIC.items())}
)


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
        model = QwenHybridForCausalLM(config, 1 if parallel is None else parallel.degree).to(dtype)
    if config.weight_block_size is not None:
        from qwen_mtp.quant.fp8 import quantize_

        quantize_(model)  # on the meta device: only the storage becomes e4m3 + block scales
    model = model.to_empty(device=device)  # never materialize an fp32 copy (27B: 108 GB), nor a bf16 one of FP8
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    for pname, param in params.items():
        if param.dtype == torch.float8_e4m3fn:  # W = e4m3(N(0, 1)) * scale, scale 1/sqrt(K) (its `_scale_inv`)
            for rows in param.view(-1, param.shape[-1]).split(1 << 14):
                rows.copy_(torch.randn(rows.shape, generator=gen, device=device, dtype=dtype))
        elif pname.endswith("_scale_inv"):
            param.fill_(params[pname.removesuffix("_scale_inv")].shape[-1] ** -0.5)
        elif pname.endswith("A_log"):
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
    if parallel is not None and parallel.degree > 1:
        from qwen_mtp.parallel.apply import apply_tensor_parallel

        apply_tensor_parallel(model, parallel)
    return model.eval()
