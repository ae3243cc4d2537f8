"""Static-shape execution of the decode-path steps: batch buckets, static input buffers, `torch.compile`, and
one CUDA graph per (step, bucket, tokens per request, sampler mode); with `mtp.k: auto` that is one target and
one draft graph per (bucket, K).

A step over b requests runs in the smallest bucket B >= b (`compile.batch_sizes`). Its inputs are copied into
buffers at fixed addresses; rows b..B-1 are padding that points at the pools' scratch state row and scratch
page, so they never touch a request's state, and since every kernel on this path computes a row on its own
(batch-invariant), they never change a real row's numbers either. A graph is captured the first time its
shape is needed (or ahead of time by `Engine.warmup`): two eager warm-up runs on padding only (Triton JIT,
`torch.compile`), then the capture; without capture, one warm-up run, which compiles. Replaying a graph costs
a few microseconds of CPU instead of thousands of kernel launches from Python. A step whose requests sample (or
report logprobs) runs the graph of its `sampling.Mode`, with the per-request sampler inputs in static buffers too
(padding rows greedy); all-greedy steps run the greedy graphs, which contain no sampler at all.

Every request that decodes under graphs must always decode under the same ones: a request that ran some steps
eagerly and some compiled could round differently than in a run that did not. So the engine refuses a
`cache.max_batch` larger than the largest bucket instead of falling back to eager for big batches.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from qwen_mtp.cache.kv import pages_for
from qwen_mtp.engine.grammar import mask_words
from qwen_mtp.engine.sampling import GREEDY, Mode, padding_rows
from qwen_mtp.engine.steps import DecodeSteps, PrefillSteps
from qwen_mtp.errors import RecipeError


def bucket_sizes(requested: list[int], max_batch: int) -> list[int]:
    """`compile.batch_sizes`, or by default powers of two up to `cache.max_batch` (and max_batch itself)."""
    if requested:
        return sorted(set(requested))
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(min(2 * sizes[-1], max_batch))
    return sizes


class StaticStep:
    """One step function at one bucket shape: its static inputs (padding by default), and its captured graph
    and outputs (or, without capture, a direct call on the static inputs)."""

    def __init__(self, fn: Callable, padding: dict[str, torch.Tensor], capture: bool, pool=None):
        self.fn, self.padding = fn, padding
        self.inputs = {name: value.clone() for name, value in padding.items()}
        self.graph = None
        if capture:
            # Warm-up on padding rows only (they write nothing but scratch): Triton JIT and torch.compile run
            # here, outside the capture. Two runs, as torch.compile may specialise on the second call.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    warm = fn(**self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            # The outputs live outside the shared graph pool, in copies the graph writes at its end. In the pool
            # they could sit where a graph captured earlier keeps its temporaries, and replaying that graph
            # (the draft after the verify) would overwrite them before the host reads them back.
            self.outputs = static_copies(warm)
            del warm
            self.graph = torch.cuda.CUDAGraph()
            with no_collection(), torch.cuda.graph(self.graph, pool=pool):
                copy_outputs(self.outputs, fn(**self.inputs))
        else:
            fn(**self.inputs)  # torch.compile compiles on the first call: now, on padding rows only

    def __call__(self, count: int, **values: torch.Tensor):
        """Run on the first `count` rows = `values`; the other rows are reset to padding. The outputs are the
        full bucket's and are overwritten by the next call."""
        for name, value in values.items():
            buffer = self.inputs[name]
            if value.dim() > 1:
                buffer[:count, : value.shape[1]].copy_(value)  # page tables may be narrower than the buffer
            else:
                buffer[:count].copy_(value)
            if count < buffer.shape[0]:
                buffer[count:].copy_(self.padding[name][count:])
        if self.graph is None:
            return self.fn(**self.inputs)
        self.graph.replay()
        return self.outputs


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it).

    Why, around a capture: an engine that was dropped lives on in reference cycles until the collector runs, and
    the collector runs when allocations make it (torch no longer collects before a capture). Run inside a capture,
    it destroys that engine's CUDA graphs, which CUDA refuses while a stream captures ("operation not permitted
    when stream is capturing"): the capture fails, and so does the step that asked for it (seen on the H200: a
    test's second engine, its requests ended after one token). Outside the capture the same destruction is fine."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def scratch_inputs(pages, states, size: int, length: int, width: int) -> dict[str, torch.Tensor]:
    """A static step's padding: `size` rows of `length` tokens on the pools' scratch state row and scratch page
    (page tables `width` wide, or as wide as `length` tokens need), which no request owns, so a padded row or a
    warm-up run touches nothing else. The table covers every padded position even where the pool holds fewer
    tokens than a step (`qwen-mtp bench` sizes its pool to the batch, under one prefill chunk): otherwise the
    attention looks up page indices past the table's end."""
    device = pages.storage.device
    width = max(width, pages_for(length, pages.page_size))
    return {
        "tokens": torch.zeros(size, length, dtype=torch.long, device=device),
        "positions": torch.zeros(size, length, dtype=torch.long, device=device),
        "rows": torch.full((size,), states.scratch_row, dtype=torch.long, device=device),
        "tables": torch.full((size, width), pages.scratch_page, dtype=torch.int32, device=device),
        "lens": torch.full((size,), length, dtype=torch.int32, device=device),
    }


