"""Live servers for the serving and lm-eval tests: uvicorn in a thread on a loopback port the OS picks, over a
tiny checkpoint; and `qwen-mtp serve` in a subprocess (`CliServer`, for tensor-parallel ranks and GPU runs)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
from helpers import wait_gone
from prometheus_client.parser import text_string_to_metric_families

from qwen_mtp.engine import Engine
from qwen_mtp.recipe import load_recipe
from qwen_mtp.serve.server import bind, uvicorn_server

ROOT = Path(__file__).resolve().parents[1]

# A ChatML template like Qwen's (the tiny tokenizer has <|im_start|> / <|im_end|> as special tokens).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools{% for t in tools %}\n{{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments|items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if add_generation_prompt and enable_thinking is defined %}"  # as Qwen's templates do
    "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def with_chat_template(checkpoint: Path, target: Path) -> Path:
    """A copy of `checkpoint` whose tokenizer_config.json carries `CHAT_TEMPLATE`."""
    if not target.exists():
        shutil.copytree(checkpoint, target)
        config_file = target / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = CHAT_TEMPLATE
        config_file.write_text(json.dumps(config, indent=2))
    return target


def tiny_recipe(path: Path, *overrides: str):
    base = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}}
    return load_recipe(base, ("server.port=0", *overrides))


class LiveServer:
    """`qwen_mtp.serve` in a background thread (uvicorn skips signal handling off the main thread)."""

    def __init__(self, engine: Engine, recipe):
        self.engine, self.settings = engine, recipe.server
        self.sock = bind("127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn_server(engine, self.settings, log=lambda line: None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @classmethod
    def from_recipe(cls, recipe) -> LiveServer:
        return cls(Engine.from_recipe(recipe, log=lambda line: None), recipe)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def metrics(self) -> dict[str, float]:
        """/metrics parsed by prometheus-client's own parser: sample name (with labels) -> value."""
        text = httpx.get(self.base + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def wait_all_free(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request holds a KV page or a state row; returns the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["qwen_mtp_kv_pages_in_use"] == 0 and m["qwen_mtp_state_rows_in_use"] == 0:
                if m["qwen_mtp_requests_in_flight"] == 0:
                    return m
            assert time.monotonic() < deadline, f"pages / rows still in use: {m}"
            time.sleep(0.05)


class CliServer:
    """`qwen-mtp serve RECIPE --port 0` in a subprocess, as a user starts it (with `parallel.tp: 2` in the recipe
    the launcher spawns the ranks)."""

    def __init__(self, recipe: Path, start_s: float = 240.0):  # 240 s: two ranks loading on two busy cores
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the GPU box's .site too
        env = {**os.environ, "PYTHONPATH": path}
        command = ["python", "-m", "qwen_mtp.cli", "serve", str(recipe), "--port", "0"]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lines: list[str] = []
        deadline = time.monotonic() + start_s
        while not self.lines or not self.lines[-1].startswith("serving "):  # not "... reserving ..."
            line = self.proc.stderr.readline()
            self.lines.append(line)
            assert line or self.proc.poll() is None, f"the server exited before serving: {''.join(self.lines)}"
            assert time.monotonic() < deadline, "the server did not start"
        self.url = self.lines[-1].split(" on ")[1].split()[0]

    def ranks(self) -> dict[int, int]:
        """rank -> pid, from the line rank 0 logs before serving."""
        (line,) = [line for line in self.lines if line.startswith("tensor parallel over 2 ranks: (")]
        return dict(enumerate(int(pid) for pid in line.split("(")[1].split(")")[0].split(",")))

    def stderr(self) -> str:
        return "".join(self.lines) + self.proc.stderr.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def gpu_answers_with_and_without_mtp(tmp_path: Path, prompts: list, max_tokens: int, tp: int = 1) -> dict:
    """The shipped model served on GPUs (bf16, CUDA graphs, `tp` ranks) with MTP off, then with MTP K=3: each
    server's greedy answers to `prompts` sent at once, by MTP on or off. Each server must stop on SIGTERM with
    status 0, every rank with it."""
    answers = {}
    for mtp in (False, True):
        recipe = tmp_path / f"serve-tp{tp}-mtp-{mtp}.yaml"
        recipe.write_text(
            f"model:\n  path: {ROOT / 'models' / 'qwen-mtp-small'}\n  dtype: bfloat16\n  device: cuda\n"
            f"mtp:\n  enabled: {str(mtp).lower()}\n  k: 3\n"
            f"compile:\n  cuda_graphs: true\nparallel:\n  tp: {tp}\n  timeout_s: 300\n"
        )
        server = CliServer(recipe, start_s=300)
        try:
            ranks = server.ranks() if tp > 1 else {}
            answers[mtp] = asyncio.run(greedy_answers(server.url, prompts, max_tokens))
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(120) == 0, server.stderr()
            wait_gone(ranks.values())
        finally:
            server.close()
    return answers


async def greedy_answers(url: str, prompts: list, max_tokens: int) -> list[str]:
    """Every prompt's greedy completion from the server at `url`, all sent at once (the server batches them)."""
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as c:
        outs = await asyncio.gather(
            *(c.completions.create(model="qwen-mtp", prompt=p, max_tokens=max_tokens, temperature=0) for p in prompts)
        )
    return [o.choices[0].text for o in outs]
