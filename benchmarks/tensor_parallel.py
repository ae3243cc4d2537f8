"""Issue #23's figures for tensor parallelism on two GPUs (the `nvidia-h200-x2` machine; on CPU the same code runs
over gloo on tiny models, which is how CI checks it).

`tokens`: TP=1 greedy tokens of N mixed-length prompts in this process (with each position's top log-probabilities),
then TP ranks started here decode them MTP off and MTP K = 1..4 (oracle drafts at `--accept`, replaying the MTP-off
tokens) in batches of each `--batches` size, CUDA graphs as the recipe says. It reports whether the ranks agree, whether
every MTP run equals MTP off and every batch size batch 1, and where TP=N's tokens leave TP=1's: the request, the
position, and TP=1's log-probability lead of its own token over TP=N's there (a near-tie is a small lead). Exit status
1 if a rank disagrees or an MTP run differs from MTP off.

`collectives`: the microseconds of one all-reduce of [rows, hidden] in the model dtype as the decode path calls it
(`parallel.collectives.all_reduce_sum`; on CUDA timed as a captured CUDA graph of many calls, as a step's graph runs
them), for each row count a step sends, and how many a target forward and an MTP draft step run.

`summary`: the bench's TP=N rows beside TP=1's (`qwen-mtp bench --set parallel.tp=N`, two reports): step times, their
ratio, and the ideal ratio 1/N plus the step's collectives (their count at each row count a step sends, times the
measured latency) over the TP=1 step.

    python benchmarks/tensor_parallel.py tokens recipes/bench-27b.yaml --out tp2 [--tp 2] [--prompts 32]
        [--batches 1 8 32] [--ks 1 2 3 4] [--new-tokens 32] [--accept 0.8] [--set KEY=VALUE ...]
    python benchmarks/tensor_parallel.py collectives recipes/bench-27b.yaml --out tp2 [--tp 2] [--rows 1 3 4 8 24 32]
    python benchmarks/tensor_parallel.py summary --tp1 tp1/bench.json --tpn tp2/bench.json
        --collectives tp2/tp-collectives.json [--out tp2/tp-summary.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from bench_common import free_memory, sync

from qwen_mtp import Engine, SamplingParams
from qwen_mtp.dtypes import torch_dtype
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.model import Linear, QwenHybridForCausalLM
from qwen_mtp.parallel import current
from qwen_mtp.parallel.collectives import all_gather, all_reduce_sum
from qwen_mtp.parallel.launch import check_recipe, recipe_model_config, run_ranks, uses_cuda
from qwen_mtp.parallel.plan import ROW_PARALLEL
from qwen_mtp.recipe import Recipe, load_recipe

HERE = str(Path(__file__).resolve().parent)
PROMPT_LENGTHS = (5, 17, 64, 130, 9, 300, 33, 2)  # cycled: short, chunk-crossing and long prompts mixed
TOP_LOGPROBS = 5  # TP=1's top tokens kept per position, to place TP=N's token where the two part


@contextlib.contextmanager
def importable_here():
    """This folder on sys.path while `run_ranks` spawns and waits for the ranks (they import this module by name,
    with the sys.path they are given at their start), and off it again after, as `tests/helpers.benchmark_module`
    leaves it: a script here named like an installed package would hide it from the process that imported this
    module (a test)."""
    added = HERE not in sys.path
    if added:
        sys.path.insert(0, HERE)
    try:
        yield
    finally:
        if added:
            sys.path.remove(HERE)


def mixed_prompts(count: int, vocab: int, seed: int = 23) -> list[list[int]]:
    """`count` prompts of PROMPT_LENGTHS' lengths in turn, random ids below `vocab`, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(count)]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_recipe(recipe: Recipe, k: int, batches: list[int], accept: float) -> Recipe:
    """The recipe with MTP off (k 0) or at K = k with oracle drafts, for batches of the given sizes: one batch bucket
    (a CUDA graph set) each, so an engine captures no more graphs than it runs."""
    mtp = dataclasses.replace(recipe.mtp, enabled=k > 0, k=k or recipe.mtp.k, draft="oracle", oracle_accept=accept)
    largest = max(batches)
    cache = dataclasses.replace(recipe.cache, max_batch=largest, num_state_rows=largest)
    compile_ = dataclasses.replace(recipe.compile, batch_sizes=sorted(set(batches)))
    return dataclasses.replace(recipe, mtp=mtp, cache=cache, compile=compile_)