def static_copies(outputs):
    """A step's outputs (tensors, tuples of them, None) with each tensor cloned into memory of its own."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)


def copy_outputs(static, outputs) -> None:
    """Copy a step's `outputs` into `static_copies` of the same structure (None stays None: no logprobs)."""
    for target, value in zip(pytree.tree_leaves(static), pytree.tree_leaves(outputs), strict=True):
        if isinstance(target, torch.Tensor):
            target.copy_(value)


class StepGraphs:
    """The `DecodeSteps` functions behind batch buckets, optionally compiled and captured."""

    def __init__(
        self,
        steps: DecodeSteps,
        batch_sizes: list[int],
        table_width: int,
        compile: bool,
        capture: bool,
        backend: str = "inductor",
        log: Callable[[str], None] | None = None,
    ):
        self.steps, self.buckets, self.width = steps, sorted(set(batch_sizes)), table_width
        self.capture, self.log = capture, log or (lambda _: None)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.compiled = compile
        if compile:
            self.target_fn = compile_step(steps.target, backend)
            self.draft_fn = compile_step(steps.draft, backend)
        else:
            self.target_fn, self.draft_fn = steps.target, steps.draft
        self._steps: dict[tuple[str, int, int], StaticStep] = {}

    def bucket(self, count: int) -> int:
        for size in self.buckets:
            if size >= count:
                return size
        raise RecipeError(f"a decode batch of {count} exceeds the largest compile.batch_sizes ({self.buckets[-1]})")

    def _get(self, kind: str, size: int, length: int, mode: Mode = GREEDY) -> StaticStep:
        key = (kind, size, length) if mode.greedy else (kind, size, length, mode)
        if key not in self._steps:
            started = time.perf_counter()
            what = "compiling" + (" and capturing" if self.capture else "") if self.compiled else "capturing"
            sampler = "" if mode.greedy else f" ({mode})"
            self.log(f"{what} the {kind} step for batch {size} x {length} tokens{sampler} ...")
            padding = scratch_inputs(self.steps.pages, self.steps.states, size, length, self.width)
            words = mask_words(self.steps.model.config.vocab_size)  # structured outputs' masks: the whole vocabulary
            padding |= padding_rows(size, padding["tokens"].device, mode, length, words)
            if kind == "target":
                step = StaticStep(functools.partial(self.target_fn, mode=mode), padding, self.capture, self.pool)
            else:
                k, hidden = length - 1, self.steps.model.config.hidden_size  # a K-draft chain after K+1 positions
                device, dtype = padding["tokens"].device, self.steps.model.lm_head_weight.dtype
                padding |= {
                    "hidden": torch.zeros(size, length, hidden, dtype=dtype, device=device),
                    "accepted": torch.zeros(size, dtype=torch.long, device=device),
                    "override": torch.zeros(size, k, dtype=torch.long, device=device),
                    "use_override": torch.zeros(size, k, dtype=torch.bool, device=device),
                }
                step = StaticStep(functools.partial(self.draft_fn, mode=mode), padding, self.capture, self.pool)
            self.log(f"... {kind} step for batch {size} x {length} ready in {time.perf_counter() - started:.1f} s")
            self._steps[key] = step
        return self._steps[key]

    def warmup(self, lengths: list[int], draft_lengths: list[int]) -> None:
        """Build every bucket's steps now (largest first, so smaller graphs reuse its memory pool): the target
        over each of `lengths` tokens per request, the draft after each of `draft_lengths` verified positions
        (K+1 for a K-draft chain; with `mtp.k: auto`, one per K = 0..max_k)."""
        for size in reversed(self.buckets):
            for length in lengths:
                self._get("target", size, length)
            for length in draft_lengths:
                self._get("draft", size, length)

    def target(self, tokens, positions, rows, tables, lens, mode: Mode = GREEDY, **sampling_rows):
        count, length = tokens.shape
        step = self._get("target", self.bucket(count), length, mode)
        hidden, chosen, logprobs = step(
            count, tokens=tokens, positions=positions, rows=rows, tables=tables, lens=lens, **sampling_rows
        )
        if logprobs is not None:
            logprobs = tuple(part[:count] for part in logprobs)
        return hidden[:count], chosen[:count], logprobs

    def draft(
        self, tokens, hidden, positions, rows, tables, lens, accepted, override, use_override, mode=GREEDY, **sampling
    ) -> torch.Tensor:
        count, length = tokens.shape
        step = self._get("draft", self.bucket(count), length, mode)
        drafts = step(
            count, tokens=tokens, hidden=hidden, positions=positions, rows=rows, tables=tables, lens=lens,
            accepted=accepted, override=override, use_override=use_override, **sampling,
        )  # fmt: skip
        return drafts[:count]


