"""How far a bench row's oracle acceptance can fall from its expectation, and whether a batch sweep can judge
`k: auto` to within a few percent at a given request length.

The oracle accepts the draft at output index i when a seeded draw for (seed, request, i) falls under the accept
rate (`Speculator.start`), and never past the request's last output index. So a row's acceptance length depends
on its requests' draws alone: a short sweep (64 tokens a request, a few requests) holds too few draws for the
rows of two K to come out in the order of their expectations. `k: auto` chooses by expectation (`best_k`), so
against the best fixed K *as realized* it can look several percent behind when its choice was right.

This draws fresh requests many times, steps them exactly as the engine does (the first output token from the
prefill, then verify steps that accept the run of hits among the next K output indices, plus the bonus token,
until the request has its tokens), and prints per batch size and request length:
- each K's acceptance length (mean and the 5th / 95th percentiles over trials);
- with a bench report's step times per K (`--report`: the fixed-K rows' `step_ms`), the K of most expected
  tokens per second (what `k: auto` chooses, all else equal) and how often, realized, it is more than `--miss`
  behind the best fixed K on the same draws, by the bench's two measures: tokens per second (the batch runs
  until its last request is done, so a K whose step counts vary more from request to request loses there) and
  TPOT (each request's own steps).

    python benchmarks/oracle_spread.py --batches 1,4,8 --output-len 64 256 [--report bench.json] [--trials 4000]

Runs on CPU in seconds.
"""

import argparse
import json
import random
import statistics
from collections.abc import Sequence

from qwen_mtp.engine.k_policy import expected_tokens


def request_steps(use: Sequence[bool], k: int, output_len: int) -> tuple[int, int]:
    """(verify steps, accepted drafts) of one request of `output_len` tokens at K = `k`: `use[i]` says whether
    the oracle supplies the right token at output index i (index 0 comes from the prefill)."""
    emitted, steps, accepted = 1, 0, 0
    while emitted < output_len:
        run = 0
        while run < k and emitted + run < min(len(use), output_len) and use[emitted + run]:
            run += 1
        steps, accepted, emitted = steps + 1, accepted + run, emitted + run + 1
    return steps, accepted


def draws(rng: random.Random, accept: float, output_len: int) -> list[bool]:
    return [rng.random() < accept for _ in range(output_len)]


def spread(
    batch: int, output_len: int, accept: float, ks: Sequence[int], step_ms: dict[int, float] | None,
    trials: int, miss: float, seed: int = 0,
) -> dict:  # fmt: skip
    """Acceptance lengths per K over `trials` batches of fresh draws; with `step_ms`, how often the K of most
    expected tokens per second falls more than `miss` behind the best realized K."""
    rng = random.Random(seed)
    lengths: dict[int, list[float]] = {k: [] for k in ks}
    chosen = None
    if step_ms:
        rates = {k: expected_tokens([accept] * k, k) / step_ms[k] for k in ks}
        chosen = max(ks, key=lambda k: (rates[k], -k))
    behind: dict[str, list[float]] = {"tok/s": [], "tpot": []}
    for _ in range(trials):
        batch_draws = [draws(rng, accept, output_len) for _ in range(batch)]
        speed: dict[str, dict[int, float]] = {"tok/s": {}, "tpot": {}}  # higher is better in both
        for k in ks:
            per_request = [request_steps(use, k, output_len) for use in batch_draws]
            steps = [s for s, _ in per_request]
            lengths[k].append((sum(steps) + sum(a for _, a in per_request)) / sum(steps))
            if step_ms:
                speed["tok/s"][k] = 1.0 / (max(steps) * step_ms[k])
                speed["tpot"][k] = 1.0 / (statistics.fmean(steps) * step_ms[k])
        for measure, by_k in speed.items():
            if by_k:
                behind[measure].append(1.0 - by_k[chosen] / max(by_k.values()))
    report = {"batch": batch, "output_len": output_len, "accept": accept, "lengths": {}}
    for k in ks:
        ordered = sorted(lengths[k])
        report["lengths"][k] = {
            "mean": statistics.fmean(ordered), "expected": expected_tokens([accept] * k, k),
            "p5": ordered[int(0.05 * len(ordered))], "p95": ordered[int(0.95 * len(ordered))],
        }  # fmt: skip
    if step_ms:
        report["chosen"] = chosen
        for measure, values in behind.items():
            missed = sum(b > miss for b in values) / trials
            report[measure] = {"mean_behind": statistics.fmean(values), "p_miss": missed}
    return report


def report_step_ms(path: str, accept: float) -> dict[int, dict[int, float]]:
    """Step times per batch size and fixed K (0 = the plain row) from a bench report's oracle rows."""
    times: dict[int, dict[int, float]] = {}
    for row in json.load(open(path))["rows"]:
        fixed = isinstance(row["k"], int)
        if fixed and (row["k"] == 0 or row["accept_rate"] == accept):
            times.setdefault(row["batch"], {})[row["k"]] = row["step_ms"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--output-len", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--accept", type=float, default=0.8)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--report", help="a bench.json whose fixed-K rows give the step times per K")
    parser.add_argument("--trials", type=int, default=4000)
    parser.add_argument("--miss", type=float, default=0.03, help="the fraction behind the best that counts as a miss")
    args = parser.parse_args()
    times = report_step_ms(args.report, args.accept) if args.report else {}
    batches = [int(b) for b in args.batches.split(",")]
    if times:
        batches = [b for b in batches if b in times]
    print("   B |  len |  K |   AL mean [p5, p95] (expected) | chosen | tok/s: P(miss), mean behind | TPOT: same")
    for batch in batches:
        for output_len in args.output_len:
            ks = list(range(0, args.max_k + 1))
            step_ms = times.get(batch)
            if step_ms:
                ks = [k for k in ks if k in step_ms]
            result = spread(batch, output_len, args.accept, ks, step_ms, args.trials, args.miss)
            for k in ks:
                a = result["lengths"][k]
                verdict = ""
                if step_ms and k == ks[-1]:
                    tok, tpot = result["tok/s"], result["tpot"]
                    verdict = (f" | {result['chosen']:6d} | {tok['p_miss']:.3f}, {tok['mean_behind']:+.4f}"
                               f" | {tpot['p_miss']:.3f}, {tpot['mean_behind']:+.4f}")  # fmt: skip
                print(f"{batch:4d} | {output_len:4d} | {k:2d} | {a['mean']:.3f} [{a['p5']:.3f}, {a['p95']:.3f}] "
                      f"({a['expected']:.3f}){verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
