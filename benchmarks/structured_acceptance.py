"""MTP acceptance under structured outputs: the acceptance length of K=3 head drafts on the shipped trained
checkpoint (models/qwen-mtp-small, or --model) for greedy requests with each kind of constraint. The drafts are not
masked (the host makes the masks; the chain runs on the device after the verify), so a grammar that pushes the
target away from what the head would write costs acceptance; the tokens a grammar forces are verified as drafts in
place of the head's (`grammar.forced_drafts`); --no-forced leaves the head's drafts alone, for comparison. Runs on
CPU in about a minute; prints a table and checks that every run gives MTP-off's tokens (CPU step times say nothing of
the GPU's: not printed).

    python benchmarks/structured_acceptance.py [--model DIR] [--k 3] [--tokens 96] [--device cpu] [--no-forced]
"""

import argparse

from penalty_acceptance import acceptance_length, setup  # the same model, arguments and five code prompts

from qwen_mtp import SamplingParams, StructuredOutput
from qwen_mtp.engine import grammar
from qwen_mtp.serve.tools import call_grammar

NOW = {"type": "function", "function": {"name": "current_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,24}$"}, "minItems": 4, "maxItems": 12}
CONSTRAINTS = {
    "none": None,
    "regex: one line": StructuredOutput(regex=r"[ -~]{1,300}"),
    "regex: python lines": StructuredOutput(regex=r"([ -~]{0,80}\n){1,12}"),
    "json: names array": StructuredOutput(json_schema=NAMES, any_whitespace=False),
    "json: any object": StructuredOutput(json_object=True),
    "tool call, no params": StructuredOutput(grammar=call_grammar([NOW], "current_time", parallel=False)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-forced", action="store_true", help="verify the head's drafts only")
    args, model, plain, prompts = setup(parser.description, parser)
    if args.no_forced:
        grammar.forced_drafts = lambda matcher, drafts, k: list(drafts[:k])
    print(f"{'constraint':22s} {'acceptance':>10s} {'tokens':>7s}")
    for name, structured in CONSTRAINTS.items():
        params = SamplingParams(args.tokens, ignore_eos=structured is None, structured=structured)
        expected = [r.token_ids for r in plain.generate(prompts, params)]
        length = acceptance_length(model, {"k": args.k}, prompts, params, expected, name)
        print(f"{name:22s} {length:10.3f} {sum(len(t) for t in expected):7d}", flush=True)


if __name__ == "__main__":
    main()
