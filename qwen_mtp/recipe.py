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
    device: str = "auto"  # auto | cpu | cuda | cuda:N (checked in _validate)


@dataclass
class ParallelSection:
    tp: int = 1  # tensor-parallel degree: ranks, one per GPU (docs/parallel.md)
    timeout_s: float = 300.0  # how long a rank waits in a collective before it gives up (a peer died or hangs)


@dataclass
class MTPSection:
    enabled: bool = False
    k: int = 2
    draft: Literal["head", "oracle"] = "head"
    oracle_accept: float = 1.0


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


@dataclass
class CompileSection:
    enabled: bool = False  # torch.compile(fullgraph=True) the decode, verify and draft steps
    cuda_graphs: bool | None = None  # capture them in CUDA graphs, one per batch bucket; None: on when on CUDA
    batch_sizes: list[int] = field(default_factory=list)  # buckets; empty: 1, 2, 4, ... up to cache.max_batch
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # aot_eager / eager: for debugging
    prefill: bool = False  # with `enabled`: also compile prefill chunks (any length, no CUDA graphs)


@dataclass
class RunSection:
    prompts: list[str | list[int]] = field(default_factory=lambda: ["Hello world"])
    max_new_tokens: int = 32
    ignore_eos: bool = False


@dataclass
class BenchSection:
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    accept_rates: list[float] = field(default_factory=lambda: [1.0, 0.8, 0.6])
    head: bool = True  # also run the real MTP head's drafts
    prompt_len: int | list[int] = 128  # several: a sweep over context lengths
    output_len: int = 128
    out_dir: str = "bench-results"

    @property
    def prompt_lens(self) -> list[int]:
        """`prompt_len` as a list: the context lengths the bench sweeps."""
        return self.prompt_len if isinstance(self.prompt_len, list) else [self.prompt_len]


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
    _validate(recipe)
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


def _validate(r: Recipe) -> None:
    m = r.model
    sources = [key for key in ("path", "fixture", "synthetic") if getattr(m, key) is not None]
    _require(len(sources) == 1, "model: set exactly one of model.path, model.fixture or model.synthetic")
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
    _require(1 <= r.mtp.k <= 4, f"mtp.k must be 1..4, got {r.mtp.k}")
    _require(0.0 <= r.mtp.oracle_accept <= 1.0, f"mtp.oracle_accept must be in 0..1, got {r.mtp.oracle_accept}")
    c = r.cache
    for key in ("page_size", "max_batch", "prefill_chunk", "num_pages", "num_state_rows"):
        value = getattr(c, key)
        _require(value is None or value >= 1, f"cache.{key} must be >= 1, got {value}")
    _require(0.0 < c.memory_fraction <= 1.0, f"cache.memory_fraction must be in (0, 1], got {c.memory_fraction}")
    _require(
        all(b >= 1 for b in r.compile.batch_sizes), f"compile.batch_sizes must be positive, got {r.compile.batch_sizes}"
    )
    _require(not r.compile.prefill or r.compile.enabled, "compile.prefill needs compile.enabled: true")
    b = r.bench
    _require(all(n >= 1 for n in b.batch_sizes) and b.batch_sizes, "bench.batch_sizes must be positive integers")
    _require(all(1 <= k <= 4 for k in b.ks), f"bench.ks must be in 1..4, got {b.ks}")
    _require(all(0.0 <= a <= 1.0 for a in b.accept_rates), f"bench.accept_rates must be in 0..1, got {b.accept_rates}")
    _require(
        all(n >= 1 for n in b.prompt_lens) and b.prompt_lens and b.output_len >= 2,
        "bench.prompt_len must be >= 1 (or a non-empty list of such) and bench.output_len >= 2",
    )
    _require(r.run.max_new_tokens >= 1, f"run.max_new_tokens must be >= 1, got {r.run.max_new_tokens}")
    for i, prompt in enumerate(r.run.prompts):
        _require(
            isinstance(prompt, str) or all(t >= 0 for t in prompt),
            f"run.prompts[{i}]: token ids must be >= 0",
        )