def decode(engine: Engine, prompts: list[list[int]], batch: int, new_tokens: int, oracles=None) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts run `batch` at a time (with `oracles`: through oracle drafts)."""
    params = SamplingParams(new_tokens, ignore_eos=True)
    tokens = []
    for start in range(0, len(prompts), batch):
        group = range(start, min(start + batch, len(prompts)))
        if oracles is None:
            tokens += [r.token_ids for r in engine.generate([prompts[i] for i in group], params)]
            continue
        ids = [engine.submit_with_oracle(prompts[i], oracles[i], params) for i in group]
        while engine.has_unfinished():
            engine.step()
        tokens += [engine.result(i).token_ids for i in ids]
    return tokens


def rank_tokens(spec_file: str) -> None:
    """One TP rank: the model loaded as the recipe says, MTP off then K = 1..4 at each batch size; rank<r>.json."""
    spec = json.loads(Path(spec_file).read_text())
    recipe = load_recipe(spec["recipe"], spec["sets"])
    rank = current(recipe.parallel.tp).rank
    loaded = load_from_recipe(recipe)
    prompts, batches = spec["prompts"], spec["batches"]
    tokens: dict[str, list[list[int]]] = {}
    for k in (0, *spec["ks"]):
        engine = Engine.from_recipe(
            engine_recipe(recipe, k, batches, spec["accept"]), loaded=loaded, log=lambda _: None
        )
        for batch in batches:
            oracles = None if k == 0 else tokens[f"b{batch}-k0"]
            tokens[f"b{batch}-k{k}"] = decode(engine, prompts, batch, spec["new_tokens"], oracles)
        del engine
        free_memory()
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(tokens))


def where_tokens_part(tp1: list[list[int]], tpn: list[list[int]], top: list[list[dict]]) -> list[dict]:
    """For each request whose TP=N tokens leave TP=1's: where, both tokens, and TP=1's log-probability of its own
    token minus that of TP=N's there (None when TP=N's is not among TP=1's top tokens)."""
    parted = []
    for request, (ours, theirs) in enumerate(zip(tp1, tpn, strict=True)):
        position = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if position is None:
            continue
        ranked = top[request][position]
        lead = ranked[str(ours[position])] - ranked[str(theirs[position])] if str(theirs[position]) in ranked else None
        parted.append(
            {"request": request, "position": position, "tp1_token": ours[position], "tpn_token": theirs[position],
             "tp1_lead": lead}
        )  # fmt: skip
    return parted


def tp1_tokens(recipe: Recipe, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list, list]:
    """TP=1 greedy tokens of the prompts, run as one batch in this process, and each position's top log-probabilities
    ({token id as text: log-probability})."""
    single = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, tp=1))
    loaded = load_from_recipe(single)
    engine = Engine.from_recipe(
        engine_recipe(single, 0, [len(prompts)], args.accept), loaded=loaded, log=lambda _: None
    )
    results = engine.generate(prompts, SamplingParams(args.new_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS))
    tokens = [r.token_ids for r in results]
    top = [[{str(t): lp for t, lp in position.top} for position in r.logprobs] for r in results]
    del engine, loaded, results
    free_memory()  # before the ranks size their pools from the free memory
    return tokens, top


