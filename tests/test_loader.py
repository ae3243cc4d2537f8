"""The loader keeps the MTP head, uses HF names, dequantizes FP8 blocks, and names the problem when a
checkpoint is bad."""

import json
import shutil

import pytest
import torch
from helpers import load_hf
from safetensors.torch import load_file, save_file

from qwen_mtp import CheckpointError, ConfigError, ModelConfig, load_model
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.quant.fp8 import dequantize_fp8_block

MTP_NAMES = {
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
    "mtp.layers.0.mlp.gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight",
    "mtp.layers.0.mlp.down_proj.weight",
}


def _edited_copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("layout", ["text", "vlm"])
def test_mtp_weights_are_the_checkpoints(checkpoint, layout):
    path = checkpoint("tiny", layout)
    on_disk = load_file(path / "model.safetensors")
    assert MTP_NAMES <= set(on_disk)  # the real names, no language_model infix
    state = load_model(path, dtype=torch.float32).state_dict()
    for name in MTP_NAMES:
        assert torch.equal(state[name], on_disk[name]), name


def test_state_dict_keys_are_hf_text_names(checkpoint):
    path = checkpoint("tiny")
    assert set(load_model(path).state_dict()) == set(load_file(path / "model.safetensors"))
    vlm = load_file(checkpoint("tiny", "vlm") / "model.safetensors")
    text_names = {n.replace("model.language_model.", "model.") for n in vlm if not n.startswith("model.visual.")}
    assert set(load_model(checkpoint("tiny", "vlm")).state_dict()) == text_names


def test_state_dict_saves_back_to_a_checkpoint_hf_loads(checkpoint, tmp_path):
    src = checkpoint("tiny-tied", "vlm")
    model = load_model(src, dtype=torch.float32)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(load_hf(tmp_path, torch.float32)(ids).logits, model(ids))
        assert torch.equal(load_model(tmp_path, dtype=torch.float32)(ids), model(ids))


