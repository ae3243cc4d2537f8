"""The MTP head computes what vLLM/SGLang's Qwen MTP computes, assembled here from Hugging Face's own modules
(HF has no MTP module): fc(cat[norm(embed(next)), norm(hidden)]) -> full-attention decoder layer -> norm."""

import torch
from safetensors.torch import load_file
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

from qwen_mtp import load_model
from qwen_mtp.cache import SequenceCache


def _hf_mtp_reference(path, tensors):
    config = Qwen3_5TextConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    attn_index = config.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(config, layer_idx=attn_index)
    layer.load_state_dict({k[len("mtp.layers.0.") :]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.load_state_dict({"weight": tensors["mtp.fc.weight"]})
    rotary = Qwen3_5TextRotaryEmbedding(config)
    embed = tensors["model.embed_tokens.weight"]

    def run(next_ids, hidden, positions):
        e = norms["pre_fc_norm_embedding"](torch.nn.functional.embedding(next_ids, embed))
        x = fc(torch.cat([e, norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        x = layer(x, position_embeddings=rotary(x, positions), attention_mask=None)
        return norms["norm"](x)

    return run


def test_mtp_head_matches_hf_modules(checkpoint):
    path = checkpoint("tiny")
    model = load_model(path, dtype=torch.float32)
    reference = _hf_mtp_reference(path, load_file(path / "model.safetensors"))
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(29).expand(2, 29)
    with torch.inference_mode():
        hidden = model.hidden_states(ids)  # target hidden after the final norm
        ours = model.mtp_hidden_states(ids[:, 1:], hidden[:, :-1], positions)
        ref = reference(ids[:, 1:], hidden[:, :-1], positions)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        logits = model.mtp_logits(ids[:, 1:], hidden[:, :-1], positions)
        torch.testing.assert_close(logits, ours @ model.lm_head_weight.T, rtol=1e-6, atol=1e-6)


def test_mtp_head_with_own_kv_cache_equals_full(checkpoint):
    model = load_model(checkpoint("tiny-tied"), dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 25), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(24)[None]
    with torch.inference_mode():
        hidden = model.hidden_states(ids)
        full = model.mtp_hidden_states(ids[:, 1:], hidden[:, :-1], positions)
        cache = SequenceCache(1)
        parts = [model.mtp_hidden_states(ids[:, 1:17], hidden[:, :16], positions[:, :16], cache)]
        for i in range(16, 24):
            parts.append(
                model.mtp_hidden_states(ids[:, i + 1 : i + 2], hidden[:, i : i + 1], positions[:, i : i + 1], cache)
            )
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