class ChunkGraphs:
    """Full prefill chunks (`cache.prefill_chunk` tokens of one request) in CUDA graphs (`compile.prefill_graphs`):
    the target over the chunk (one graph for a prompt's first chunk, which reads no state, one for the others), the
    same for a packed step (`cache.mixed_steps`) that holds a single full chunk, and the MTP head over its positions.

    Why: an eager 27B chunk step launches ~1,500 kernels from Python, and on the H200 machine's host that took
    longer than the GPU's work (docs/benchmark-log.md, eighteenth session). Every full chunk has the same shape, so
    one capture serves them all. A graph replays the very kernels an eager chunk launches, at the same shapes, so
    a chunk's numbers do not depend on whether it ran in a graph (the page table is padded to the widest a request
    can have: only its stride changes, and the kernels read only the pages a chunk's positions reach). Shorter
    chunks (a prompt's last) run eagerly. Without capture (CPU, `compile.cuda_graphs: false`) the same static
    inputs are used and the step functions called directly, which the CPU tests run."""

    def __init__(self, steps: PrefillSteps, length: int, table_width: int, capture: bool, log: Callable[[str], None]):
        self.steps, self.length, self.width, self.capture, self.log = steps, length, table_width, capture, log
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._steps: dict[str, StaticStep] = {}

    def fits(self, tokens: torch.Tensor, tables: torch.Tensor) -> bool:
        """Whether a chunk runs in a graph: one request, a full chunk, its page table within the padded width."""
        return tokens.shape == (1, self.length) and tables.shape[1] <= self.width

    def _get(self, kind: str) -> StaticStep:
        if kind not in self._steps:
            started = time.perf_counter()
            self.log(f"capturing the {kind} prefill step for chunks of {self.length} tokens ...")
            padding = scratch_inputs(self.steps.pages, self.steps.states, 1, self.length, self.width)
            fresh = kind.endswith("first")
            if kind == "mtp":
                model = self.steps.model
                padding["hidden"] = torch.zeros(
                    1, self.length, model.config.hidden_size, dtype=model.lm_head_weight.dtype,
                    device=padding["tokens"].device,
                )  # fmt: skip
                fn = self.steps.mtp
            elif kind.startswith("packed"):
                padding["cu_seqlens"] = torch.tensor(
                    [0, self.length], dtype=torch.int32, device=padding["tokens"].device
                )
                fn = functools.partial(self.steps.packed_alone, fresh=fresh)
            else:
                fn = functools.partial(self.steps.target, fresh=fresh)
            self._steps[kind] = StaticStep(fn, padding, self.capture, self.pool)
            self.log(f"... {kind} prefill step ready in {time.perf_counter() - started:.1f} s")
        return self._steps[kind]

    def warmup(self, mtp: bool, packed: bool) -> None:
        """Capture the target's two graphs now (the packed forward's, when `packed`: mixed steps), and the MTP
        head's when `mtp` (otherwise each at its first chunk)."""
        kinds = ("packed-first", "packed-next") if packed else ("first", "next")
        for kind in (*kinds, "mtp") if mtp else kinds:
            self._get(kind)

    def target(self, tokens, positions, rows, tables, lens, fresh: bool) -> torch.Tensor:
        """`PrefillSteps.target` on a full chunk: its post-norm hidden states [1, T, H], a copy of its own (the
        graph's outputs are overwritten by the next chunk, and the speculator keeps reading this one)."""
        step = self._get("first" if fresh else "next")
        hidden = step(1, tokens=tokens, positions=positions, rows=rows, tables=tables, lens=lens)
        return hidden.clone()

    def packed_alone(self, tokens, positions, rows, tables, lens, fresh: bool) -> torch.Tensor:
        """`PrefillSteps.packed_alone` on a full chunk: [1, T, H], a copy of its own (its `cu_seqlens` are always
        [0, T]: the static buffer's)."""
        step = self._get("packed-first" if fresh else "packed-next")
        return step(1, tokens=tokens, positions=positions, rows=rows, tables=tables, lens=lens).clone()

    def mtp(self, tokens, hidden, positions, rows, tables, lens) -> torch.Tensor:
        """`PrefillSteps.mtp` on a full chunk's positions: post-`mtp.norm` hidden [1, T, H], a copy of its own."""
        step = self._get("mtp")
        out = step(1, tokens=tokens, hidden=hidden, positions=positions, rows=rows, tables=tables, lens=lens)
        return out.clone()


