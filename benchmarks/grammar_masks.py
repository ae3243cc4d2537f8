"""Host time of structured outputs' token masks: what a constrained step computes before it launches
(`Grammars.masks`: one mask per constrained request and chosen position, K+1 of them per request in a verify, by
llguidance's thread pool), for B rows at K drafts, per kind of grammar. Host work, so this machine's CPU measures it
(the GPU box's host will differ by its cores and clock).

The masks' cost grows with the vocabulary. No real Qwen3.5 tokenizer is on this machine (no hub), so
`--vocab N` extends the checkpoint's byte-level BPE vocabulary with random printable tokens (2-12 bytes, a fixed
seed) up to N; llguidance walks them as it would real ones, but the figure is a stand-in for Qwen's 248k tokens, not
a measurement of them.

    python benchmarks/grammar_masks.py [--model DIR] [--vocab 248320] [--rows 1 8 32] [--k 3] [--out report.json]
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from qwen_mtp import StructuredOutput
from qwen_mtp.engine.grammar import Grammars
from qwen_mtp.engine.setup import load_tokenizer
from qwen_mtp.serve.tools import call_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]}  # fmt: skip
GRAMMARS = {
    "json schema": StructuredOutput(json_schema=PERSON),
    "json object": StructuredOutput(json_object=True),
    "regex line": StructuredOutput(regex=r"[ -~]+"),
    "regex {1,400}": StructuredOutput(regex=r"[ -~]{1,400}"),  # a large bounded repeat: llguidance's slow case
    "tool call": StructuredOutput(grammar=call_grammar([WEATHER])),
}


class Row:
    """What `Grammars.masks` reads of a request."""

    def __init__(self, matcher):
        self.grammar = matcher


def widened_tokenizer(model: Path, vocab: int, folder: Path):
    """The checkpoint's tokenizer with random printable tokens appended to its BPE vocabulary up to `vocab`."""
    config = json.loads((model / "tokenizer.json").read_text())
    tokens = config["model"]["vocab"]
    draw, alphabet = random.Random(0), [chr(c) for c in range(33, 127)] + ["Ġ"]  # Ġ: byte-level BPE's space
    while len(tokens) < vocab - len(config.get("added_tokens", [])):
        tokens.setdefault("".join(draw.choices(alphabet, k=draw.randint(2, 12))), len(tokens))
    for file in model.iterdir():
        if file.name.startswith("tokenizer"):
            (folder / file.name).write_text(file.read_text())
    (folder / "tokenizer.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


def advance(matcher, tokens: int, draw: random.Random, words: int) -> list[int]:
    """Walk `tokens` allowed tokens (drawn among those the mask allows) without consuming them: a chain of drafts."""
    import torch

    chain = []
    mask = torch.empty(words, dtype=torch.int32)
    for _ in range(tokens):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        allowed = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero()[:, 0].tolist()
        if not allowed or matcher.try_consume_tokens([token := draw.choice(allowed)]) != 1:
            break
        chain.append(token)
    matcher.rollback(len(chain))
    return chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"))
    parser.add_argument("--vocab", type=int, default=248_320, help="widen the vocabulary to this many tokens")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = widened_tokenizer(Path(args.model), args.vocab, Path(folder))
    vocab = max(args.vocab, len(tokenizer))
    started = time.perf_counter()
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    grammars._tokenizer()
    print(f"vocabulary {len(tokenizer)} tokens (logits {vocab}); llguidance tokenizer built in "
          f"{time.perf_counter() - started:.2f} s")  # fmt: skip
    print(f"{'grammar':13s} {'rows':>4s} {'positions':>9s} {'compile ms':>10s} {'step ms':>8s} {'us/mask':>8s}")
    report = []
    for name, structured in GRAMMARS.items():
        for rows in args.rows:
            started = time.perf_counter()
            matchers = [grammars.matcher(structured) for _ in range(rows)]
            compile_ms = (time.perf_counter() - started) * 1e3 / rows
            draw = random.Random(rows)
            prefix = [advance(m, 8, draw, grammars.words) for m in matchers]  # mid-output: consume a few tokens
            for m, tokens in zip(matchers, prefix, strict=True):
                m.consume_tokens(tokens)
            drafts = [advance(m, args.k, draw, grammars.words) for m in matchers]
            drafts = [d + [0] * (args.k - len(d)) for d in drafts]  # a refused filler ends a chain early
            requests = [Row(m) for m in matchers]
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                grammars.masks(requests, drafts)
                times.append(time.perf_counter() - started)
            step = statistics.median(times) * 1e3
            positions = rows * (args.k + 1)
            print(f"{name:13s} {rows:4d} {positions:9d} {compile_ms:10.2f} {step:8.3f} {step * 1e3 / positions:8.1f}")
            report.append({"grammar": name, "rows": rows, "k": args.k, "compile_ms": compile_ms, "step_ms": step})
    if args.out:
        Path(args.out).write_text(json.dumps({"vocab": vocab, "rows": report}, indent=2))


if __name__ == "__main__":
    main()
