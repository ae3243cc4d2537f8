"""The public `Engine`: submit requests, step the continuous batch, stream or collect greedy tokens.

One step = the scheduler's choice (admissions, prefill chunks, one decode batch) run by the runner; finished
or cancelled requests give back their KV pages and state row at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.cache.kv import PagePool, pages_for
from qwen_mtp.cache.state import StatePool
from qwen_mtp.dtypes import STATE_DTYPES
from qwen_mtp.engine.graphs import StepGraphs, bucket_sizes
from qwen_mtp.engine.request import Request, SpecStats, Status
from qwen_mtp.engine.runner import Runner, StepKind
from qwen_mtp.engine.scheduler import PrefillChunk, Scheduler
from qwen_mtp.engine.setup import LoadedModel, load_from_recipe
from qwen_mtp.engine.sizing import PoolSizes, size_pools
from qwen_mtp.engine.speculative import Speculator
from qwen_mtp.engine.timing import PhaseTimer
from qwen_mtp.errors import RecipeError, RequestError
from qwen_mtp.recipe import Recipe, load_recipe


@dataclass
class Result:
    token_ids: list[int]  # new tokens only
    finish_reason: str  # "stop" (an EOS token, included in token_ids) | "length" | "cancelled"
    prompt_len: int
    spec: SpecStats | None = None  # speculation figures (drafted, accepted, acceptance length, per position)


@dataclass
class Update:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
    def __init__(self, loaded: LoadedModel, recipe: Recipe, log: Callable[[str], None] | None = None):
        if recipe.mtp.enabled and loaded.model.mtp is None:
            raise RecipeError(f"mtp.enabled: checkpoint {loaded.checkpoint} has no mtp.* weights (no MTP head)")
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.recipe = recipe
        self.config = self.model.config
        self.eos_ids = set(self.config.eos_token_ids)
        self.spec_tokens = recipe.mtp.k if recipe.mtp.enabled else 0
        sizes = size_pools(self.config, recipe, self.device, self.spec_tokens)
        self.pages, self.states = self._build_pools(sizes)
        self.scheduler = Scheduler(
            self.pages, self.states, recipe.cache.max_batch, recipe.cache.prefill_chunk, lookahead=self.spec_tokens
        )
        self.runner = Runner(self.model, self.pages, self.states, self.device, self.spec_tokens)
        if recipe.compile.enabled or recipe.compile.cuda_graphs:
            self.runner.graphs = self._build_graphs(log or _stderr)
        if recipe.compile.enabled and recipe.compile.prefill:
            self.runner.compile_prefill(recipe.compile.backend, log or _stderr)  # compiles on the first chunk
        self.speculator = None
        if recipe.mtp.enabled:
            mtp = recipe.mtp
            self.speculator = Speculator(self.runner, mtp.k, mtp.draft, mtp.oracle_accept, seed=recipe.model.seed)
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self.timer = PhaseTimer(device=self.device)  # enable to split step time by phase (benchmarks)
        (log or _stderr)(sizes.describe(self.pages.bytes, self.states.bytes))

    def _build_pools(self, sizes: PoolSizes) -> tuple[PagePool, StatePool]:
        shapes, dtype = self.model.shapes, self.model.lm_head_weight.dtype
        pages = PagePool(
            self.model.attention_cache_layers,
            sizes.num_pages,
            sizes.page_size,
            shapes.kv_heads,
            shapes.head_dim,
            dtype,
            self.device,
        )
        states = StatePool(
            self.model.gdn_cache_layers,
            sizes.num_state_rows,
            shapes.gdn_conv_dim,
            shapes.conv_kernel,
            shapes.gdn_value_heads,
            shapes.gdn_key_head_dim,
            shapes.gdn_value_head_dim,
            self.spec_tokens,
            conv_dtype=dtype,
            state_dtype=STATE_DTYPES[self.recipe.state.dtype],
            device=self.device,
        )
        return pages, states

    def _build_graphs(self, log: Callable[[str], None]) -> StepGraphs:
        settings = self.recipe.compile
        if settings.cuda_graphs and self.device.type != "cuda":
            raise RecipeError(f"compile.cuda_graphs needs a CUDA device, the model is on {self.device}")
        sizes = bucket_sizes(settings.batch_sizes, self.recipe.cache.max_batch)
        if sizes[-1] < self.recipe.cache.max_batch:
            raise RecipeError(
                f"compile.batch_sizes {sizes} must cover cache.max_batch ({self.recipe.cache.max_batch}): a request "
                "must never switch between graphed and eager steps"
            )
        pool_tokens = self.pages.num_pages * self.pages.page_size
        longest = min(self.config.max_position_embeddings + self.spec_tokens, pool_tokens)  # one request, at most
        return StepGraphs(
            self.runner.steps,
            sizes,
            pages_for(longest, self.pages.page_size),
            compile=settings.enabled,
            capture=settings.cuda_graphs,
            backend=settings.backend,
            log=log,
        )

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile and capture every decode-path step now (otherwise each is built the first time it runs)."""
        if self.runner.graphs is not None:
            spec = self.spec_tokens + 1 if self.speculator is not None else None
            self.runner.graphs.warmup([1] + ([spec] if spec else []), spec)

    @classmethod
    def from_recipe(
        cls,
        source: str | Path | dict[str, Any] | Recipe | None = None,
        overrides: tuple[str, ...] = (),
        progress: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> Engine:
        recipe = source if isinstance(source, Recipe) else load_recipe(source, overrides)
        return cls(load_from_recipe(recipe, progress=progress), recipe, log=log)

    # ---- text <-> tokens -------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text through the checkpoint's tokenizer; token ids pass through."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer: give prompts as token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ---- requests --------------------------------------------------------------------------------------------
    def check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        """Raise `RequestError` for a request that can never run. Nothing is allocated."""
        if not prompt:
            raise RequestError("empty prompt: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
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
        need = pages_for(len(prompt) + max_new_tokens + self.spec_tokens, self.pages.page_size)
        if need > self.pages.num_pages:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) needs {need} KV pages but the "
                f"whole pool has {self.pages.num_pages}; raise cache.num_pages or cache.memory_fraction"
            )

    def submit(
        self,
        prompt_ids: list[int],
        max_new_tokens: int | None = None,
        ignore_eos: bool | None = None,
        speculate: bool | None = None,
        oracle: list[int] | None = None,
    ) -> int:
        """Queue a request; returns its id. It runs as soon as pages, a state row and a batch place are free.

        `speculate` (default: `mtp.enabled`) decodes it with MTP drafts; `oracle` is its plain-greedy
        continuation, required for `mtp.draft: oracle` (`generate` and `stream` compute it themselves)."""
        prompt = list(prompt_ids)
        max_new = self.recipe.run.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.check_request(prompt, max_new)
        speculate = self.speculator is not None if speculate is None else speculate
        if speculate and self.speculator is None:
            raise RequestError("speculate=True needs mtp.enabled: true in the recipe")
        if speculate and self.recipe.mtp.draft == "oracle" and oracle is None:
            raise RequestError("mtp.draft is oracle: pass the plain-greedy continuation as oracle=[...]")
        request = Request(
            self._next_id, prompt, max_new, self.recipe.run.ignore_eos if ignore_eos is None else ignore_eos
        )
        request.oracle = oracle
        if speculate:
            self.speculator.start(request)
        self._next_id += 1
        self.requests[request.id] = request
        self.scheduler.add(request)
        return request.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request now and reclaim its pages and state row; False if it had already ended."""
        request = self.requests[request_id]
        if request.done:
            return False
        self._release(request)
        request.status, request.finish_reason = Status.CANCELLED, "cancelled"
        return True

    def _release(self, request: Request) -> None:
        self.scheduler.remove(request)
        if self.speculator is not None:
            self.speculator.forget(request)

    def result(self, request_id: int) -> Result:
        request = self.requests[request_id]
        return Result(list(request.output), request.finish_reason or "", len(request.prompt), request.spec)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- the loop --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Update]:
        """Run one engine step; returns the new tokens of every request that got some, and who finished."""
        plan = self.scheduler.schedule()
        if plan.empty and self.scheduler.waiting:
            raise RuntimeError("scheduler made no progress with requests waiting (pool accounting bug)")
        with self.timer("prefill"):
            updates = [u for chunk in plan.prefills if (u := self._prefill(chunk)) is not None]
        plain = [r for r in plan.decodes if r.spec is None]
        speculative = [r for r in plan.decodes if r.spec is not None]
        if plain:
            with self.timer("decode"):
                updates += self._decode(plain)
        if speculative:
            with self.timer("verify"):
                gained, verified = self.speculator.verify(speculative)
                updates += [self._accept(r, tokens) for r, tokens in zip(speculative, gained, strict=True)]
            with self.timer("draft"):
                self.speculator.propose(verified, [r for r in speculative if not r.done])
        return updates

    def _prefill(self, chunk: PrefillChunk) -> Update | None:
        request = chunk.request
        tokens = request.prompt[chunk.start : chunk.start + chunk.length]
        batch = self.runner.batch(StepKind.PREFILL, [request], [tokens], [chunk.start])
        hidden = self.runner.prefill(batch)
        request.num_computed += chunk.length
        update = None
        if not request.in_prefill:
            update = self._accept(request, [int(self.runner.greedy(hidden[:, -1])[0])])
        if request.spec is not None and not request.done:
            first = request.output[0] if update is not None else None
            self.speculator.prefill_chunk(request, chunk.start, hidden, first)
        return update

    def _decode(self, requests: list[Request]) -> list[Update]:
        """Plain greedy decode: one token per request."""
        tokens = [[r.tokens[r.num_computed]] for r in requests]
        batch = self.runner.batch(StepKind.DECODE, requests, tokens, [r.num_computed for r in requests])
        next_tokens = self.runner.decode(batch)[1][:, -1].tolist()
        updates = []
        for request, token in zip(requests, next_tokens, strict=True):
            request.num_computed += 1
            updates.append(self._accept(request, [token]))
        return updates

    def _accept(self, request: Request, tokens: list[int]) -> Update:
        """Append tokens, cutting exactly where plain greedy decoding would stop (EOS or max_new_tokens)."""
        new = []
        for token in tokens:
            new.append(token)
            request.output.append(token)
            if token in self.eos_ids and not request.ignore_eos:
                request.finish_reason = "stop"
            elif len(request.output) >= request.max_new_tokens:
                request.finish_reason = "length"
            if request.finish_reason:
                request.status = Status.FINISHED
                self._release(request)
                break
        return Update(request.id, new, request.done, request.finish_reason)

    def stream(
        self, prompts: list[list[int]], max_new_tokens: int | None = None, ignore_eos: bool | None = None
    ) -> Iterator[Update]:
        """Submit the prompts and yield their updates as they come (other requests keep running too)."""
        ids = self._submit_all(prompts, max_new_tokens, ignore_eos)
        mine = set(ids)
        while any(not self.requests[i].done for i in ids):
            for update in self.step():
                if update.request_id in mine:
                    yield update

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int | None = None, ignore_eos: bool | None = None
    ) -> list[Result]:
        """Greedy continuation of each prompt (token ids), generated as one continuous batch; prompt order."""
        ids = self._submit_all(prompts, max_new_tokens, ignore_eos)
        self._run_until_done(ids)
        return [self.result(i) for i in ids]

    def _run_until_done(self, ids: list[int]) -> None:
        while any(not self.requests[i].done for i in ids):
            self.step()

    def _submit_all(self, prompts, max_new_tokens, ignore_eos) -> list[int]:
        max_new = self.recipe.run.max_new_tokens if max_new_tokens is None else max_new_tokens
        for prompt in prompts:  # validate all first: a bad prompt must not leave the others queued
            self.check_request(list(prompt), max_new)
        oracles = [None] * len(prompts)
        if self.speculator is not None and self.recipe.mtp.draft == "oracle":
            # Oracle drafts replay each request's plain-greedy continuation: compute it first, without MTP.
            plain = [self.submit(p, max_new, ignore_eos, speculate=False) for p in prompts]
            self._run_until_done(plain)
            oracles = [self.requests[i].output for i in plain]
        return [self.submit(p, max_new, ignore_eos, oracle=o) for p, o in zip(prompts, oracles, strict=True)]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "total_pages": self.pages.num_pages,
            "free_pages": self.pages.free_pages,
            "total_state_rows": self.states.num_rows,
            "free_state_rows": self.states.free_rows,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
        if self.speculator is not None:
            totals = self.speculator.totals
            stats.update(
                verify_steps=totals.verify_steps,
                drafted=totals.drafted,
                accepted=totals.accepted,
                acceptance_length=totals.acceptance_length,
                position_acceptance=totals.position_acceptance,
            )
        return stats


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