def tokens_report(args: argparse.Namespace) -> dict:
    recipe = load_recipe(args.recipe, args.set)
    sets = [*args.set, f"parallel.tp={args.tp}", "parallel.timeout_s=900"]
    ranked = load_recipe(args.recipe, sets)
    check_recipe(ranked)  # a degree the model cannot take is refused before the TP=1 run, not after it
    prompts = mixed_prompts(args.prompts, recipe_model_config(recipe).vocab_size)
    # A synthetic model draws each rank's weights for the rank's shapes: TP=1 would be another model.
    tp1 = None if recipe.model.synthetic else tp1_tokens(recipe, prompts, args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"recipe": args.recipe, "sets": sets, "prompts": prompts, "out": str(out)}
    spec |= {"batches": args.batches, "ks": args.ks, "new_tokens": args.new_tokens, "accept": args.accept}
    (out / "tp-spec.json").write_text(json.dumps(spec))
    started = time.monotonic()
    with importable_here():
        run_ranks(ranked, rank_tokens, str(out / "tp-spec.json"))
    seconds = time.monotonic() - started
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.tp)]
    tpn = runs[0]
    plain = {b: tpn[f"b{b}-k0"] for b in args.batches}
    first = args.batches[0]
    against_tp1 = None
    if tp1 is not None:
        tokens, top = tp1
        against_tp1 = {"requests": len(prompts), "parted": where_tokens_part(tokens, plain[first], top)}
    return {
        "recipe": args.recipe, "sets": args.set, "tp": args.tp, "device": device_name(recipe),
        "prompt_lengths": [len(p) for p in prompts], "new_tokens": args.new_tokens, "batches": args.batches,
        "ks": args.ks, "accept": args.accept, "ranks_seconds": round(seconds, 1),
        "ranks_agree": all(run == tpn for run in runs[1:]),
        "mtp_equals_plain": {f"b{b}-k{k}": tpn[f"b{b}-k{k}"] == plain[b] for k in (0, *args.ks) for b in args.batches},
        "batch_equals_alone": {str(b): plain[b] == plain[first] for b in args.batches},
        "tp1_vs_tpn": against_tp1,
    }  # fmt: skip


def device_name(recipe: Recipe) -> str:
    return torch.cuda.get_device_name(0) if uses_cuda(recipe) else "cpu"


def collective_counts(recipe: Recipe, tp: int) -> dict[str, int]:
    """All-reduces a target forward and an MTP draft step run at degree `tp` (each row-parallel linear's, and the
    vocab-parallel embedding's), counted on the model built on the meta device; each also runs one all-gather (the
    greedy choice over the vocabulary shards)."""
    with torch.device("meta"):
        model = QwenHybridForCausalLM(recipe_model_config(recipe), tp)
    modules = model.named_modules()
    row = [name for name, m in modules if isinstance(m, Linear) and name.rpartition(".")[2] in ROW_PARALLEL]
    mtp = sum(name.startswith("mtp.") for name in row)
    return {"target": len(row) - mtp + 1, "mtp": mtp + 1}


def rank_collectives(spec_file: str) -> None:
    """One TP rank: microseconds per all-reduce of [rows, hidden] and per greedy all-gather, for each row count."""
    spec = json.loads(Path(spec_file).read_text())
    parallel = current(spec["tp"])
    cuda = torch.cuda.is_available() and spec["cuda"]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch_dtype(spec["dtype"])
    timings = {}
    for rows in spec["rows"]:
        x = torch.ones(rows, spec["hidden"], dtype=dtype, device=device)
        pair = torch.ones(rows, 2, dtype=torch.float64, device=device)
        timings[str(rows)] = {
            "all_reduce_us": time_calls(lambda x=x: all_reduce_sum(x, parallel.group, True), cuda, spec["calls"]),
            "all_gather_us": time_calls(lambda p=pair: all_gather(p, parallel.group), cuda, spec["calls"]),
        }
    (Path(spec["out"]) / f"collectives-rank{parallel.rank}.json").write_text(json.dumps(timings))


