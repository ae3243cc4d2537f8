"""Tiny checkpoints in the real Hugging Face layout (config, safetensors with `mtp.*`, tokenizer), for tests,
benchmarks and users without a model download."""

from qwen_mtp.testing.checkpoint import PRESETS, build_checkpoint, fixture_path

__all__ = ["PRESETS", "build_checkpoint", "fixture_path"]
