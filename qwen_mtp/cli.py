"""`qwen-mtp` command line: `qwen-mtp run|bench|serve|train recipe.yaml [--set key=value ...]`, `qwen-mtp acceptance
DIR`, `qwen-mtp draft-vocab DIR --out FILE`."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from qwen_mtp.engine.request import SpecStats
from qwen_mtp.errors import QwenMTPError

if TYPE_CHECKING:
    from qwen_mtp.engine import Engine, Result, SamplingParams
    from qwen_mtp.recipe import Recipe

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def main() -> None:
    """Exact MTP speculative decoding for Qwen3.5 hybrid models."""


def _fail(err: Exception) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe (see recipes/)")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a recipe key, e.g. --set mtp.k=4")] = None,
    progress_every: Annotated[
        float, typer.Option(help="off a terminal: seconds between progress lines on stderr (0: every step)")
    ] = 5.0,
) -> None:
    """Load the recipe's model and generate greedily for its prompts; print text, tokens and speed. With
    `parallel.tp: N` it starts N ranks (or runs as the rank torchrun started)."""
    from qwen_mtp.parallel.launch import run_ranks
    from qwen_mtp.recipe import load_recipe

    try:
        started = time.perf_counter()
        loaded_recipe = load_recipe(recipe, tuple(set_ or ()))
        run_ranks(loaded_recipe, _run_rank, loaded_recipe, progress_every, started)
    except QwenMTPError as err:
        _fail(err)


def _run_rank(loaded_recipe: Recipe, progress_every: float, started: float) -> None:
    """`qwen-mtp run` on one rank (the whole of it at tp = 1): every rank runs the same steps, rank 0 prints."""
    from qwen_mtp.engine import Engine, SamplingParams

    parallel, lead = _this_rank(loaded_recipe)
    echo = typer.echo if lead else _quiet
    engine = Engine.from_recipe(loaded_recipe, progress=lead and sys.stderr.isatty(), log=None if lead else _quiet)
    cfg = engine.config
    ranks = f", tensor parallel over {parallel.degree} ranks" if parallel is not None else ""
    echo(
        f"model: {loaded_recipe.model.path or 'fixture ' + str(loaded_recipe.model.fixture)} "
        f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"MTP head: {'yes' if engine.model.mtp is not None else 'no'}) "
        f"dtype {loaded_recipe.model.dtype} on {engine.device}{ranks}, loaded in {time.perf_counter() - started:.1f} s"
    )
    mtp = loaded_recipe.mtp
    speculation = f"MTP k={mtp.k}, {mtp.draft} drafts" if mtp.enabled else "no MTP"
    echo(f"decode path: {engine.decode_path} on {engine.device} ({speculation})")
    prompts = [engine.encode(p) for p in loaded_recipe.run.prompts]
    params = SamplingParams(loaded_recipe.run.max_new_tokens, loaded_recipe.run.ignore_eos)  # run.* defaults
    started = time.perf_counter()
    results = _generate(engine, prompts, params, progress_every, sys.stderr if lead else io.StringIO())
    elapsed = time.perf_counter() - started
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        echo(f"\n[{i}] prompt ({len(prompt)} tokens): {engine.decode(prompt)!r}")
        echo(
            f"[{i}] output ({len(result.token_ids)} tokens, {result.finish_reason}): "
            f"{engine.decode(result.token_ids)!r}"
        )
        echo(f"[{i}] token ids: {result.token_ids}")
        if result.spec is not None:
            echo(f"[{i}] MTP: {_acceptance(result.spec)}")
    total = sum(len(r.token_ids) for r in results)
    note = "prefill included"
    if mtp.enabled and mtp.draft == "oracle":
        note += ", and the plain pass that computes the oracle continuations"
    echo(f"\n{total} new tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({note})")
    if engine.speculator is not None:
        echo(f"MTP k={mtp.k}, {mtp.draft} drafts: {_acceptance(engine.speculator.totals)}")


def _this_rank(loaded_recipe: Recipe):
    """This process's rank (None at tp = 1) and whether it leads: rank 0 (or the only process) prints and serves."""
    from qwen_mtp.parallel import current

    parallel = current(loaded_recipe.parallel.tp)
    return parallel, parallel is None or parallel.rank == 0


