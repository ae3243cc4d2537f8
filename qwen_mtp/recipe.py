"""YAML recipe -> validated dataclasses. Every key has a default; unknown keys and bad values raise a
`RecipeError` that names the key (`mtp.k must be 1..4, got 7`)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from qwen_mtp.dtypes import DtypeName, StateDtypeName
from qwen_mtp.errors import RecipeError

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class ModelSection:
    path: str | None = None  # a Hugging Face checkpoint directory
    fixture: str | None = None  # or a tiny built-in preset ("tiny", ...), built on first use
    synthetic: str | None = None  # or random weights at real shapes on the device ("qwen3.5-27b", ...)
    seed: int = 0  # fixture / synthetic weights' seed
    dtype: DtypeName = "bfloat16"
    quant: Literal["none", "fp8-block"] = "none"
    fp8_decode: Literal["w8a8", "w8a16"] = "w8a8"  # FP8 projections on the CUDA decode path (docs/fp8.md)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (checked in _validate)


@dataclass
class ParallelSection:
    tp: int = 1  # tensor-parallel degree: ranks, one per GPU (docs/parallel.md)
    timeout_s: float = 300.0  # how long a rank waits in a collective before it gives up (a peer died or hangs)


@dataclass
class MTPSection:
    enabled: bool = False
    k: int | Literal["auto"] = 2  # drafts per step; "auto": chosen per step, 0..max_k (engine/k_policy.py)
    max_k: int = 4  # with k: auto, the most drafts a step may verify
    draft: Literal["head", "oracle"] = "head"
    oracle_accept: float = 1.0
    coupled_drafts: bool = True  # sampled requests: drafts use the target's noise (false: greedy drafts)
    draft_vocab: int = 0  # > 0: the head drafts from the N most frequent tokens only (docs/mtp.md); 0: all
    draft_vocab_file: str | None = None  # token counts (`qwen-mtp draft-vocab` writes them), or "first": ids 0..N-1
    draft_lm_head: Literal["bf16", "fp8"] = "bf16"  # fp8: drafts score an FP8 copy of the lm_head (docs/mtp.md)

    @property
    def max_drafts(self) -> int:
        """The most drafts any step verifies: what the state pool and page reservations are sized for."""
        return self.max_k if self.k == "auto" else self.k


@dataclass
class StateSection:
    dtype: StateDtypeName = "float32"  # recurrent (SSM) state precision


@dataclass
class CacheSection:
    page_size: int = 64
    max_batch: int = 8
    memory_fraction: float = 0.9
    num_pages: int | None = None
    num_state_rows: int | None = None
    prefill_chunk: int = 512
    prefix_caching: bool = False  # share full prefill chunks' KV pages + GDN state snapshots across requests
    prefix_snapshots: int | None = None  # GDN state snapshot slots; None: sized from the pools (sizing.py)
    prefix_cache_outputs: bool = True  # with prefix_caching: also cache a finished request's output chunks
    # Mixed steps (docs/mixed-steps.md): a step's prefill chunks of several requests run as one packed forward,
    # next to the decode/verify rows, under `max_step_tokens`. None: on on a single CUDA device, off on CPU and
    # with tensor parallelism (docs/recipes.md says why)
    mixed_steps: bool | None = None
    # with mixed_steps: decode/verify rows + prefill chunk tokens per step; None: DEFAULT_STEP_TOKENS, or more where a
    # step must hold max_batch decode rows of K+1 tokens and one full chunk (an explicit value below that is an error)
    max_step_tokens: int | None = None
    # Decode and fixed-K verify steps: launch the next step before reading this one's results back, so the host's
    # work between steps runs while the GPU computes (docs/architecture.md "Lookahead"; H200, 27B B1: 14.76 -> 13.93
    # ms a token).
    lookahead: bool = True


@dataclass
class CompileSection:
    enabled: bool = False  # torch.compile(fullgraph=True) the decode, verify and draft steps
    cuda_graphs: bool | None = None  # capture them in CUDA graphs, one per batch bucket; None: on when on CUDA
    batch_sizes: list[int] = field(default_factory=list)  # buckets; empty: 1, 2, 4, ... up to cache.max_batch
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # aot_eager / eager: for debugging
    prefill: bool = False  # with `enabled`: also compile prefill chunks (any length, no CUDA graphs)
    # full prefill chunks (cache.prefill_chunk tokens of one request) replayed from CUDA graphs; None: on where
    # the decode steps are graphed (cuda_graphs), unless compile.prefill or parallel.tp > 1 (which it excludes)
    prefill_graphs: bool | None = None


@dataclass
class RunSection:
    prompts: list[str | list[int]] = field(default_factory=lambda: ["Hello world"])
    max_new_tokens: int = 32
    ignore_eos: bool = False


@dataclass
class BenchSection:
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    ks: list[int | Literal["auto"]] = field(default_factory=lambda: [1, 2, 3, 4])  # "auto": mtp.k auto, max_k
    draft_vocabs: list[int] = field(default_factory=lambda: [0])  # MTP rows per draft vocabulary (0: the whole)
    # MTP rows per draft lm_head (mtp.draft_lm_head, docs/mtp.md); empty: the recipe's mtp.draft_lm_head only
    draft_lm_heads: list[Literal["bf16", "fp8"]] = field(default_factory=list)
    accept_rates: list[float] = field(default_factory=lambda: [1.0, 0.8, 0.6])
    head: bool = True  # also run the real MTP head's drafts
    prompt_len: int | list[int] = 128  # several: a sweep over context lengths
    # a prompt prefills in one chunk up to this length, in chunks of it beyond (a 128k chunk's MLP activation
    # alone is 4.6e9 elements); TTFT then counts every chunk's step
    max_prefill_chunk: int = 32768
    output_len: int = 128
    out_dir: str = "bench-results"
    temperature: float = 0.0  # > 0: every row samples (prompt i seeded with i), to compare step cost with greedy
    top_p: float = 1.0  # with temperature: top-p (< 1 adds the per-row sort)
    # != neutral: every row has these penalties (`SamplingParams`), to compare a penalized step's cost
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0

    @property
    def prompt_lens(self) -> list[int]:
        """`prompt_len` as a list: the context lengths the bench sweeps."""
        return self.prompt_len if isinstance(self.prompt_len, list) else [self.prompt_len]


@dataclass
class TrainSection:
    """`qwen-mtp train`: corpus, tokenizer, model shape, optimisation, output (docs/training.md)."""

    mode: Literal["joint", "target", "mtp-head"] = "joint"  # what trains (docs/training.md: modes)
    init: str | None = None  # start from this checkpoint (its shape and tokenizer); None: from scratch
    corpus: str = "stdlib"  # "stdlib" (this interpreter's standard library) or a directory of text files
    include: list[str] = field(default_factory=lambda: ["**/*.py"])  # globs under the corpus root
    exclude: list[str] = field(default_factory=list)
    vocab_size: int = 4096  # byte-level BPE trained on the train split
    hidden_size: int = 256
    num_layers: int = 8
    full_attention_interval: int = 4  # every 4th layer attention, the rest Gated DeltaNet
    intermediate_size: int = 640
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_key_heads: int = 2
    gdn_value_heads: int = 4
    gdn_head_dim: int = 64
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 1000
    time_budget_s: float | None = None  # fewer steps if the measured speed would overrun this (wall clock)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.5  # joint loss = next-token CE + mtp_weight * MTP CE (mean over the draft steps)
    mtp_chain: int = 1  # MTP draft steps trained: 1 = on the target's hidden states; more = chained (docs)
    seed: int = 0
    output_dir: str = "train-out"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Literal["bf16", "fp32"] = "bf16"  # bf16: the model in bf16 with fp32 master weights
    compile: bool = False  # torch.compile the loss (forward + backward)
    log_every: int = 10
    save_every: int = 250  # steps between resume points (and at the end)
    eval_tokens: int = 131072  # held-out tokens for the perplexity at the end
    eval_every: int = 0  # steps between held-out losses in the log (0: only at the end)
    save_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the checkpoint's tensors


@dataclass
class ServerSection:
    """`qwen-mtp serve`: where it listens and the limits it puts on clients (docs/serving.md)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "qwen-mtp"  # the `model` clients name; /v1/models lists it
    max_queue: int = 64  # requests waiting beyond the cache.max_batch that run; past it, 429
    request_timeout_s: float | None = 600.0  # from arrival; past it the request ends with finish_reason "timeout"
    shutdown_grace_s: float = 30.0  # on SIGTERM: how long running requests may finish before they are cancelled
    default_max_tokens: int = 256  # max_tokens of a request that gives none
    # "qwen3": a chat answer's thinking (before `</think>`) as `reasoning_content`, apart from `content`
    reasoning_parser: Literal["qwen3"] | None = None
    # "qwen3_coder": tool calls in a chat answer (Qwen3.5's XML format) as OpenAI `tool_calls`; needed for `tools`
    tool_call_parser: Literal["qwen3_coder"] | None = None
    # sampling fields a request leaves out take the checkpoint's generation_config.json values (vLLM's default)
    generation_defaults: bool = True
    api_key: str | None = None  # set: every /v1 request needs `Authorization: Bearer <api_key>` (else 401)


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    mtp: MTPSection = field(default_factory=MTPSection)
    state: StateSection = field(default_factory=StateSection)
    cache: CacheSection = field(default_factory=CacheSection)
    compile: CompileSection = field(default_factory=CompileSection)
    run: RunSection = field(default_factory=RunSection)
    bench: BenchSection = field(default_factory=BenchSection)
    train: TrainSection = field(default_factory=TrainSection)
    server: ServerSection = field(default_factory=ServerSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_recipe(source: str | Path | dict[str, Any] | None = None, overrides: typing.Iterable[str] = ()) -> Recipe:
    """Read a recipe from a YAML file, a dict, or nothing (all defaults), then apply `key.sub=value`
    overrides (values parsed as YAML, so `mtp.k=4` is an int and `mtp.enabled=true` a bool)."""
    if source is None:
        raw: dict[str, Any] = {}
    elif isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise RecipeError(f"recipe file {path} not found") from None
        except IsADirectoryError:
            raise RecipeError(f"recipe {path} is a directory: give a YAML file (see recipes/)") from None
        except UnicodeDecodeError as err:
            raise RecipeError(f"recipe file {path} is not UTF-8 text: {err}") from None
        except OSError as err:
            raise RecipeError(f"cannot read recipe file {path}: {err}") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe file {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError("a recipe must be a mapping of sections (model, mtp, cache, ...)")
    raw = {section: dict(values) if isinstance(values, dict) else values for section, values in raw.items()}
    for item in overrides:
        _apply_override(raw, item)
    recipe = _build(Recipe, raw, "")
    _validate(recipe, trains="train" in raw)
    return recipe


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise RecipeError(f"--set expects section.key=value (e.g. mtp.k=4), got {item!r}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"--set {key}: cannot parse value {text!r}: {err}") from None
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise RecipeError(f"{parts[0]} must be a mapping")
    section[parts[1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "recipe"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names, key=str)  # YAML keys may be numbers too
    if unknown:
        raise RecipeError(f"unknown key {prefix}{unknown[0]} (known in {where}: {', '.join(sorted(names))})")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _check_type(value, hint, f"{prefix}{name}")
    return cls(**values)


def _check_type(value: Any, hint: Any, key: str) -> Any:
    if _matches(value, hint):
        return float(value) if hint is float else value
    raise RecipeError(f"{key} must be {_describe(hint)}, got {value!r}")


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(allowed) and value == allowed for allowed in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        *first, last = [str(allowed) for allowed in typing.get_args(hint)]
        return f"one of {', '.join(first)} or {last}" if len(first) > 1 else " or ".join([*first, last])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, str(hint)
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RecipeError(message)


def _validate(r: Recipe, trains: bool = False) -> None:
    """`trains`: the recipe has a `train` section, whose model comes from `train` (a model section is optional)."""
    m = r.model
    sources = [key for key in ("path", "fixture", "synthetic") if getattr(m, key) is not None]
    _require(
        len(sources) == 1 or (trains and not sources),
        "model: set exactly one of model.path, model.fixture or model.synthetic",
    )
    if m.fixture is not None:
        from qwen_mtp.testing import PRESETS

        _require(m.fixture in PRESETS, f"model.fixture must be one of {sorted(PRESETS)}, got {m.fixture!r}")
    if m.synthetic is not None:
        from qwen_mtp.testing.synthetic import SYNTHETIC

        _require(m.synthetic in SYNTHETIC, f"model.synthetic must be one of {sorted(SYNTHETIC)}, got {m.synthetic!r}")
    _require(
        DEVICE.fullmatch(m.device) is not None,
        f"model.device must be auto, cpu, cuda or cuda:N (N a GPU index: 0, 1, ...), got {m.device!r}",
    )
    _require(r.parallel.tp >= 1, f"parallel.tp must be >= 1, got {r.parallel.tp}")
    _require(r.parallel.timeout_s > 0, f"parallel.timeout_s must be > 0, got {r.parallel.timeout_s}")
    _require(r.mtp.k == "auto" or 1 <= r.mtp.k <= 4, f"mtp.k must be 1..4 or auto, got {r.mtp.k}")
    _require(1 <= r.mtp.max_k <= 4, f"mtp.max_k must be 1..4, got {r.mtp.max_k}")
    _require(r.mtp.draft_vocab >= 0, f"mtp.draft_vocab must be >= 0 (0: the whole vocabulary), got {r.mtp.draft_vocab}")
    _require(
        r.mtp.draft_vocab == 0 or r.mtp.draft_vocab_file is not None,
        "mtp.draft_vocab needs mtp.draft_vocab_file: a token-count file (`qwen-mtp draft-vocab` writes one), "
        "or 'first' for the first N ids (synthetic models)",
    )
    _require(0.0 <= r.mtp.oracle_accept <= 1.0, f"mtp.oracle_accept must be in 0..1, got {r.mtp.oracle_accept}")
    c = r.cache
    for key in ("page_size", "max_batch", "prefill_chunk", "num_pages", "num_state_rows", "max_step_tokens"):
        value = getattr(c, key)
        _require(value is None or value >= 1, f"cache.{key} must be >= 1, got {value}")
    _require(c.prefix_snapshots is None or c.prefix_snapshots >= 1, "cache.prefix_snapshots must be >= 1")
    _require(
        not c.prefix_caching or c.prefill_chunk % c.page_size == 0,
        f"cache.prefix_caching shares whole pages of full prefill chunks: cache.prefill_chunk ({c.prefill_chunk}) "
        f"must be a multiple of cache.page_size ({c.page_size})",
    )
    _require(0.0 < c.memory_fraction <= 1.0, f"cache.memory_fraction must be in (0, 1], got {c.memory_fraction}")
    _require(
        all(b >= 1 for b in r.compile.batch_sizes), f"compile.batch_sizes must be positive, got {r.compile.batch_sizes}"
    )
    _require(not r.compile.prefill or r.compile.enabled, "compile.prefill needs compile.enabled: true")
    _require(
        not (r.compile.prefill_graphs and r.compile.prefill),
        "compile.prefill_graphs and compile.prefill exclude each other: full chunks run either in CUDA graphs of "
        "the eager kernels or through torch.compile",
    )
    b = r.bench
    _require(all(n >= 1 for n in b.batch_sizes) and b.batch_sizes, "bench.batch_sizes must be positive integers")
    _require(all(k == "auto" or 1 <= k <= 4 for k in b.ks), f"bench.ks must be in 1..4 or auto, got {b.ks}")
    _require(all(n >= 0 for n in b.draft_vocabs), f"bench.draft_vocabs must be >= 0, got {b.draft_vocabs}")
    _require(
        all(n == 0 for n in b.draft_vocabs) or r.mtp.draft_vocab_file is not None,
        "bench.draft_vocabs > 0 needs mtp.draft_vocab_file (a count file, or 'first' for the first N ids)",
    )
    _require(all(0.0 <= a <= 1.0 for a in b.accept_rates), f"bench.accept_rates must be in 0..1, got {b.accept_rates}")
    _require(
        all(n >= 1 for n in b.prompt_lens) and b.prompt_lens and b.output_len >= 2,
        "bench.prompt_len must be >= 1 (or a non-empty list of such) and bench.output_len >= 2",
    )
    _validate_train(r.train)
    s = r.server
    _require(0 <= s.port <= 65535, f"server.port must be in 0..65535 (0: any free port), got {s.port}")
    _require(bool(s.model_name), "server.model_name must not be empty")
    _require(s.max_queue >= 0, f"server.max_queue must be >= 0, got {s.max_queue}")
    _require(
        s.request_timeout_s is None or s.request_timeout_s > 0,
        f"server.request_timeout_s must be > 0 or null (no timeout), got {s.request_timeout_s}",
    )
    _require(s.shutdown_grace_s >= 0, f"server.shutdown_grace_s must be >= 0, got {s.shutdown_grace_s}")
    _require(s.default_max_tokens >= 1, f"server.default_max_tokens must be >= 1, got {s.default_max_tokens}")
    _require(r.run.max_new_tokens >= 1, f"run.max_new_tokens must be >= 1, got {r.run.max_new_tokens}")
    for i, prompt in enumerate(r.run.prompts):
        _require(
            isinstance(prompt, str) or all(t >= 0 for t in prompt),
            f"run.prompts[{i}]: token ids must be >= 0",
        )


def _validate_train(t: TrainSection) -> None:
    positive = (
        "vocab_size", "hidden_size", "num_layers", "full_attention_interval", "intermediate_size",
        "attention_heads", "kv_heads", "head_dim", "gdn_key_heads", "gdn_value_heads", "gdn_head_dim",
        "seq_len", "batch_size", "steps", "log_every", "save_every", "eval_tokens",
    )  # fmt: skip
    for key in positive:
        _require(getattr(t, key) >= 1, f"train.{key} must be >= 1, got {getattr(t, key)}")
    _require(t.vocab_size >= 300, f"train.vocab_size must be >= 300 (256 bytes + special tokens), got {t.vocab_size}")
    _require(t.seq_len >= 2, f"train.seq_len must be >= 2, got {t.seq_len}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: off), got {t.eval_every}")
    _require(
        t.attention_heads % t.kv_heads == 0,
        f"train.attention_heads ({t.attention_heads}) must be a multiple of train.kv_heads ({t.kv_heads})",
    )
    _require(
        t.gdn_value_heads % t.gdn_key_heads == 0,
        f"train.gdn_value_heads ({t.gdn_value_heads}) must be a multiple of train.gdn_key_heads ({t.gdn_key_heads})",
    )
    _require(
        t.head_dim % 8 == 0, f"train.head_dim must be a multiple of 8 (partial RoPE on a quarter), got {t.head_dim}"
    )
    for key in ("lr", "grad_clip"):
        _require(getattr(t, key) > 0, f"train.{key} must be > 0, got {getattr(t, key)}")
    _require(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in 0..1, got {t.min_lr_ratio}")
    _require(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _require(t.mtp_weight >= 0, f"train.mtp_weight must be >= 0, got {t.mtp_weight}")
    _require(1 <= t.mtp_chain <= 4, f"train.mtp_chain must be 1..4 (draft steps trained), got {t.mtp_chain}")
    _require(
        t.time_budget_s is None or t.time_budget_s > 0,
        f"train.time_budget_s must be > 0 or null, got {t.time_budget_s}",
    )
    _require(
        DEVICE.fullmatch(t.device) is not None,
        f"train.device must be auto, cpu, cuda or cuda:N (N a GPU index: 0, 1, ...), got {t.device!r}",
    )
    _require(bool(t.include), "train.include must list at least one glob (e.g. '**/*.py')")
    _require(bool(t.output_dir), "train.output_dir must be a directory path")