def compile_step(fn: Callable, backend: str, dynamic: bool | None = False) -> Callable:
    """`torch.compile(fn, fullgraph=True)` for one whole engine step; static shapes unless `dynamic` is None
    (then only dims marked dynamic are; see `compile_chunk_step`). Inductor runs `deterministic` where it has
    the option: no on-device benchmarking picks among kernel configurations at run time (a timing-dependent
    choice of a reduction's tiling would change its summation order)."""
    from torch._inductor import config as inductor_config

    _raise_recompile_limit()
    options = None
    if backend == "inductor":
        register_inductor_fallbacks()
        if "deterministic" in inductor_config.get_config_copy():
            options = {"deterministic": True}
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend, options=options)


def compile_chunk_step(fn: Callable, backend: str, name: str, log: Callable[[str], None]) -> Callable:
    """`compile_step` for prefill chunks: one graph for every chunk length. Before each call, dim 1 of each
    tensor argument with two or more dims (the chunk length; the page table's width) is marked dynamic.

    Marked up front, never learned: with dynamo's default (specialise on the first shape, go dynamic on a
    second) a chunk would run a graph specialised to its length or the generic one depending on which lengths
    came before. Only those dims: with `dynamic=True` the pools (read as attributes) got symbolic sizes too,
    and inductor then lost the storage offset of a layer's KV view that an op mutates (on CPU, torch 2.13: the
    MTP layer's keys landed in the first attention layer's pages; on the H200, torch 2.11, MTP-on != MTP-off
    even with the pools marked static).
    A 1-token chunk (a dim of size 1) runs its own specialised graph, the same one every time. The first call
    compiles (about a minute at 27B shapes): it is logged with its duration."""
    compiled = compile_step(fn, backend, dynamic=None)
    first = True

    def run(*args):
        nonlocal first
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() >= 2 and arg.shape[1] > 1:
                torch._dynamo.mark_dynamic(arg, 1)
        if not first:
            return compiled(*args)
        first, started = False, time.perf_counter()
        log(f"compiling the {name} step for any chunk length ...")
        out = compiled(*args)
        log(f"... {name} step ready in {time.perf_counter() - started:.1f} s")
        return out

    return run


def _raise_recompile_limit() -> None:
    """One compiled shape per (bucket, tokens per request): more than dynamo's default of 8."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))


def register_inductor_fallbacks() -> None:
    """Give inductor a fallback lowering for each `qwen_mtp` op before it compiles: the op runs as is, which
    is what inductor would decide itself. Without it, torch 2.11's inductor, on first meeting a custom op,
    formats the op's arguments for an INFO log line whether or not the line is shown; their IR nests every
    earlier write to the same pool, so the text grows exponentially with the layers and the compile never
    finishes (seen on the H200; torch 2.13 formats the line lazily)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for name in torch.ops.qwen_mtp:
        op = getattr(torch.ops.qwen_mtp, name).default
        if op not in lowering.lowerings:
            # the layout rule inductor's implicit fallback would pick (the op's tag, else the default)
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, warn=False)
