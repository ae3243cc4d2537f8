"""The byte-level BPE tokenizer a trained model ships: trained with `tokenizers` on the corpus's train files,
saved as `tokenizer.json` + `tokenizer_config.json`, which `transformers.AutoTokenizer` loads."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE of `vocab_size` tokens (the 256 bytes, the special tokens, then merges) and save
    it into `out_dir`. Byte-level: every string encodes, nothing maps to an unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def load_tokenizer(directory: Path):
    """The saved tokenizer as transformers loads it (what the engine will use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def encode_files(tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: each file's tokens followed by EOS (the document boundary), int32 [N]."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = [token for ids in encoded for token in (*ids, eos)]
    return torch.tensor(stream, dtype=torch.int32)