def _quiet(*args, **kwargs) -> None:
    """What ranks other than 0 print: nothing (they run the same steps; rank 0 owns the output)."""


def _generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, progress_every: float, stream: TextIO
) -> list[Result]:
    """Every prompt as one continuous batch, reporting tokens generated / total on `stream` as the steps run."""
    if engine.speculator is not None and engine.speculator.oracle:
        # Oracle drafts need each request's plain-greedy continuation first: only `generate` computes it.
        print("oracle drafts: a plain pass computes the continuations first (no progress shown)", file=stream)
        return engine.generate(prompts, params)
    ids = [engine.submit(p, params) for p in prompts]
    generated = dict.fromkeys(ids, 0)
    progress = TokenProgress(len(ids) * params.max_new_tokens, progress_every, stream)
    try:
        while engine.has_unfinished():
            updates = engine.step()
            for update in updates:
                generated[update.request_id] += len(update.new_token_ids)
                if update.finished:  # stopped at EOS: it will not generate the rest of its tokens
                    progress.total -= params.max_new_tokens - generated[update.request_id]
            progress.update(sum(len(u.new_token_ids) for u in updates))
    finally:
        progress.close()
    return [engine.result(i) for i in ids]


class TokenProgress:
    """Tokens generated / total on stderr while `qwen-mtp run` generates: a tqdm bar on a terminal, otherwise a
    line when it starts and every `every` seconds, so a long run is never silent in a log."""

    def __init__(self, total: int, every: float, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.total, self.done, self.reported, self.every = total, 0, 0, every
        self.started = self.printed = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generating", unit="tok", file=self.stream, leave=False)
        else:
            self._print(f"generating up to {total} tokens")

    def update(self, tokens: int) -> None:
        self.done += tokens
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.update(tokens)
        elif now - self.printed >= self.every:
            self._report(now)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done != self.reported:
            self._report(time.perf_counter())

    def _report(self, now: float) -> None:
        rate = self.done / max(now - self.started, 1e-9)
        self._print(f"generated {self.done}/{self.total} tokens ({rate:.1f} tokens/s)")
        self.printed, self.reported = now, self.done

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def _acceptance(spec: SpecStats) -> str:
    positions = ", ".join(f"{p:.2f}" for p in spec.position_acceptance)
    return (
        f"{spec.verify_steps} verify steps, {spec.accepted}/{spec.drafted} drafts accepted, "
        f"acceptance length {spec.acceptance_length:.2f}, per-position acceptance [{positions}]"
    )


@app.command()
def bench(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe with a bench section (see recipes/bench-*.yaml)")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override a recipe key, e.g. --set bench.batch_sizes=[1,8]")
    ] = None,
) -> None:
    """Plain decode vs MTP K=1..4 (oracle and real-head drafts) in one run: a table, JSON and a PNG plot. With
    `parallel.tp: N` it starts N ranks (or runs as the rank torchrun started); rank 0 times and writes."""
    from qwen_mtp.parallel.launch import run_ranks
    from qwen_mtp.recipe import load_recipe

    try:
        loaded_recipe = load_recipe(recipe, tuple(set_ or ()))
        run_ranks(loaded_recipe, _bench_rank, loaded_recipe)
    except QwenMTPError as err:
        _fail(err)


def _bench_rank(loaded_recipe: Recipe) -> None:
    """`qwen-mtp bench` on one rank: every rank runs the same rows, rank 0 prints and writes the outputs."""
    from qwen_mtp.bench import format_table, run_bench, write_outputs

    _, lead = _this_rank(loaded_recipe)
    report = run_bench(loaded_recipe, progress=lead and sys.stderr.isatty(), log=typer.echo if lead else _quiet)
    if lead:
        typer.echo(format_table(report))
        for path in write_outputs(report, loaded_recipe.bench.out_dir):
            typer.echo(f"wrote {path}")


