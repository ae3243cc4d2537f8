"""Load test for any OpenAI-compatible server: N concurrent streaming clients (asyncio + the `openai` package)
send completions with random token-id prompts; reports TTFT / TPOT percentiles, throughput and errors, and,
against qwen-mtp (its /metrics), the MTP acceptance over the run and whether every KV page and state row came
back afterwards.

    # start `qwen-mtp serve` on this machine, load it, stop it (SIGTERM), write the report:
    python benchmarks/load_test.py --recipe recipes/serve-27b.yaml --concurrency 64 --out load.json
    python benchmarks/load_test.py --recipe recipes/serve-27b.yaml --set mtp.enabled=true --out load-mtp.json
    # or against a server that already runs (ours or another engine's):
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000/v1 --model qwen-mtp --out load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    ttft: float | None = None  # s, request sent -> first streamed token
    tpot: float | None = None  # s, (last - first token) / (tokens - 1)
    latency: float | None = None
    tokens: int = 0
    chunks: int = 0
    error: str | None = None
    message: str | None = None  # the error's text
    finish_reason: str | None = None


@dataclass
class Report:
    base_url: str
    model: str
    concurrency: int
    requests: int
    prompt_len: int
    max_tokens: int
    wall_s: float = 0.0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # one message per kind of error
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    server: dict[str, object] = field(default_factory=dict)  # qwen-mtp /metrics: acceptance, pages back to free


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def scrape(base: str) -> dict[str, float] | None:
    """The server's Prometheus metrics (name{labels} -> value), or None when it has no /metrics."""
    try:
        response = httpx.get(base + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


async def one_request(client: openai.AsyncOpenAI, args, prompt: list[int]) -> Sample:
    sample = Sample()
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    started = time.perf_counter()
    first = last = None
    try:
        stream = await client.completions.create(
            model=args.model,
            prompt=prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                sample.chunks += 1
                first = first or now
                last = now
                sample.finish_reason = chunk.choices[0].finish_reason or sample.finish_reason
            if chunk.usage is not None:
                sample.tokens = chunk.usage.completion_tokens
    except Exception as err:  # counted by kind; the load goes on
        sample.error, sample.message = type(err).__name__, str(err)[:300]
        return sample
    sample.latency = time.perf_counter() - started
    if first is not None:
        sample.ttft = first - started
        tokens = sample.tokens or sample.chunks
        if tokens > 1:
            sample.tpot = (last - first) / (tokens - 1)
    return sample


async def run_load(args, base_url: str) -> Report:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, http_client=http)
    async with client:
        for prompt in prompts[: args.warmup]:  # compile / capture paths before timing
            await one_request(client, args, prompt)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        samples: list[Sample] = []

        async def worker() -> None:
            while not queue.empty():
                samples.append(await one_request(client, args, queue.get_nowait()))

        base = base_url.rsplit("/v1", 1)[0]
        before = scrape(base)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
        after = scrape(base)
    done = [s for s in samples if s.error is None]
    report = Report(base_url, args.model, args.concurrency, args.requests, args.prompt_len, args.max_tokens, wall)
    report.completed = len(done)
    for s in samples:
        if s.error is not None:
            report.errors[s.error] = report.errors.get(s.error, 0) + 1
            report.error_examples.setdefault(s.error, s.message or "")
        elif s.finish_reason is not None:
            report.finish_reasons[s.finish_reason] = report.finish_reasons.get(s.finish_reason, 0) + 1
    report.output_tokens = sum(s.tokens or s.chunks for s in done)
    report.output_tokens_per_s = report.output_tokens / wall
    report.requests_per_s = len(done) / wall
    report.ttft_s = percentiles([s.ttft for s in done if s.ttft is not None])
    report.tpot_s = percentiles([s.tpot for s in done if s.tpot is not None])
    report.latency_s = percentiles([s.latency for s in done if s.latency is not None])
    if before is not None and after is not None:
        report.server = server_figures(base, before, after)
    return report


def server_figures(base: str, before: dict[str, float], after: dict[str, float]) -> dict[str, object]:
    """MTP acceptance over the run (counter deltas), and pages / rows back to all-free after it."""
    figures: dict[str, object] = {}
    steps = after.get("qwen_mtp_spec_verify_steps_total", 0) - before.get("qwen_mtp_spec_verify_steps_total", 0)
    if steps > 0:
        drafted = after["qwen_mtp_spec_drafted_tokens_total"] - before["qwen_mtp_spec_drafted_tokens_total"]
        accepted = after["qwen_mtp_spec_accepted_tokens_total"] - before["qwen_mtp_spec_accepted_tokens_total"]
        figures.update(
            verify_steps=steps,
            drafted=drafted,
            accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            acceptance_length=(accepted + steps) / steps,
        )
    if "qwen_mtp_kv_pages_in_use" in after:
        deadline = time.monotonic() + 30
        while True:
            now = scrape(base) or {}
            free = now.get("qwen_mtp_kv_pages_in_use") == 0 and now.get("qwen_mtp_state_rows_in_use") == 0
            if free or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        figures.update(
            all_free_after=free,
            kv_pages_in_use_after=now.get("qwen_mtp_kv_pages_in_use"),
            state_rows_in_use_after=now.get("qwen_mtp_state_rows_in_use"),
            kv_pages_total=now.get("qwen_mtp_kv_pages_total"),
            state_rows_total=now.get("qwen_mtp_state_rows_total"),
        )
    return figures


def start_server(recipe: str, sets: list[str]) -> tuple[subprocess.Popen, str]:
    """`qwen-mtp serve` on a free loopback port; returns the process and its /v1 URL once /health answers."""
    command = [sys.executable, "-m", "qwen_mtp.cli", "serve", recipe, "--host", "127.0.0.1", "--port", "0"]
    for item in sets:
        command += ["--set", item]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"qwen-mtp serve exited with {proc.returncode} before serving")
        sys.stderr.write(line)
        if line.startswith("serving "):
            url = line.split(" on ")[1].split()[0]
    # keep copying its log, so a full pipe never blocks it
    threading.Thread(target=lambda: [sys.stderr.write(line) for line in proc.stderr], daemon=True).start()
    while httpx.get(url.rsplit("/v1", 1)[0] + "/health", timeout=10).status_code != 200:
        time.sleep(0.2)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--recipe", help="start `qwen-mtp serve` with this recipe (stopped with SIGTERM after)")
    target.add_argument("--base-url", help="an OpenAI-compatible server already running, e.g. http://host:8000/v1")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="recipe override (with --recipe)")
    parser.add_argument("--model", default="qwen-mtp", help="the model name to send")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=int, default=64, help="clients streaming at once")
    parser.add_argument("--requests", type=int, default=None, help="requests in all (default: 4 x concurrency)")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (random token ids)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--vocab",
        type=int,
        default=1000,
        help="prompt token ids are drawn from [1, vocab): keep it below the model's vocabulary",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send the ignore_eos extension (servers that refuse unknown fields)",
    )
    parser.add_argument("--warmup", type=int, default=4, help="requests sent one by one before timing")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    args = parser.parse_args()
    args.requests = args.requests or 4 * args.concurrency

    proc = None
    base_url = args.base_url
    if args.recipe:
        proc, base_url = start_server(args.recipe, args.sets)
    try:
        report = asyncio.run(run_load(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                status = proc.wait()
    result = asdict(report)
    if proc is not None:
        result["recipe"], result["sets"], result["server_exit_status"] = args.recipe, args.sets, status
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    problems = report.errors or (report.server and report.server.get("all_free_after") is False)
    sys.exit(1 if problems or (proc is not None and status != 0) else 0)


if __name__ == "__main__":
    main()
