"""`qwen-mtp` command line: `qwen-mtp run recipe.yaml [--set key=value ...]`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from qwen_mtp.engine.request import SpecStats
from qwen_mtp.errors import QwenMTPError

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
) -> None:
    """Load the recipe's model and generate greedily for its prompts; print text, tokens and speed."""
    from qwen_mtp.engine import Engine, SamplingParams
    from qwen_mtp.recipe import load_recipe

    try:
        started = time.perf_counter()
        loaded_recipe = load_recipe(recipe, tuple(set_ or ()))
        engine = Engine.from_recipe(loaded_recipe, progress=sys.stderr.isatty())
        cfg = engine.config
        typer.echo(
            f"model: {loaded_recipe.model.path or 'fixture ' + str(loaded_recipe.model.fixture)} "
            f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"MTP head: {'yes' if engine.model.mtp is not None else 'no'}) "
            f"dtype {loaded_recipe.model.dtype} on {engine.device}, loaded in {time.perf_counter() - started:.1f} s"
        )
        prompts = [engine.encode(p) for p in loaded_recipe.run.prompts]
        params = SamplingParams(loaded_recipe.run.max_new_tokens, loaded_recipe.run.ignore_eos)  # run.* defaults
        started = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - started
    except QwenMTPError as err:
        _fail(err)
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        typer.echo(f"\n[{i}] prompt ({len(prompt)} tokens): {engine.decode(prompt)!r}")
        typer.echo(
            f"[{i}] output ({len(result.token_ids)} tokens, {result.finish_reason}): "
            f"{engine.decode(result.token_ids)!r}"
        )
        typer.echo(f"[{i}] token ids: {result.token_ids}")
        if result.spec is not None:
            typer.echo(f"[{i}] MTP: {_acceptance(result.spec)}")
    total = sum(len(r.token_ids) for r in results)
    note = "prefill included"
    if loaded_recipe.mtp.enabled and loaded_recipe.mtp.draft == "oracle":
        note += ", and the plain pass that computes the oracle continuations"
    typer.echo(f"\n{total} new tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({note})")
    if engine.speculator is not None:
        mtp = loaded_recipe.mtp
        typer.echo(f"MTP k={mtp.k}, {mtp.draft} drafts: {_acceptance(engine.speculator.totals)}")


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
    """Plain decode vs MTP K=1..4 (oracle and real-head drafts) in one run: a table, JSON and a PNG plot."""
    from qwen_mtp.bench import format_table, run_bench, write_outputs
    from qwen_mtp.recipe import load_recipe

    try:
        loaded_recipe = load_recipe(recipe, tuple(set_ or ()))
        report = run_bench(loaded_recipe, progress=sys.stderr.isatty(), log=typer.echo)
    except QwenMTPError as err:
        _fail(err)
    typer.echo(format_table(report))
    for path in write_outputs(report, loaded_recipe.bench.out_dir):
        typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