def test_missing_mtp_tensor_is_named(checkpoint, tmp_path):
    bad = _edited_copy(checkpoint("tiny"), tmp_path / "bad", edit_tensors=lambda t: t.pop("mtp.fc.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*mtp\.fc\.weight"):
        load_model(bad)


def test_checkpoint_without_any_mtp_loads_without_head(checkpoint, tmp_path):
    def drop_mtp(tensors):
        for name in [n for n in tensors if n.startswith("mtp.")]:
            del tensors[name]

    plain = _edited_copy(checkpoint("tiny"), tmp_path / "plain", edit_tensors=drop_mtp)
    model = load_model(plain, dtype=torch.float32)
    assert model.mtp is None
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids), load_model(checkpoint("tiny"), dtype=torch.float32)(ids))


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].contiguous()

    bad = _edited_copy(checkpoint("tiny"), tmp_path / "bad", edit_tensors=shrink)
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[127, 64\].*\[128, 64\]"):
        load_model(bad)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)

    bad = _edited_copy(checkpoint("tiny"), tmp_path / "bad", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(bad)


def test_integer_tensor_is_refused(checkpoint, tmp_path):
    name = "model.norm.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].to(torch.int32)

    bad = _edited_copy(checkpoint("tiny"), tmp_path / "bad", edit_tensors=to_int)
    with pytest.raises(CheckpointError, match=rf"{name} has dtype torch.int32"):
        load_model(bad)


@pytest.mark.parametrize(
    "model_type,message",
    [
        ("llama", "unsupported model_type 'llama'"),
        ("qwen3_next", "missing required key 'num_experts'"),
        ("qwen3_5_moe", "missing required key 'num_experts'"),
    ],
)
def test_unsupported_model_type_is_named(checkpoint, tmp_path, model_type, message):
    bad = _edited_copy(checkpoint("tiny"), tmp_path / "bad", edit_config=lambda c: c.update(model_type=model_type))
    with pytest.raises(ConfigError, match=message):
        load_model(bad)


def test_unreadable_file_is_named(checkpoint, tmp_path):
    bad = shutil.copytree(checkpoint("tiny"), tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_model(bad)


def test_missing_directory_and_missing_shard_are_named(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(tmp_path / "nowhere")
    sharded = shutil.copytree(checkpoint("tiny", shards=2), tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        load_model(sharded)


def test_fp8_block_checkpoint_dequantizes_on_request(checkpoint):
    """quant="dequantize": every FP8 tensor becomes transformers' dequantized weight (kept FP8 by default:
    tests/test_fp8_loading.py)."""
    path = checkpoint("tiny-fp8", fp8=True)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    on_disk = load_file(path / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert on_disk[name].dtype == torch.float8_e4m3fn and on_disk[name + "_scale_inv"].dtype == torch.bfloat16
    assert on_disk["mtp.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # the MTP block too
    assert on_disk["mtp.fc.weight"].dtype == torch.float32  # stays high precision
    state = load_model(path, dtype=torch.bfloat16, quant="dequantize").state_dict()
    for disk_name, tensor in on_disk.items():
        if disk_name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            expected = dequantize_fp8_block(tensor, on_disk[disk_name + "_scale_inv"], (128, 128))
        else:
            expected = tensor
        assert torch.equal(state[disk_name], expected.to(torch.bfloat16)), disk_name


def test_fp8_dequantize_handles_partial_edge_blocks():
    from qwen_mtp.quant.fp8 import quantize_fp8_block

    w = torch.randn(200, 130)
    q, scale = quantize_fp8_block(w)
    assert q.shape == (200, 130) and scale.shape == (2, 2)
    back = dequantize_fp8_block(q, scale, (128, 128))
    assert back[128:, 128:].abs().max() > 0
    torch.testing.assert_close(back, w, rtol=0.07, atol=0.02)  # e4m3 has a 3-bit mantissa


def test_load_state_dict_takes_hf_names_and_names_what_is_wrong(checkpoint):
    """`load_state_dict` writes HF-named tensors into the merged projections' rows, and, like torch's, refuses
    missing, unexpected and mis-shaped tensors by name."""
    path = checkpoint("tiny")
    on_disk = load_file(path / "model.safetensors")
    model = load_model(path, dtype=torch.float32)
    blank = QwenHybridForCausalLM(ModelConfig.from_pretrained(path))
    assert blank.load_state_dict(on_disk) == ([], [])
    assert all(torch.equal(blank.state_dict()[k], v) for k, v in model.state_dict().items())
    name = "model.layers.0.linear_attn.in_proj_b.weight"
    with pytest.raises(RuntimeError, match=rf"missing keys: \['{name}'\]"):
        blank.load_state_dict({k: v for k, v in on_disk.items() if k != name})
    with pytest.raises(RuntimeError, match=r"unexpected keys: \['model.layers.0.mlp.extra.weight'\]"):
        blank.load_state_dict({**on_disk, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(RuntimeError, match=rf"size mismatch for {name}: checkpoint \[3, 64\], model \[4, 64\]"):
        blank.load_state_dict({**on_disk, name: on_disk[name][:3]})
    keys = blank.load_state_dict({name: torch.ones(4, 64)}, strict=False)
    assert name not in keys.missing_keys and len(keys.missing_keys) == len(on_disk) - 1
    assert torch.equal(blank.checkpoint_slots()[name].tensor(), torch.ones(4, 64))


def test_cuda_without_a_cuda_device_is_refused_before_reading(monkeypatch, tmp_path):
    """Asked for CUDA on a machine without it, load_model says so before touching the checkpoint (here there
    is none: the device error must come first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(CheckpointError, match="no CUDA device is available"):
            load_model(tmp_path / "nowhere", device=device)


@pytest.mark.parametrize("device", ["cuda:abc", "gpu", "", "cpu:x"])
def test_malformed_device_is_refused_before_reading(tmp_path, device):
    with pytest.raises(CheckpointError, match=r"invalid device .*use 'cpu', 'cuda' or 'cuda:N'"):
        load_model(tmp_path / "nowhere", device=device)


def test_unsupported_device_type_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"unsupported device 'meta'"):
        load_model(tmp_path / "nowhere", device="meta")


def test_cuda_index_past_the_visible_devices_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(CheckpointError, match=r"'cuda:2' requested but only 2 CUDA device\(s\) are visible"):
        load_model(tmp_path / "nowhere", device="cuda:2")