def time_calls(call, cuda: bool, calls: int) -> float:
    """Microseconds per `call()`: on CUDA the median of 5 replays of a CUDA graph of `calls` calls (NCCL set up by
    eager calls first), on CPU the median of 5 runs of `calls` eager calls."""
    for _ in range(3):
        call()
    sync()
    graph = None
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
    samples = []
    for _ in range(5):
        sync()
        started = time.perf_counter()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(calls):
                call()
        sync()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return sorted(samples)[len(samples) // 2]


def collectives_report(args: argparse.Namespace) -> dict:
    recipe = load_recipe(args.recipe, args.set)
    config = recipe_model_config(recipe)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"tp": args.tp, "rows": args.rows, "hidden": config.hidden_size, "dtype": recipe.model.dtype,
            "calls": args.calls, "cuda": uses_cuda(recipe), "out": str(out)}  # fmt: skip
    (out / "collectives-spec.json").write_text(json.dumps(spec))
    with importable_here():
        run_ranks(load_recipe(args.recipe, [*args.set, f"parallel.tp={args.tp}"]), rank_collectives,
                  str(out / "collectives-spec.json"))  # fmt: skip
    per_rank = [json.loads((out / f"collectives-rank{r}.json").read_text()) for r in range(args.tp)]
    slowest = {
        rows: {key: max(rank[rows][key] for rank in per_rank) for key in per_rank[0][rows]} for rows in per_rank[0]
    }  # a collective ends when its slowest rank does
    return {"recipe": args.recipe, "sets": args.set, "tp": args.tp, "device": device_name(recipe),
            "hidden": config.hidden_size, "dtype": recipe.model.dtype,
            "per_forward": collective_counts(recipe, args.tp), "rows": slowest}  # fmt: skip


def step_collectives_us(row: dict, collectives: dict) -> float | None:
    """Microseconds of collectives in one bench step: a plain step is one target forward over B rows; an MTP step
    a verify over B(K+1) rows, the head's catch-up over B(K+1) rows and K-1 chained draft steps over B (each
    forward its all-reduces and one all-gather). None when a row count was not measured."""
    count, latency, batch = collectives["per_forward"], collectives["rows"], row["batch"]
    if row["mode"] == "plain":
        forwards = [("target", batch)]
    else:
        k = int(row["k"])
        forwards = [("target", batch * (k + 1)), ("mtp", batch * (k + 1))] + [("mtp", batch)] * (k - 1)
    if any(str(rows) not in latency for _, rows in forwards):
        return None
    cost = 0.0
    for kind, rows in forwards:
        cost += count[kind] * latency[str(rows)]["all_reduce_us"] + latency[str(rows)]["all_gather_us"]
    return cost


def summary_report(args: argparse.Namespace) -> dict:
    tp1, tpn = (json.loads(Path(p).read_text()) for p in (args.tp1, args.tpn))
    collectives = json.loads(Path(args.collectives).read_text())
    degree = collectives["tp"]

    def key(row: dict) -> tuple:
        return row["prompt_len"], row["batch"], row["mode"], str(row["k"]), row["draft"], row["accept_rate"]

    single = {key(row): row for row in tp1["rows"]}
    rows = []
    for row in tpn["rows"]:
        base = single.get(key(row))
        if base is None or row["mode"] == "mtp" and row["draft"] != "oracle":
            continue
        comm_us = step_collectives_us(row, collectives)
        ratio = row["step_ms"] / base["step_ms"]
        ideal = None if comm_us is None else 1 / degree + comm_us / 1e3 / base["step_ms"]
        rows.append(
            {"batch": row["batch"], "mode": row["mode"], "k": row["k"], "accept_rate": row["accept_rate"],
             "tp1_step_ms": base["step_ms"], "tpn_step_ms": row["step_ms"], "ratio": ratio,
             "collectives_ms": None if comm_us is None else comm_us / 1e3, "ideal_ratio": ideal,
             "tp1_speedup": base["speedup"], "tpn_speedup": row["speedup"], "exact": row["exact"] and base["exact"]}
        )  # fmt: skip
    return {"tp": degree, "tp1": args.tp1, "tpn": args.tpn, "collectives": args.collectives, "rows": rows}