@app.command()
def train(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe with a train section (see recipes/train-*.yaml)")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override a recipe key, e.g. --set train.steps=2000")
    ] = None,
    mtp_only: Annotated[
        bool, typer.Option("--mtp-only", help="train only the MTP head, on the frozen target's own tokens")
    ] = False,
) -> None:
    """Train (or resume) a model with its MTP head; writes an HF checkpoint, loss log, curve and summary."""
    from qwen_mtp.recipe import load_recipe
    from qwen_mtp.train import train as run_training

    overrides = tuple(set_ or ()) + (("train.mode=mtp-head",) if mtp_only else ())
    try:
        loaded_recipe = load_recipe(recipe, overrides)
        run_training(loaded_recipe, log=typer.echo, progress=sys.stderr.isatty())
    except QwenMTPError as err:
        _fail(err)


@app.command()
def acceptance(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint directory with an MTP head")],
    prompts: Annotated[
        Path | None, typer.Option(help="JSON {'prompts': [...]}; default: the held-out prompts qwen-mtp ships")
    ] = None,
    count: Annotated[int | None, typer.Option(help="use only the first COUNT prompts")] = None,
    ks: Annotated[str, typer.Option(help="comma-separated K values")] = "1,2,3,4",
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per prompt (EOS ignored)")] = 64,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "float32",
    out: Annotated[Path | None, typer.Option(help="also write the figures to this JSON file")] = None,
    draft_vocab: Annotated[int, typer.Option(help="draft from the N most frequent ids only (mtp.draft_vocab)")] = 0,
    draft_vocab_file: Annotated[str | None, typer.Option(help="with --draft-vocab: the count file")] = None,
    draft_lm_head: Annotated[str, typer.Option(help="bf16 or fp8: what the drafts score (mtp.draft_lm_head)")] = "bf16",
) -> None:
    """Greedy MTP acceptance lengths for K=1..4 on held-out prompts (and a check that MTP-on == MTP-off)."""
    import json

    from qwen_mtp.train.evaluate import measure_acceptance, read_prompts

    try:
        k_values = tuple(int(k) for k in ks.split(","))
        report = measure_acceptance(
            checkpoint, read_prompts(prompts)[:count], k_values, max_new_tokens, device, dtype, log=typer.echo,
            draft_vocab=draft_vocab, draft_vocab_file=draft_vocab_file, draft_lm_head=draft_lm_head,
        )  # fmt: skip
    except ValueError as err:
        _fail(ValueError(f"--ks must be comma-separated integers 1..4: {err}"))
    except QwenMTPError as err:
        _fail(err)
    text = json.dumps(report, indent=2)
    if out is not None:
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}")
    else:
        typer.echo(text)


