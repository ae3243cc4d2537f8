"""Test helpers. Hugging Face transformers is the reference implementation (its torch path: fla is not
installed on CPU)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def load_hf(path, dtype: torch.dtype):
    # from_pretrained(dtype=...), never .to(dtype): the latter also rounds the rotary inverse frequencies.
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: list[int] | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=(eos_ids or [0])[0],
    )
    return out[0, len(prompt) :].tolist()


def random_prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