def print_tokens(report: dict) -> None:
    print(
        f"TP={report['tp']} on {report['device']}: {len(report['prompt_lengths'])} prompts, {report['new_tokens']} "
        f"tokens each, ranks agree: {report['ranks_agree']} ({report['ranks_seconds']} s)"
    )
    for key, equal in report["mtp_equals_plain"].items():
        print(f"  {key}: {'== MTP off' if equal else 'DIFFERS from MTP off'}")
    print(f"  batch == batch {report['batches'][0]}: {report['batch_equals_alone']}")
    against = report["tp1_vs_tpn"]
    if against is None:
        print(f"TP={report['tp']} against TP=1: not compared (a synthetic model's ranks draw other weights than TP=1)")
        return
    print(f"TP={report['tp']} against TP=1: {len(against['parted'])} of {against['requests']} requests part")
    for case in against["parted"]:
        lead = "not in TP=1's top" if case["tp1_lead"] is None else f"TP=1 led by {case['tp1_lead']:.4f} nats"
        tokens = f"{case['tp1_token']} / {case['tpn_token']}"
        print(f"  request {case['request']} at token {case['position']}: {tokens}, {lead}")


def print_collectives(report: dict) -> None:
    counts = report["per_forward"]
    print(
        f"TP={report['tp']} collectives on {report['device']} ({report['dtype']}, hidden {report['hidden']}): "
        f"{counts['target']} all-reduces a target forward, {counts['mtp']} a draft step, 1 all-gather each"
    )
    print("rows | all-reduce us | all-gather us | target forward us")
    for rows, t in report["rows"].items():
        forward = counts["target"] * t["all_reduce_us"] + t["all_gather_us"]
        print(f"{rows} | {t['all_reduce_us']:.1f} | {t['all_gather_us']:.1f} | {forward:.0f}")


def print_summary(report: dict) -> None:
    tp = report["tp"]
    print(
        f"B | mode | K | TP=1 step ms | TP={tp} step ms | ratio | ideal (1/{tp} + collectives) | collectives ms "
        "| speedup TP=1 / TP=N | exact"
    )
    for r in report["rows"]:
        ideal = "-" if r["ideal_ratio"] is None else f"{r['ideal_ratio']:.3f}"
        comm = "-" if r["collectives_ms"] is None else f"{r['collectives_ms']:.3f}"
        steps = f"{r['tp1_step_ms']:.2f} | {r['tpn_step_ms']:.2f} | {r['ratio']:.3f}"
        speedups = f"{r['tp1_speedup']:.2f} / {r['tpn_speedup']:.2f}"
        print(f"{r['batch']} | {r['mode']} | {r['k']} | {steps} | {ideal} | {comm} | {speedups} | {r['exact']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tokens = commands.add_parser("tokens")
    collectives = commands.add_parser("collectives")
    for command in (tokens, collectives):
        command.add_argument("recipe")
        command.add_argument("--out", required=True)
        command.add_argument("--tp", type=int, default=2)
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    tokens.add_argument("--prompts", type=int, default=32)
    tokens.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    tokens.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    tokens.add_argument("--new-tokens", type=int, default=32)
    tokens.add_argument("--accept", type=float, default=0.8)
    collectives.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 24, 32])
    collectives.add_argument("--calls", type=int, default=200)
    summary = commands.add_parser("summary")
    summary.add_argument("--tp1", required=True)
    summary.add_argument("--tpn", required=True)
    summary.add_argument("--collectives", required=True)
    summary.add_argument("--out")
    args = parser.parse_args()

    if args.command == "tokens":
        report = tokens_report(args)
        print_tokens(report)
        path = Path(args.out) / "tp-tokens.json"
        failed = not report["ranks_agree"] or not all(report["mtp_equals_plain"].values())
    elif args.command == "collectives":
        report = collectives_report(args)
        print_collectives(report)
        path, failed = Path(args.out) / "tp-collectives.json", False
    else:
        report = summary_report(args)
        print_summary(report)
        path, failed = (Path(args.out) if args.out else None), not all(r["exact"] for r in report["rows"])
    if path is not None:
        path.write_text(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
