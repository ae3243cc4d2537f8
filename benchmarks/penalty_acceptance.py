"""MTP acceptance under penalties: the acceptance length of K=3 head drafts on the shipped trained checkpoint
(models/qwen-mtp-small, or --model) for greedy requests with each penalty, with coupled drafts (penalized as the
target will be, the default) and with greedy drafts (the head's unpenalized argmax, `mtp.coupled_drafts: false`).
Runs on CPU in about a minute; prints a table and checks that every run gives MTP-off's tokens.

    python benchmarks/penalty_acceptance.py [--model DIR] [--k 3] [--tokens 96] [--device cpu]
"""

import argparse
from pathlib import Path

from qwen_mtp import Engine, SamplingParams

PROMPTS = [
    "def parse_args(argv):\n",
    "class Config:\n    def __init__(self",
    "import os\nimport sys\n\n",
    "    for key, value in items:\n",
    "def main():\n    parser = argparse.ArgumentParser(",
]
PENALTIES = {
    "none": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "repetition 1.3": {"repetition_penalty": 1.3},
    "frequency 0.5": {"frequency_penalty": 0.5},
    "presence 1.0": {"presence_penalty": 1.0},
}


def setup(description: str, parser: argparse.ArgumentParser | None = None):
    """What the acceptance benchmarks share: their arguments (the model, K, tokens, device, beside those `parser`
    already has), the recipe's model section, an MTP-off engine and `PROMPTS` encoded."""
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"))
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = {"path": args.model, "dtype": "float32", "device": args.device}
    plain = Engine.from_recipe({"model": model}, log=lambda _: None)
    return args, model, plain, [plain.encode(p) for p in PROMPTS]


def acceptance_length(model: dict, mtp: dict, prompts, params: SamplingParams, expected, what) -> float:
    """The acceptance length of an engine with `mtp` over `prompts`, after checking it gives MTP-off's tokens."""
    engine = Engine.from_recipe({"model": model, "mtp": {"enabled": True, **mtp}}, log=lambda _: None)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected, what
    return engine.stats()["acceptance_length"]


def main() -> None:
    args, model, plain, prompts = setup(__doc__.splitlines()[0])
    print(f"{'penalty':16s} {'coupled drafts':>15s} {'greedy drafts':>14s}")
    for name, penalty in PENALTIES.items():
        params = SamplingParams(args.tokens, ignore_eos=True, **penalty)
        expected = [r.token_ids for r in plain.generate(prompts, params)]
        lengths = [
            acceptance_length(model, {"k": args.k, "coupled_drafts": coupled}, prompts, params, expected, name)
            for coupled in (True, False)
        ]
        print(f"{name:16s} {lengths[0]:15.3f} {lengths[1]:14.3f}", flush=True)


if __name__ == "__main__":
    main()
