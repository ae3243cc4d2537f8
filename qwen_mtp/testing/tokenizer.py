"""A small byte-level BPE tokenizer trained locally (no hub), saved the way HF checkpoints ship theirs."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A hybrid model mixes linear attention with full attention.
Gated DeltaNet layers keep a recurrent state; attention layers keep keys and values for every position.
Speculative decoding drafts a few tokens and verifies them in one forward pass of the target model.
Greedy decoding picks the most likely token at every step, so the output is deterministic and exact.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
def add(a, b):\n    return a + b\nprint(add(2, 3))\n
"""


def build_tokenizer(path: Path, vocab_size: int) -> int:
    """Train and save `tokenizer.json` + `tokenizer_config.json` into `path`; returns the EOS token id.

    The vocabulary stays below `vocab_size` so every token id fits the model's embedding.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    target = min(vocab_size, len(alphabet) + len(SPECIAL_TOKENS) + 160)
    if target < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= 259)")
    trainer = trainers.BpeTrainer(
        vocab_size=target, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return eos_id
