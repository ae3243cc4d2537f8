"""The lm-evaluation-harness model `qwen-mtp`: the engine in-process, every request of a call submitted at once
and run as one continuous batch. Importing this module registers it with lm-eval.

`--model_args recipe=PATH` names the recipe; any other `section.key=value` overrides one of its keys, e.g.
`--model_args recipe=recipes/tiny.yaml,mtp.enabled=true,mtp.k=3`.
"""

from __future__ import annotations

import json
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval fills its model registry lazily, only while it is empty: fill it first)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from qwen_mtp.engine import Engine, Result, SamplingParams
from qwen_mtp.errors import RecipeError
from qwen_mtp.recipe import load_recipe
from qwen_mtp.serve.text import TextAssembler, output_decoder


@register_model("qwen-mtp")
class QwenMTPLM(TemplateLM):
    def __init__(
        self,
        recipe: str | None = None,
        max_gen_toks: int = 256,
        batch_size: Any = None,  # lm-eval passes these; the engine batches by cache.max_batch instead
        max_batch_size: Any = None,
        device: str | None = None,  # lm-eval's --device (default cuda:0); the recipe's model.device decides
        **overrides: Any,
    ):
        super().__init__()
        unknown = [key for key in overrides if "." not in key]
        if unknown:
            raise RecipeError(
                f"qwen-mtp model_args: unknown argument {unknown[0]!r}; give recipe=PATH, max_gen_toks=N, or recipe "
                "keys as section.key=value"
            )
        sets = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]  # YAML reads JSON values
        loaded_recipe = load_recipe(recipe, tuple(sets))
        if loaded_recipe.parallel.tp != 1:
            raise RecipeError(
                f"parallel.tp={loaded_recipe.parallel.tp}: the qwen-mtp lm-eval model runs one engine in this "
                "process; for tensor parallel, serve the recipe (qwen-mtp serve) and evaluate it with lm-eval's "
                "local-completions model (docs/serving.md)"
            )
        self.engine = Engine.from_recipe(loaded_recipe)
        if self.engine.tokenizer is None:
            raise RecipeError("qwen-mtp under lm-eval needs a checkpoint with a tokenizer (tasks are text)")
        self.tokenizer = self.engine.tokenizer
        self.output_text = output_decoder(self.tokenizer)
        self.max_gen_toks = int(max_gen_toks)
        self.max_length = self.engine.config.max_position_embeddings

    # ---- what TemplateLM needs -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return min(self.engine.eos_ids)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "qwen-mtp")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.engine.encode(string)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ---- scoring ---------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """Each (context, continuation) as one prompt: the sum of the continuation's prompt log-probabilities,
        and whether every continuation token was the most likely one. Over-long inputs keep their end."""
        prompts, spans = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-self.max_length :]
            prompts.append(whole)
            spans.append(min(len(continuation), len(whole) - 1))
        params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
        scores = []
        for result, span in zip(self._run([(p, params) for p in prompts]), spans, strict=True):
            entries = result.prompt_logprobs[len(result.prompt_logprobs) - span :]
            logprob = sum(e.logprob for e in entries)
            greedy = all(e.top and e.top[0][0] == e.token_id for e in entries)
            scores.append((logprob, greedy))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole string's log-likelihood, in disjoint windows of the model's context (lm-eval's own split)."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length - 1, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    # ---- generation ------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs, stops = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample is not False else 0.0
            params = SamplingParams(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=float(kwargs.pop("top_p", 1.0)),
                top_k=int(kwargs.pop("top_k", 0)),
                repetition_penalty=float(kwargs.pop("repetition_penalty", 1.0)),
                seed=kwargs.pop("seed", None),
                stop=until,
            )
            if kwargs:
                raise RecipeError(f"qwen-mtp: generation arguments it cannot honour: {sorted(kwargs)}")
            prompt = self.tok_encode(context)[-(self.max_length - max_new) :]
            jobs.append((prompt, params))
            stops.append(until)
        outputs = []
        for result, until in zip(self._run(jobs), stops, strict=True):
            text = TextAssembler(self.output_text, until)  # the text before the first stop string
            outputs.append(text.push(result.token_ids) + text.finish())
        return outputs

    def _run(self, jobs: list[tuple[list[int], SamplingParams]]) -> list[Result]:
        """Every job as one continuous batch; results in job order. A failed request raises."""
        engine = self.engine
        for prompt, params in jobs:  # every job checked before any is queued
            engine.check_request(prompt, params)
        ids = [engine.submit(prompt, params) for prompt, params in jobs]
        try:
            while engine.has_unfinished():
                engine.step()
        finally:
            for request_id in ids:
                engine.cancel(request_id)  # no-op for the finished ones; frees the rest when interrupted
        results = [engine.result(i) for i in ids]
        failed = next((r for r in results if r.finish_reason == "error"), None)
        if failed is not None:
            raise RuntimeError(f"qwen-mtp: generation failed: {failed.error}") from failed.error
        return results