@app.command("draft-vocab")
def draft_vocab(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint directory (its tokenizer, and model for --prompts)")],
    out: Annotated[Path, typer.Option(help="the count file to write (mtp.draft_vocab_file)")],
    corpus: Annotated[
        str | None, typer.Option(help="count a local corpus: a folder of text files, or 'stdlib' (train split)")
    ] = None,
    include: Annotated[list[str] | None, typer.Option(help="with --corpus: file globs (default **/*.py)")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="count the model's greedy generations for these prompts (JSON {'prompts': [...]})"),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="with --prompts: tokens generated per prompt")] = 256,
    device: Annotated[str, typer.Option(help="with --prompts: cpu, cuda or cuda:N")] = "cpu",
    dtype: Annotated[str, typer.Option(help="with --prompts: float32 or bfloat16")] = "bfloat16",
) -> None:
    """Count tokens for a draft vocabulary (`mtp.draft_vocab`, docs/mtp.md): over a local corpus with the model's
    tokenizer, or over the model's own greedy generations for a prompt file; writes the count file."""
    from qwen_mtp.engine import draft_vocab as counts_file
    from qwen_mtp.errors import RecipeError

    try:
        if (corpus is None) == (prompts is None):
            raise RecipeError("give one of --corpus (a folder or 'stdlib') or --prompts (a JSON prompt file)")
        if corpus is not None:
            from qwen_mtp.engine.setup import load_tokenizer
            from qwen_mtp.train.corpus import Corpus

            tokenizer = load_tokenizer(checkpoint)
            if tokenizer is None:
                raise RecipeError(f"{checkpoint} has no tokenizer: --corpus needs one to count tokens")
            files = Corpus(corpus, tuple(include or ("**/*.py",))).files("train")
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            counts = counts_file.count_corpus(encode, (f.text for f in files))
            source = f"corpus {corpus} (train split, {len(files)} files)"
        else:
            from qwen_mtp.engine import Engine
            from qwen_mtp.train.evaluate import read_prompts

            recipe = {"model": {"path": str(checkpoint), "dtype": dtype, "device": device}}
            engine = Engine.from_recipe(recipe, log=lambda _: None)
            texts = read_prompts(prompts)
            counts = counts_file.count_generations(engine, texts, max_new_tokens)
            source = f"greedy generations ({len(texts)} prompts of {prompts}, up to {max_new_tokens} tokens each)"
        about = {"model": checkpoint, "source": source, "tokens": sum(counts.values()), "distinct": len(counts)}
        counts_file.write_counts(out, counts, about)
    except QwenMTPError as err:
        _fail(err)
    typer.echo(f"wrote {out}: {about['tokens']} tokens, {about['distinct']} distinct ids, from {source}")


@app.command()
def serve(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe (see recipes/; its server: section, docs/serving.md)")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a recipe key, e.g. --set mtp.k=4")] = None,
    host: Annotated[str | None, typer.Option(help="listen address (default: server.host)")] = None,
    port: Annotated[int | None, typer.Option(help="port, 0 for any free one (default: server.port)")] = None,
) -> None:
    """Serve the recipe's model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics). With
    `parallel.tp: N` it starts N ranks (or runs as the rank torchrun started): rank 0 serves, the others follow."""
    from qwen_mtp.errors import RecipeError, require_extra
    from qwen_mtp.parallel.launch import run_ranks
    from qwen_mtp.recipe import load_recipe

    overrides = [
        *(set_ or ()),
        *([f"server.host={host}"] if host else []),
        *([f"server.port={port}"] if port is not None else []),
    ]
    try:
        require_extra("serve", ("fastapi", "uvicorn", "prometheus_client"))
        loaded_recipe = load_recipe(recipe, tuple(overrides))
        if loaded_recipe.mtp.enabled and loaded_recipe.mtp.draft == "oracle":
            raise RecipeError("mtp.draft: oracle drafts need each request's answer beforehand: serve with head")
        run_ranks(loaded_recipe, _serve_rank, loaded_recipe)
    except (QwenMTPError, OSError) as err:  # OSError: the address is taken or not ours to bind
        _fail(err)


def _serve_rank(loaded_recipe: Recipe) -> None:
    """`qwen-mtp serve` on one rank: rank 0 loads, warms up and serves; every other rank loads, warms up and
    follows rank 0's engine loop step by step (serve/relay.py)."""
    from qwen_mtp.engine import Engine
    from qwen_mtp.serve.relay import Relay, follow
    from qwen_mtp.serve.server import serve as run_server

    parallel, lead = _this_rank(loaded_recipe)
    engine = Engine.from_recipe(loaded_recipe, progress=lead and sys.stderr.isatty(), log=None if lead else _quiet)
    engine.warmup()
    relay = Relay(parallel, loaded_recipe.parallel.timeout_s) if parallel is not None else None
    if lead:
        log = lambda line: typer.echo(line, err=True)  # noqa: E731
        if relay is not None:
            log(f"tensor parallel over {parallel.degree} ranks: {relay.pids} (process ids by rank; rank 0 serves)")
        run_server(engine, loaded_recipe.server, log=log, relay=relay)
    else:
        follow(engine, relay)


if __name__ == "__main__":
    app()
