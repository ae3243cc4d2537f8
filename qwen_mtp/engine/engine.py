"""The public `Engine`: load a model from a recipe and generate greedily.

This version runs one request at a time with dense per-sequence caches; the paged, continuously batched
engine replaces the loop behind the same `generate` API.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.cache import SequenceCache
from qwen_mtp.engine.setup import LoadedModel, load_from_recipe
from qwen_mtp.errors import RequestError
from qwen_mtp.recipe import Recipe, load_recipe

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    token_ids: list[int]  # new tokens only
    finish_reason: str  # "stop" (an EOS token, included in token_ids) | "length"
    prompt_len: int


class Engine:
    def __init__(self, loaded: LoadedModel, recipe: Recipe):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.recipe = recipe
        self.config = self.model.config
        self.eos_ids = set(self.config.eos_token_ids)
        self.state_dtype = STATE_DTYPES[recipe.state.dtype]

    @classmethod
    def from_recipe(
        cls,
        source: str | Path | dict[str, Any] | Recipe | None = None,
        overrides: tuple[str, ...] = (),
        progress: bool = False,
    ) -> Engine:
        recipe = source if isinstance(source, Recipe) else load_recipe(source, overrides)
        return cls(load_from_recipe(recipe, progress=progress), recipe)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text through the checkpoint's tokenizer; token ids pass through."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer: give prompts as token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        """Raise `RequestError` for a request that can never run."""
        if not prompt:
            raise RequestError("empty prompt: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:10]}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        limit = self.config.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | None = None, ignore_eos: bool | None = None
    ) -> list[Result]:
        """Greedy continuation of each prompt (token ids); results in prompt order."""
        max_new = self.recipe.run.max_new_tokens if max_new_tokens is None else max_new_tokens
        ignore = self.recipe.run.ignore_eos if ignore_eos is None else ignore_eos
        for prompt in prompts:
            self.check_request(list(prompt), max_new)
        return [self._generate_one(list(prompt), max_new, ignore) for prompt in prompts]

    def _generate_one(self, prompt: list[int], max_new: int, ignore_eos: bool) -> Result:
        cache = SequenceCache(1, self.device, self.state_dtype)
        ids = torch.tensor([prompt], device=self.device)
        out: list[int] = []
        while True:
            hidden = self.model.hidden_states(ids, cache=cache)
            # HF picks the first maximal index of fp32 logits; torch.argmax does the same.
            token = int(self.model.logits(hidden[:, -1]).float().argmax(dim=-1))
            out.append(token)
            if token in self.eos_ids and not ignore_eos:
                return Result(out, "stop", len(prompt))
            if len(out) >= max_new:
                return Result(out, "length", len(prompt))
            ids = torch.tensor([[token]], device=self.device)
