"""The public `Engine`: submit requests, step the continuous batch, stream or collect their tokens.

One step: take what other threads submitted or cancelled (the inbox), let the scheduler choose (admissions,
prefill chunks, one decode batch, one verify batch) and grow the pages they write, launch them through the
runner, read the results back in one device->host copy, and let `update.py` write them into the requests.
Finished or cancelled requests give back their KV pages and state row at once.

Threads: `submit` and `cancel` may be called from any thread; they go through the inbox (a cancel applies at
once when no step is running). Steps are serialized by one lock; `generate` and `stream` step the engine until
their own requests end, reading their tokens from the requests (each stream keeps a cursor per request), so
several threads can generate on one engine at once, whoever happens to run a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import random
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.cache.kv import PagePool, pages_for
from qwen_mtp.cache.prefix import PrefixCache
from qwen_mtp.cache.state import StatePool, StateSnapshots
from qwen_mtp.dtypes import STATE_DTYPES
from qwen_mtp.engine import grammar
from qwen_mtp.engine.draft_vocab import draft_ids
from qwen_mtp.engine.graphs import ChunkGraphs, StepGraphs, bucket_sizes
from qwen_mtp.engine.paged_cache import StepKind
from qwen_mtp.engine.params import SamplingParams, as_token_ids, is_token_id
from qwen_mtp.engine.request import Request, SpecStats
from qwen_mtp.engine.runner import PendingRead, Runner
from qwen_mtp.engine.scheduler import PrefillChunk, Scheduler
from qwen_mtp.engine.setup import LoadedModel, load_from_recipe
from qwen_mtp.engine.sizing import PoolSizes, check_forward_rows, size_pools
from qwen_mtp.engine.speculative import Ahead, Speculator
from qwen_mtp.engine.stop_strings import cut_at_stop_string
from qwen_mtp.engine.timing import PhaseTimer
from qwen_mtp.engine.update import Outcome, RequestUpdater, TokenLogprob, Update
from qwen_mtp.errors import RecipeError, RequestError
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.recipe import CacheSection, CompileSection, MTPSection, Recipe, StateSection, load_recipe


@dataclass
class Result:
    token_ids: list[int]  # new tokens only
    finish_reason: str  # "stop" (an EOS or stop token, included in token_ids) | "length" | "cancelled" | "error"
    prompt_len: int
    spec: SpecStats | None = None  # speculation figures (drafted, accepted, acceptance length, per position)
    error: BaseException | None = None  # what the failed step raised (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt position (the first is None)
    seed: int | None = None  # the request's sampling seed (drawn at submit when not given)
    cached_tokens: int = 0  # prompt positions restored from the prefix cache (cache.prefix_caching)
    text: str | None = None  # token_ids decoded, cut before the first stop string (None without a tokenizer)


@dataclass
class _Ahead:
    """A lookahead decode step in flight (`cache.lookahead`): launched, its copy to the host queued, its results
    not yet applied."""

    launched: _Launched
    read: PendingRead | None  # None when its launch raised


@dataclass
class _Launched:
    """One launched part of a step (a prefill chunk, the decode batch, the verify batch): its requests, the
    device results to read back, and how those values become outcomes; or the error it raised."""

    requests: list[Request]
    parts: list[torch.Tensor] = dataclasses.field(default_factory=list)
    outcomes: Callable[[list[list[int]]], list[Outcome]] | None = None
    error: BaseException | None = None
    verified: Ahead | None = None  # a verify batch's device results, which a lookahead verify starts from


DEFAULT_STEP_TOKENS = 8192  # mixed steps' token budget when `cache.max_step_tokens` is null (`Engine._step_budget`)


def mixed_steps_on(cache: CacheSection, device: torch.device, tensor_parallel: bool) -> bool:
    """Whether a step's prefill chunks run packed (`cache.mixed_steps`): as it says, or (null) on a single CUDA
    device. Off on CPU, where the packed prefill's batch-invariant linears are the slow reference, and with tensor
    parallelism, whose packed steps have not run on two GPUs."""
    if cache.mixed_steps is not None:
        return cache.mixed_steps
    return device.type == "cuda" and not tensor_parallel


def prefill_graphs_on(compile: CompileSection, graphs: bool, tensor_parallel: bool) -> bool:
    """Whether full prefill chunks replay CUDA graphs: as `compile.prefill_graphs` says, or (null) wherever the
    decode steps are graphed, except with compiled prefill chunks or tensor parallelism, which it excludes."""
    if compile.prefill_graphs is not None:
        return compile.prefill_graphs
    return graphs and not tensor_parallel and not (compile.enabled and compile.prefill)


class Engine:
    """Generation over one loaded model. Takes only the recipe sections it needs (`from_recipe` reads them
    from a recipe); `seed` seeds the oracle drafts' choices (`mtp.draft: oracle`) and the generator that draws
    the sampling seed of each request submitted without one."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        mtp: MTPSection | None = None,
        state: StateSection | None = None,
        cache: CacheSection | None = None,
        compile: CompileSection | None = None,
        seed: int = 0,
        log: Callable[[str], None] | None = None,
    ):
        mtp, state, cache = mtp or MTPSection(), state or StateSection(), cache or CacheSection()
        compile, log = compile or CompileSection(), log or _stderr
        if mtp.enabled and loaded.model.mtp is None:
            raise RecipeError(f"mtp.enabled: checkpoint {loaded.checkpoint} has no mtp.* weights (no MTP head)")
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.checkpoint = loaded.checkpoint  # the directory it was loaded from (the server reads its generation config)
        self.device = loaded.device
        self.config = self.model.config
        self.eos_ids = set(self.config.eos_token_ids)
        # structured outputs: grammars compiled against the tokenizer over the logits' vocabulary
        self.grammars = grammar.Grammars(self.tokenizer, self.config.vocab_size, self.eos_ids)
        self.spec_tokens = mtp.max_drafts if mtp.enabled else 0  # the most drafts a step verifies
        self.mixed_steps = mixed_steps_on(cache, self.device, tensor_parallel=self.model.parallel is not None)
        step_budget = self._step_budget(cache)
        self._check_forward_rows(cache, step_budget)
        # before the pools are sized from the free memory, so that they leave room for its copy
        draft_head = self._draft_head(mtp) if mtp.enabled else None
        dtype = self.model.lm_head_weight.dtype
        sizes = size_pools(self.config, self.model.shapes, cache, dtype, state.dtype, self.device, self.spec_tokens)
        # Tensor parallel (SPMD): every rank runs this loop on the same schedule, so the pools must agree.
        self.parallel = self.model.parallel
        if self.parallel is not None:
            smallest = self.parallel.smallest
            sizes = dataclasses.replace(
                sizes, num_pages=smallest(sizes.num_pages), num_snapshots=smallest(sizes.num_snapshots)
            )
        self.pages, self.states = self._build_pools(sizes, dtype, state.dtype)
        self.snapshots, self.prefix = self._build_prefix_cache(cache, sizes)
        self.cache_outputs = cache.prefix_cache_outputs
        self.lookahead = cache.lookahead
        self._ahead: _Ahead | None = None  # the lookahead step in flight
        self.lookahead_steps = 0  # steps launched ahead of the step before them (`cache.lookahead`)
        self.scheduler = Scheduler(
            self.pages, self.states, cache.max_batch, cache.prefill_chunk, k=self.spec_tokens, prefix=self.prefix,
            max_step_tokens=step_budget,
        )  # fmt: skip
        self.runner = Runner(self.model, self.pages, self.states, self.device, self.spec_tokens)
        self.runner.coupled_drafts = mtp.coupled_drafts
        self.runner.grammars = self.grammars
        graphs = compile.cuda_graphs if compile.cuda_graphs is not None else self.device.type == "cuda"
        if compile.enabled or graphs:
            self.runner.graphs = self._build_graphs(compile, graphs, cache.max_batch, log)
        compiled = "torch.compile" + (" + CUDA graphs" if graphs else "")
        # what the decode path runs: "eager", "CUDA graphs", "torch.compile" or "torch.compile + CUDA graphs"
        self.decode_path = compiled if compile.enabled else "CUDA graphs" if graphs else "eager"
        if compile.enabled and compile.prefill:
            self.runner.compile_prefill(compile.backend, log)  # compiles on the first chunk
        if prefill_graphs_on(compile, graphs, tensor_parallel=self.parallel is not None):
            self.runner.chunk_graphs = self._build_chunk_graphs(cache.prefill_chunk, graphs, log)
        self.speculator = None
        if mtp.enabled:
            buckets = self.runner.graphs.buckets if self.runner.graphs else bucket_sizes([], cache.max_batch)
            self.speculator = Speculator(
                self.runner, mtp.k, mtp.draft, mtp.oracle_accept, seed=seed, max_k=mtp.max_k, buckets=buckets
            )
            self.runner.steps.draft_head = draft_head
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        self.updater = RequestUpdater(lambda: self.eos_ids, self._release, self._record_acceptance, decode)
        self._seeds = random.Random(seed)  # draws the seed of a request submitted without one
        self.requests: dict[int, Request] = {}  # submitted and not yet read back (see `result`)
        self.timer = PhaseTimer(device=self.device)  # enable to split step time by phase (benchmarks)
        self._ids = itertools.count()
        self._submitted: queue.SimpleQueue[Request] = queue.SimpleQueue()  # the inbox (put is reentrant)
        self._cancelled: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._lock = threading.Lock()  # held for a whole step: steps never overlap
        log(sizes.describe(self.pages.bytes, self.states.bytes, self.snapshots.bytes if self.snapshots else 0))

    def _check_forward_rows(self, cache: CacheSection, step_budget: int | None) -> None:
        """On CUDA, the most tokens one prefill forward carries (a chunk, or a mixed step's budget) must fit the
        kernels' 32-bit offsets over the widest projection output (the lm_head aside: prefill runs it on the
        positions whose logits are asked for only)."""
        if self.device.type != "cuda":
            return
        widest = max(
            (m.weight.shape[0] for m in self.model.modules() if isinstance(m, Linear | MergedLinear)
             and m is not self.model.lm_head),
            default=self.config.hidden_size,
        )  # fmt: skip
        if step_budget is not None:
            check_forward_rows(step_budget, widest, "cache.max_step_tokens")
        check_forward_rows(cache.prefill_chunk, widest, "cache.prefill_chunk")

    def _step_budget(self, cache: CacheSection) -> int | None:
        """Mixed steps' token budget, which must hold every decode/verify row and one full prefill chunk (so
        prefill always progresses): `cache.max_step_tokens`, checked, or (null) `DEFAULT_STEP_TOKENS` raised to that
        least where it is more (a long `prefill_chunk`); None without mixed steps (every request in prefill runs its
        next chunk)."""
        if not self.mixed_steps:
            return None
        least = cache.max_batch * (self.spec_tokens + 1) + cache.prefill_chunk
        if cache.max_step_tokens is None:
            return max(DEFAULT_STEP_TOKENS, least)
        if cache.max_step_tokens < least:
            raise RecipeError(
                f"cache.max_step_tokens ({cache.max_step_tokens}) must hold cache.max_batch decode rows of "
                f"{self.spec_tokens + 1} tokens plus one cache.prefill_chunk ({cache.prefill_chunk}): at least {least} "
                "(or cache.mixed_steps: false)"
            )
        return cache.max_step_tokens

    def _build_pools(self, sizes: PoolSizes, dtype: torch.dtype, state_dtype: str) -> tuple[PagePool, StatePool]:
        shapes = self.model.shapes
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
            state_dtype=STATE_DTYPES[state_dtype],
            device=self.device,
        )
        return pages, states

    def _build_prefix_cache(
        self, cache: CacheSection, sizes: PoolSizes
    ) -> tuple[StateSnapshots | None, PrefixCache | None]:
        if not cache.prefix_caching:
            return None, None
        if cache.prefill_chunk % cache.page_size:
            raise RecipeError(
                f"cache.prefix_caching shares whole pages of full prefill chunks: cache.prefill_chunk "
                f"({cache.prefill_chunk}) must be a multiple of cache.page_size ({cache.page_size})"
            )
        snapshots = StateSnapshots(self.states, sizes.num_snapshots)
        return snapshots, PrefixCache(self.pages, snapshots, cache.prefill_chunk)

    def _build_graphs(
        self, settings: CompileSection, capture: bool, max_batch: int, log: Callable[[str], None]
    ) -> StepGraphs:
        if capture and self.device.type != "cuda":
            raise RecipeError(f"compile.cuda_graphs needs a CUDA device, the model is on {self.device}")
        sizes = bucket_sizes(settings.batch_sizes, max_batch)
        if sizes[-1] < max_batch:
            raise RecipeError(
                f"compile.batch_sizes {sizes} must cover cache.max_batch ({max_batch}): a request "
                "must never switch between graphed and eager steps"
            )
        return StepGraphs(
            self.runner.steps,
            sizes,
            self._widest_table(),
            compile=settings.enabled,
            capture=capture,
            backend=settings.backend,
            log=log,
        )

    def _build_chunk_graphs(self, chunk: int, capture: bool, log: Callable[[str], None]) -> ChunkGraphs:
        if self.parallel is not None:
            raise RecipeError("compile.prefill_graphs is not available with tensor parallelism yet (parallel.tp > 1)")
        if capture and self.device.type != "cuda":
            raise RecipeError(f"compile.prefill_graphs captures CUDA graphs: the model is on {self.device}")
        return ChunkGraphs(self.runner.prefill_steps, chunk, self._widest_table(), capture, log)

    def _widest_table(self) -> int:
        """Pages in one request's table at most: its positions, and the 2K past them that a verify and its draft
        chain write, within the pool (the static page-table width of the graphs)."""
        pool_tokens = self.pages.num_pages * self.pages.page_size
        longest = min(self.config.max_position_embeddings + 2 * self.spec_tokens, pool_tokens)
        return pages_for(longest, self.pages.page_size)

    def _draft_head(self, mtp: MTPSection) -> DraftLmHead | None:
        """What the drafts score with (`model/mtp.py`): the lm_head's rows for `mtp.draft_vocab`, an FP8 copy for
        `mtp.draft_lm_head: fp8`, made now from the lm_head; None for the lm_head itself."""
        if mtp.draft_lm_head not in ("bf16", "fp8"):  # an MTPSection built in code skips the recipe's check
            raise RecipeError(f"mtp.draft_lm_head must be bf16 or fp8, got {mtp.draft_lm_head!r}")
        fp8 = mtp.draft_lm_head == "fp8"
        if not (mtp.draft_vocab or fp8):
            return None
        weight = self.model.lm_head_weight  # tensor parallel: this rank's vocabulary shard, from id `start`
        shard = self.model.vocab_shard
        start = 0 if shard is None else shard.start
        ids = draft_ids(mtp.draft_vocab_file, mtp.draft_vocab, self.model.vocab_rows) if mtp.draft_vocab else None
        if ids is not None and shard is not None:
            ids = ids[(ids >= start) & (ids < start + weight.shape[0])]  # this rank's part (possibly none)
        # the FP8 product follows `model.fp8_decode`, which `set_fp8_decode` wrote into every linear module
        return DraftLmHead(weight, ids, fp8=fp8, w8a8=self.model.mtp.fc.fp8_decode == "w8a8", start=start)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile and capture every decode-path step now (otherwise each is built the first time it runs), and
        the full-chunk prefill graphs (`compile.prefill_graphs`); with `mtp.k: auto` also time each bucket's steps
        for the K policy."""
        with self._lock:
            if self.runner.chunk_graphs is not None:
                self.runner.chunk_graphs.warmup(mtp=self.speculator is not None, packed=self.mixed_steps)
            if self.runner.graphs is not None:
                spec = self.speculator
                auto = spec is not None and spec.policy is not None
                drafts = list(range(1, spec.max_k + 2)) if auto else [spec.max_k + 1] if spec is not None else []
                self.runner.graphs.warmup(sorted({1, *drafts}), drafts)
            if self.speculator is not None:
                self.speculator.calibrate()

    @classmethod
    def from_recipe(
        cls,
        source: str | Path | dict[str, Any] | Recipe | None = None,
        overrides: tuple[str, ...] = (),
        progress: bool = False,
        log: Callable[[str], None] | None = None,
        loaded: LoadedModel | None = None,
    ) -> Engine:
        """An engine for a recipe (a path, a dict, a `Recipe`); `loaded` reuses a model already loaded."""
        recipe = source if isinstance(source, Recipe) else load_recipe(source, overrides)
        loaded = loaded or load_from_recipe(recipe, progress=progress)
        sections = {"mtp": recipe.mtp, "state": recipe.state, "cache": recipe.cache, "compile": recipe.compile}
        return cls(loaded, **sections, seed=recipe.model.seed, log=log)

    # ---- text <-> tokens -------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text through the checkpoint's tokenizer; token ids pass through (checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer: give prompts as token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return as_token_ids(prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ---- requests --------------------------------------------------------------------------------------------
    def check_request(self, prompt: list[int], params: SamplingParams, speculative: bool | None = None) -> None:
        """Raise `RequestError` for a request that can never run. Nothing is allocated."""
        if not prompt:
            raise RequestError("empty prompt: give at least one token")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this checkpoint has none: use stop_token_ids")
        if params.structured is not None:
            self.grammars.check(params.structured)  # a grammar this tokenizer cannot compile fails here
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:10]}")
        biased = [t for t, _ in params.logit_bias if t >= vocab]
        if biased:
            raise RequestError(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {biased[:10]}")
        max_new, limit = params.max_new_tokens, self.config.max_position_embeddings
        if len(prompt) + max_new > limit:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        speculative = self.speculator is not None if speculative is None else speculative
        need = pages_for(self.scheduler.positions_reserved(len(prompt) + max_new, speculative), self.pages.page_size)
        if need > self.pages.num_pages:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) needs {need} KV pages but the "
                f"whole pool has {self.pages.num_pages}; raise cache.num_pages or cache.memory_fraction"
            )

    def submit(self, prompt_ids: Any, params: SamplingParams | None = None) -> int:
        """Queue a request (token ids: a list of ints, a 1-D integer numpy array or tensor); returns its id. It
        runs as soon as pages, a state row and a batch place are free, speculatively when `mtp.enabled`. Safe
        from any thread."""
        if self.speculator is not None and self.speculator.oracle:
            raise RequestError(
                "mtp.draft is oracle: a request needs its plain-decoding continuation; use generate or stream, "
                "which compute it (benchmarks and tests: submit_with_oracle)"
            )
        return self._submit(as_token_ids(prompt_ids), self._params(params)).id

    def submit_with_oracle(self, prompt_ids: Any, oracle: list[int], params: SamplingParams | None = None) -> int:
        """Benchmarks and tests: `submit` in `mtp.draft: oracle` mode, with the prompt's plain-decoding
        continuation `oracle` (the drafts replay it; see speculative.py)."""
        if self.speculator is None or not self.speculator.oracle:
            raise RequestError("submit_with_oracle needs mtp.enabled: true and mtp.draft: oracle")
        return self._submit(as_token_ids(prompt_ids), self._params(params), oracle=list(oracle)).id

    def _submit(
        self, prompt: list[int], params: SamplingParams, speculate: bool | None = None, oracle: list[int] | None = None
    ) -> Request:
        speculate = self.speculator is not None if speculate is None else speculate
        self.check_request(prompt, params, speculate)
        request = Request(next(self._ids), prompt, self._seeded(params))
        if params.structured is not None:
            request.grammar = self.grammars.matcher(params.structured)
        if speculate:
            self.speculator.start(request, oracle)
        self.requests[request.id] = request
        self._submitted.put(request)
        return request

    def cancel(self, request_id: int) -> bool:
        """Stop a request and reclaim its pages and state row; False if it had already ended. Safe from any
        thread: applied at once unless a step is running, else as the next step starts."""
        return self._cancel(self._request(request_id))

    def _cancel(self, request: Request) -> bool:
        if request.done:
            return False
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
                if not request.done:
                    self.updater.finish(request, "cancelled")
            finally:
                self._lock.release()
        else:  # a step is running (in another thread, or this one is being finalised inside it)
            self._cancelled.put(request)
        return True

    def result(self, request_id: int) -> Result:
        """The request's tokens so far and how it ended. A finished request's result is read once: the engine
        forgets the request then (`requests` keeps only requests whose result is still to be read)."""
        request = self._request(request_id)
        if request.done:
            self.requests.pop(request_id, None)
        output = request.output
        text = None if self.tokenizer is None else self.tokenizer.decode(output)
        if text is not None and request.params.stop:
            text = cut_at_stop_string(text, request.params.stop)
        return Result(
            output, request.finish_reason or "", len(request.prompt), request.spec, request.error,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
            seed=request.params.seed, text=text, cached_tokens=request.cached_tokens,
        )  # fmt: skip

    def has_unfinished(self) -> bool:
        """Whether any request (or prefix-cache fill) is queued or running."""
        scheduler = self.scheduler
        return bool(scheduler.waiting or scheduler.fills or scheduler.running or not self._submitted.empty())

    def _request(self, request_id: int) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"no request {request_id!r}: never submitted, or its result was already read")
        return request

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """`params` with a seed: drawn from the engine's generator when not given, so the request can be replayed
        (`Result.seed`). Greedy requests draw one too: it costs nothing and keeps the draws in submission order."""
        return params if params.seed is not None else dataclasses.replace(params, seed=self._seeds.getrandbits(63))

    def _params(
        self, params: SamplingParams | None, max_new_tokens: int | None = None, ignore_eos: bool | None = None
    ) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a qwen_mtp.SamplingParams, got {type(params).__name__} {params!r}")
        given = {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
        changes = {key: value for key, value in given.items() if value is not None}
        return dataclasses.replace(params, **changes) if changes else params

    def _release(self, request: Request) -> None:
        fill = self._output_fill(request)
        self.scheduler.remove(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        if fill is not None:
            self.scheduler.add(fill)

    def _record_acceptance(self, request: Request, accepted: int, drafted: int) -> None:
        self.speculator.record(request, accepted, drafted)

    # ---- the loop --------------------------------------------------------------------------------------------
    def step(self) -> list[Update]:
        """Run one engine step; returns the new tokens of every request that got some, and who finished."""
        with self._lock:
            return self._step()

    def _drain(self) -> None:
        """Take in what other threads submitted and cancelled (under the step lock)."""
        while not self._submitted.empty():
            request = self._submitted.get()
            if not request.done:  # a request cancelled before its first step never enters the queues
                self.scheduler.add(request)
        while not self._cancelled.empty():
            request = self._cancelled.get()
            if not request.done:
                self.updater.finish(request, "cancelled")

    @torch.inference_mode()
    def _step(self) -> list[Update]:
        self._drain()
        if self._ahead is not None:
            return self._step_ahead()
        plan = self.scheduler.schedule()
        if plan.empty and self.scheduler.waiting:
            raise RuntimeError("scheduler made no progress with requests waiting (pool accounting bug)")
        launched = []
        if self.prefix is not None:
            self._restore_prefixes(plan.restores)
        with self.timer("prefill"):
            if self.mixed_steps and plan.prefills:
                launched += self._launch_packed_prefill(plan.prefills)
            else:
                launched += [self._guard([chunk.request], self._launch_prefill, chunk) for chunk in plan.prefills]
        if self.prefix is not None:
            self._save_snapshots(plan.prefills, launched)
        if plan.decodes:
            with self.timer("decode"):
                launched.append(self._guard(plan.decodes, self._launch_decode, plan.decodes))
        if plan.verifies:
            launched.append(self._guard(plan.verifies, self._launch_verify, plan.verifies))
        read = self._start_read(launched)
        if bool(plan.decodes) != bool(plan.verifies) and not (plan.prefills or plan.restores):
            self._launch_ahead(launched[-1])
        return self._finish(launched, read, plan.prefills)

    def _step_ahead(self) -> list[Update]:
        """The step after a lookahead launch: launch the next one ahead of it if the scheduler allows, then read
        and apply the one in flight."""
        ahead, self._ahead = self._ahead, None
        self._launch_ahead(ahead.launched)
        return self._finish([ahead.launched], ahead.read)

    def _launch_ahead(self, step: _Launched) -> None:
        """`cache.lookahead`: launch the next step of `step`'s requests now, from what `step` chose (still on the
        device), before `step`'s results are read: a plain decode of its tokens, or a verify of its last accepted
        token and its drafts. Every request then has one step in flight beyond what it has applied; the
        scheduler allows it only when that step surely runs."""
        verify = step.verified is not None
        if not self.lookahead or step.error is not None:
            return
        if verify and not self.speculator.can_look_ahead(step.requests, step.verified.verified.k):
            return
        if grammar.constrained(step.requests):  # the next step's token masks need this step's tokens on the host
            return
        if not self.scheduler.schedule_ahead(step.requests):
            return
        if verify:
            launched = self._guard(step.requests, self._launch_verify, step.requests, step.verified)
        else:
            tokens = step.parts[0].reshape(len(step.requests), 1)
            launched = self._guard(step.requests, self._launch_decode, step.requests, tokens)
        self._ahead = _Ahead(launched, self._start_read([launched]) if launched.error is None else None)
        self.lookahead_steps += 1

    def _start_read(self, launched: list[_Launched]) -> PendingRead | None:
        """Queue the copy of the launched parts' results to the host; None if the device failed already."""
        try:
            return self.runner.start_read([part for item in launched for part in item.parts])
        except Exception:
            if self.parallel is not None:
                raise
            return None

    def _finish(
        self, launched: list[_Launched], read: PendingRead | None, prefills: list[PrefillChunk] | None = None
    ) -> list[Update]:
        """Read the step's results and write them into its requests (finishing those that end)."""
        try:
            if read is None and any(item.error is None for item in launched):
                raise RuntimeError("the copy of this step's results to the host could not be queued")
            values = read.values() if read is not None else []
        except Exception as err:  # the device failed: no result of this step can be trusted
            if self.parallel is not None:
                raise  # the other ranks cannot know: the run ends on every rank (see _guard)
            launched, values = [_Launched(item.requests, error=err) for item in launched], []
        outcomes, offset = [], 0
        for item in launched:
            if item.error is not None:
                outcomes += [Outcome(request, error=item.error) for request in item.requests]
                continue
            outcomes += item.outcomes(values[offset : offset + len(item.parts)])
            offset += len(item.parts)
        if self.prefix is not None:
            self._cache_chunks(prefills or [], outcomes)
        updates = self.updater.apply(outcomes)
        if self.prefix is not None:
            self._end_fills()
        return updates

    def _guard(self, requests: list[Request], launch: Callable[..., _Launched], *args) -> _Launched:
        """Launch one part of the step; if it raises, only its requests end (finish_reason "error"). Under
        tensor parallelism the error ends the run instead: a collective that failed on one rank (a dead peer)
        leaves the ranks' schedules apart, and agreeing on a partial failure would cost a host round trip."""
        try:
            return launch(*args)
        except Exception as err:
            if self.parallel is not None:
                raise
            return _Launched(requests, error=err)

    def _launch_packed_prefill(self, chunks: list[PrefillChunk]) -> list[_Launched]:
        """Mixed steps: the target over all of the step's chunks in one packed forward, then each chunk's own
        part (MTP head, first token, drafts, logprobs) from its hidden states, as an unpacked chunk runs it. One
        launched part per chunk, in order; if the packed forward raises, all its chunks' requests end."""
        try:
            hiddens = self.runner.prefill_packed(chunks)
        except Exception as err:
            if self.parallel is not None:
                raise
            return [_Launched([chunk.request], error=err) for chunk in chunks]
        return [
            self._guard([chunk.request], self._launch_prefill, chunk, hidden)
            for chunk, hidden in zip(chunks, hiddens, strict=True)
        ]

    def _launch_prefill(self, chunk: PrefillChunk, hidden: torch.Tensor | None = None) -> _Launched:
        """One prompt chunk; `hidden` [1, T, H]: its target hidden states when a packed forward computed them."""
        request, start, length = chunk.request, chunk.start, chunk.length
        if hidden is None:
            batch = self.runner.batch(StepKind.PREFILL, [request], [request.prompt[start : start + length]], [start])
            hidden = self.runner.prefill(batch)
        speculative = request.spec is not None and (chunk.drafts or not chunk.last)
        scored = request.prompt[start + 1 : start + length + 1]  # the prompt tokens this chunk's logits predict
        n_prompt = request.params.prompt_logprobs
        prompt_parts = []
        if n_prompt is not None and scored:
            prompt_parts = list(self.runner.prompt_logprobs(hidden, scored, n_prompt))

        def prompt_logprobs(values: list[list]) -> list[TokenLogprob] | None:
            return _token_logprobs(scored, *values, n_prompt) if prompt_parts else None

        if not chunk.last:
            if speculative:
                self.speculator.prefill_chunk(request, start, hidden, None)
            return _Launched(
                [request], prompt_parts,
                lambda values: [Outcome(request, computed=length, prompt_logprobs=prompt_logprobs(values))],
            )  # fmt: skip
        stops = set(request.params.stop_token_ids) | (set() if request.params.ignore_eos else self.eos_ids)
        first, logprobs = self.runner.choose(hidden[:, -1], request, start + length, stops)  # the first output token
        parts = [first]
        if speculative:
            parts.append(self.speculator.prefill_chunk(request, start, hidden, first))  # drafts [1, K]
        logprob_parts = list(logprobs) if logprobs is not None else []

        def outcomes(values: list[list]) -> list[Outcome]:
            tokens, rest = values[0], values[1 + speculative :]
            chosen = _token_logprobs(tokens, *rest[:3], request.params.logprobs) if logprob_parts else None
            return [
                Outcome(
                    request, length, tokens, drafts=values[1] if speculative else None, logprobs=chosen,
                    prompt_logprobs=prompt_logprobs(rest[len(logprob_parts) :]),
                )
            ]  # fmt: skip

        return _Launched([request], parts + logprob_parts + prompt_parts, outcomes)

    # ---- prefix caching (cache/prefix.py) ---------------------------------------------------------------------
    def _restore_prefixes(self, restores: list[tuple[Request, int]]) -> None:
        """Admitted prefix hits: their rows start from the cached GDN state, before their first chunk runs."""
        for request, slot in restores:
            self.snapshots.restore(slot, self.states.rows[request.id])

    def _save_snapshots(self, chunks: list[PrefillChunk], launched: list[_Launched]) -> None:
        """Copy the GDN state after each launched full chunk that was given a slot (the row is at the chunk's
        end until the request's next step)."""
        for chunk, item in zip(chunks, launched, strict=False):  # the prefill parts come first, in order
            if chunk.snapshot is not None and item.error is None:
                self.snapshots.save(self.states.rows[chunk.request.id], chunk.snapshot)

    def _cache_chunks(self, chunks: list[PrefillChunk], outcomes: list[Outcome]) -> None:
        """Index the full chunks that ran without error (before `apply`, which may release their pages)."""
        succeeded = {o.request.id: o for o in outcomes if o.error is None and not o.request.done}
        page = self.pages.page_size
        for chunk in chunks:
            request, end = chunk.request, chunk.start + chunk.length
            outcome = succeeded.get(request.id)
            if outcome is None or chunk.length != self.scheduler.prefill_chunk:
                self.prefix.discard(chunk.snapshot)
                continue
            pages = self.pages.tables[request.id][chunk.start // page : end // page]
            tokens = tuple(request.prompt[chunk.start : end])
            self.prefix.add(request.id, tokens, pages, chunk.snapshot, self._mtp_next(chunk, outcome))

    @staticmethod
    def _mtp_next(chunk: PrefillChunk, outcome: Outcome) -> int | None:
        """The token after `chunk` that its MTP KV entries were computed with (see `_launch_prefill`): the next
        prompt token, or the first output token after the prompt's last chunk; None when the MTP head did not
        run over the chunk."""
        if chunk.request.spec is None or (chunk.last and not chunk.drafts):
            return None
        return outcome.tokens[0] if chunk.last else chunk.request.prompt[chunk.start + chunk.length]

    def _output_fill(self, request: Request) -> Request | None:
        """For a request that ends with output: a cache fill that prefills its full chunks past those it cached
        (prompt + output), so the next turn of a conversation restores them. Decode computed those positions
        token by token, not as a prefill chunk would, so their KV and state cannot be cached as they are."""
        if self.prefix is None or not self.cache_outputs or request.fill_end is not None:
            return None
        if request.finish_reason == "error" or request.num_output == 0:
            return None
        chunk = self.scheduler.prefill_chunk
        end = (len(request.tokens) - 1) // chunk * chunk  # the token after `end` must be known (the MTP KV)
        if end <= self.prefix.held_length(request.id):
            return None
        tokens = request.tokens[: end + 1]
        if self.prefix.lookup(tokens, request.spec is not None).length >= end:
            return None
        fill = Request(next(self._ids), tokens, SamplingParams(max_new_tokens=1, ignore_eos=True))
        fill.fill_end = end
        if request.spec is not None:
            self.speculator.start(fill)
        return fill

    def _end_fills(self) -> None:
        for request in [r for r in self.scheduler.running if r.fill_end is not None]:
            if request.num_computed >= request.fill_end and not request.done:
                self.updater.finish(request, "length")

    def clear_prefix_cache(self) -> int:
        """Evict every cached prefix that no running request holds (their pages and snapshot slots return to
        the pools); returns how many chunks were evicted. 0 without prefix caching."""
        if self.prefix is None:
            return 0
        with self._lock:
            return self.prefix.clear()

    def _launch_decode(self, requests: list[Request], ahead: torch.Tensor | None = None) -> _Launched:
        """Plain decode: one token per request; `ahead` (a lookahead step): the tokens [B, 1] the step in flight
        chose, on the device, fed at the position after it."""
        if ahead is None:
            batch = self.runner.batch(
                StepKind.DECODE,
                requests,
                [[r.tokens[r.num_computed]] for r in requests],
                [r.num_computed for r in requests],
            )
        else:
            batch = self.runner.batch(StepKind.DECODE, requests, ahead, [r.num_computed + 1 for r in requests])
        _, chosen, logprobs = self.runner.decode(batch)
        self.runner.count_emitted(batch, chosen)
        logprob_parts = list(logprobs) if logprobs is not None else []

        def outcomes(values: list[list]) -> list[Outcome]:
            result = []
            for b, (r, token) in enumerate(zip(requests, values[0], strict=True)):
                entries = _token_logprobs([token], *values[1:], r.params.logprobs, rows=[b]) if logprob_parts else None
                result.append(Outcome(r, 1, [token], logprobs=entries))
            return result

        return _Launched(requests, [chosen] + logprob_parts, outcomes)

    def _launch_verify(self, requests: list[Request], after: Ahead | None = None) -> _Launched:
        """MTP: verify, accept, commit and draft on the device; the host reads j, the chosen tokens and the
        next drafts with the rest of the step. `after` (a lookahead verify): the verify in flight, which this one
        continues from on the device, at its K."""
        # mtp.k, or the K policy's choice for this step (a chained one: the K of the one in flight, as it chose)
        k = self.speculator.step_k(len(requests)) if after is None else after.verified.k
        with self.timer("verify"):
            verified = self.speculator.verify(requests, k, after)
        with self.timer("draft"):
            drafts = self.speculator.propose(requests, verified)

        logprob_parts = list(verified.logprobs) if verified.logprobs is not None else []

        def outcomes(values: list[list]) -> list[Outcome]:
            accepted, chosen, proposed = values[:3]
            result = []
            for b, (request, j) in enumerate(zip(requests, accepted, strict=True)):
                rows = list(range(b * (k + 1), b * (k + 1) + j + 1))
                emitted = [chosen[i] for i in rows]
                entries = None
                if logprob_parts:
                    entries = _token_logprobs(emitted, *values[3:], request.params.logprobs, rows=rows)
                drafts = proposed[b * k : (b + 1) * k]
                result.append(
                    Outcome(request, j + 1, emitted, entries, drafts=drafts, accepted=j, drafted=verified.drafted[b])
                )
            return result

        parts = [verified.accepted, verified.chosen, drafts] + logprob_parts
        return _Launched(requests, parts, outcomes, verified=Ahead(verified, drafts))

    # ---- whole generations -----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        ignore_eos: bool | None = None,
    ) -> list[Result]:
        """The continuation of each prompt (token ids), generated as one continuous batch (with whatever else
        runs); results in prompt order. `max_new_tokens` / `ignore_eos` override those of `params`."""
        params = self._params(params, max_new_tokens, ignore_eos)
        requests = self._submit_all(self._check_prompts(prompts, params), params)
        try:
            self._run_until_done(requests)
        finally:
            self._abandon([r for r in requests if not r.done])  # interrupted, or a step failed as a whole
        return [self.result(r.id) for r in requests]

    def stream(
        self,
        prompts: Any,
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        ignore_eos: bool | None = None,
    ) -> Iterator[Update]:
        """Submit the prompts and yield their updates as they come (other requests keep running too). Closing
        or dropping the iterator before the end cancels the requests still running."""
        params = self._params(params, max_new_tokens, ignore_eos)
        return self._stream(self._check_prompts(prompts, params), params)

    def _stream(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[Update]:
        requests = self._submit_all(prompts, params)  # here, so a stream never started holds nothing
        sent = {r.id: 0 for r in requests}  # tokens already yielded, per request
        live = list(requests)
        try:
            while live:
                with self._lock:
                    if any(not r.done for r in live):
                        self._step()
                    updates = []
                    for r in live:
                        new = r.tokens[len(r.prompt) + sent[r.id] :]
                        if new or r.done:
                            logprobs = None if r.logprobs is None else r.logprobs[sent[r.id] :]
                            sent[r.id] += len(new)
                            updates.append(Update(r.id, new, r.done, r.finish_reason, logprobs))
                    live = [r for r in live if not r.done]
                yield from updates
        finally:
            self._abandon(requests)

    def _check_prompts(self, prompts: Any, params: SamplingParams) -> list[list[int]]:
        """A list of prompts as token-id lists, every one checked before any is queued."""
        if isinstance(prompts, torch.Tensor) or type(prompts).__name__ == "ndarray":
            if prompts.ndim != 2:
                raise RequestError(f"prompts as one array must be 2-D [prompts, tokens], got {prompts.ndim}-D")
            prompts = list(prompts)
        if not isinstance(prompts, list | tuple):
            raise RequestError(f"prompts must be a list of prompts (each a list of token ids), got {prompts!r:.60}")
        if prompts and is_token_id(prompts[0]):
            raise RequestError(
                f"prompts must be a list of prompts, each a list of token ids; got a flat list ({prompts!r:.60}): "
                "wrap one prompt as [[...]]"
            )
        checked = [as_token_ids(p) for p in prompts]
        for prompt in checked:
            self.check_request(prompt, params)
        return checked

    def _submit_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        oracles: list[list[int] | None] = [None] * len(prompts)
        seeded = [self._seeded(params) for _ in prompts]
        if self.speculator is not None and self.speculator.oracle:
            # Oracle drafts replay each request's plain-decoding continuation (with its seed): compute it first,
            # without MTP.
            plain = [self._submit(p, s, speculate=False) for p, s in zip(prompts, seeded, strict=True)]
            try:
                self._run_until_done(plain)
            finally:
                self._abandon(plain)
            oracles = [r.output for r in plain]
        return [self._submit(p, s, oracle=o) for p, s, o in zip(prompts, seeded, oracles, strict=True)]

    def _run_until_done(self, requests: list[Request]) -> None:
        while True:
            with self._lock:
                if all(r.done for r in requests):
                    return
                self._step()

    def _abandon(self, requests: list[Request]) -> None:
        """Cancel whichever of `requests` still run and forget them all: nobody will read their results."""
        for request in requests:
            self._cancel(request)
            self.requests.pop(request.id, None)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "total_pages": self.pages.num_pages,
            "free_pages": self.pages.free_pages,
            "total_state_rows": self.states.num_rows,
            "free_state_rows": self.states.free_rows,
            "running": sum(r.fill_end is None for r in self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + self._submitted.qsize(),
        }
        if self.prefix is not None:
            counts = self.prefix.stats
            fills = len(self.scheduler.fills) + sum(r.fill_end is not None for r in self.scheduler.running)
            stats.update(
                prefix_lookups=counts.lookups,
                prefix_hits=counts.hits,
                prefix_tokens_saved=counts.tokens_saved,
                prefix_evictions=counts.evictions,
                prefix_cached_chunks=self.prefix.num_nodes,
                prefix_cached_pages=self.prefix.cached_pages,
                prefix_cached_snapshots=self.prefix.cached_snapshots,
                prefix_snapshot_slots=self.snapshots.num_slots,
                prefix_free_snapshot_slots=self.snapshots.free_slots,
                prefix_fills=fills,
            )
        if self.speculator is not None:
            totals = self.speculator.totals
            stats.update(
                verify_steps=totals.verify_steps,
                drafted=totals.drafted,
                accepted=totals.accepted,
                acceptance_length=totals.acceptance_length,
                position_acceptance=totals.position_acceptance,
                step_k=self.speculator.last_k,
            )
            if self.speculator.policy is not None:  # k auto's running acceptance per draft position: what it weighs
                stats["k_auto_acceptance"] = list(self.speculator.policy.acceptance.rates)
        return stats


def _token_logprobs(
    tokens: list[int], chosen: list[float], ids: list[int], values: list[float], n: int | None, rows=None
) -> list[TokenLogprob]:
    """`TokenLogprob`s of `tokens` from read-back values: `chosen` one per row, `ids` / `values` a fixed number
    per row (of which the request keeps its n); `rows` says which rows the tokens are (default: 0, 1, ...)."""
    rows = range(len(tokens)) if rows is None else rows
    width = len(ids) // len(chosen)
    return [
        TokenLogprob(token, chosen[row], tuple(zip(ids[row * width : row * width + (n or 0)],
                                                   values[row * width : row * width + (n or 0)], strict=True)))
        for token, row in zip(tokens, rows, strict=True)
    ]  # fmt: skip


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
