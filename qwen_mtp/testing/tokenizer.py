"""A small byte-level BPE tokenizer trained locally (no hub), saved the way HF checkpoints ship theirs."""

from __future__ import annotations

from pathlib import Path

from qwen_mtp.train.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, train_tokenizer

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
    """Train and save `tokenizer.json` + `tokenizer_config.json` into `path` (the trainer `qwen-mtp train` uses,
    on a fixed corpus); returns the EOS token id.

    The vocabulary stays below `vocab_size` so every token id fits the model's embedding.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= {floor})")
    train_tokenizer([CORPUS] * 4, min(vocab_size, floor + 160), path)
    return Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(EOS_TOKEN)
