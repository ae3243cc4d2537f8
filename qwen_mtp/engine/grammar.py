"""Structured outputs: the grammar a request's output must match (`SamplingParams.structured`), as an llguidance
matcher per request on the host and a mask of allowed tokens per chosen position on the device.

Why llguidance (https://github.com/guidance-ai/llguidance): it compiles JSON schemas, regular expressions and Lark
grammars against the tokenizer's own vocabulary, computes a token mask in microseconds on the host, and rolls a
matcher back by tokens, which speculation needs; it is a Rust extension with no Python dependencies (vLLM's
"guidance" backend). The masks are bitmasks, 32 tokens to an int32 word (its layout), applied on the device by
`apply_token_mask`.

Exact under MTP. The token at position p of a constrained request is chosen from the logits at p with every token
the grammar forbids after the output before p at -inf (then penalties, temperature, filters and noise as ever:
`sampling.choose`). Plain decoding makes that mask from the tokens it emitted. A verify over [t_n, d1..dK] gives
position i the mask after the output plus d1..di (consumed, the mask computed, rolled back: `Grammars.masks`).
Position i matters only when d1..di are all accepted; each accepted d_l equals c_(l-1), which was chosen under
position l-1's mask, so the grammar allows it there, and the verify's mask at i is plain decoding's. From the
first draft the grammar refuses on, positions are never emitted, and get no mask. The masks come from tokens the
host has read, so a step with a constrained request is never launched ahead of the one before it
(`cache.lookahead`), and the draft chain is not masked (drafts change acceptance only, never a token).

The matcher is request state: the engine makes it at submit (`Grammars.matcher`, where a grammar that cannot be
compiled is a `RequestError`) and `update.py` alone advances it, token by token as tokens are emitted.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from qwen_mtp.engine.params import StructuredOutput
from qwen_mtp.errors import RequestError

if TYPE_CHECKING:
    from qwen_mtp.engine.request import Request

WORD_BITS = 32  # tokens per mask word (llguidance's bitmask layout: bit t % 32 of word t // 32)
# `StructuredOutput.any_whitespace: false`: llguidance's JSON options for one-line JSON
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab: int) -> int:
    return -(-vocab // WORD_BITS)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as err:  # a dependency of the package: only a broken install lacks it
        raise RequestError(f"structured outputs need llguidance (pip install llguidance): {err}") from None
    return llguidance


# `StructuredOutput.after_thinking`: free text up to the first `</think>` (the shortest match: a lazy rule), the
# newlines after it, then the structure (llguidance's grammar named "answer", referenced as @answer)
THINKING = "start: thinking /\\n*/ @answer\nthinking[lazy]: /(?s:.*)<\\/think>/"


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) of a structured output."""
    text = _structure_text(structured)
    if not structured.after_thinking:
        return text
    # (llguidance takes a Lark grammar as its own text, the other kinds as JSON with a list of grammars)
    answer = json.loads(text)["grammars"] if text.lstrip().startswith("{") else [{"lark_grammar": text}]
    if len(answer) != 1:
        raise RequestError(f"structured output ({structured.kind}): after_thinking takes a grammar of one part")
    thinking = {"name": "thinking", "lark_grammar": THINKING}
    return json.dumps({"grammars": [thinking, {**answer[0], "name": "answer"}]})


def _structure_text(structured: StructuredOutput) -> str:
    matcher = _llguidance().LLMatcher
    kind = structured.kind
    json_options = None if structured.any_whitespace else COMPACT_JSON
    try:
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(structured.json_schema, defaults=json_options)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
        if kind == "regex":
            return matcher.grammar_from_regex(structured.regex)
        if kind == "choice":  # Lark string literals take JSON's escapes
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in structured.choice))
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark  # GBNF (llama.cpp's, xgrammar's) as Lark

        try:
            return matcher.grammar_from_lark(any_to_lark(structured.grammar))
        except GbnfToLarkError as err:
            raise ValueError(f"GBNF: {err}") from None
    except (ValueError, TypeError) as err:
        raise RequestError(f"structured output ({kind}): {err}") from None


class Grammars:
    """Compiles structured outputs against the checkpoint's tokenizer over the model's `vocab` logits (ids past the
    tokenizer's are never allowed), with `eos_ids` the tokens that end an output the grammar has completed."""

    def __init__(self, tokenizer: Any | None, vocab: int, eos_ids: Sequence[int]):
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, sorted(eos_ids)
        self.words = mask_words(vocab)
        self._lltokenizer = None
        self._building = threading.Lock()  # requests are checked on the server's threads too
        self._executor = None  # llguidance's thread pool: a step's masks are computed in parallel

    def _tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("structured outputs need the checkpoint's tokenizer, and this checkpoint has none")
        with self._building:  # built once (a vocabulary's token trie: ~2 s at 248k tokens), at first use
            if self._lltokenizer is None:
                eos = self.eos_ids or None
                self._lltokenizer = _llguidance().hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=eos)
        return self._lltokenizer

    def check(self, structured: StructuredOutput) -> str:
        """The grammar's text, if llguidance can compile it for this tokenizer; else `RequestError` naming the
        problem."""
        grammar = grammar_text(structured)
        problem = _llguidance().LLMatcher.validate_grammar(grammar, self._tokenizer())
        if problem:
            raise RequestError(f"structured output ({structured.kind}) cannot be compiled: {problem.strip()}")
        return grammar

    def matcher(self, structured: StructuredOutput):
        """A fresh matcher for a request's output (`Engine.check_request` has `check`ed it; a grammar that cannot be
        compiled is a `RequestError` here too)."""
        matcher = _llguidance().LLMatcher(self._tokenizer(), grammar_text(structured), log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured output ({structured.kind}) cannot be used: {matcher.get_error()}")
        return matcher

    def masks(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """`token_masks`, computed by llguidance's thread pool (the matchers of a step in parallel: a mask over a
        248k vocabulary is tens of microseconds of host work, and a verify asks K+1 per request)."""
        width = 1 + (len(drafts[0]) if drafts else 0)
        masks = torch.full((len(requests) * width, self.words), -1, dtype=torch.int32)
        rows = [(b, r.grammar) for b, r in enumerate(requests) if r.grammar is not None]
        if rows:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            target = (masks.data_ptr(), self.words * 4, len(masks))
            if width == 1:  # (the draft form refuses empty drafts)
                self._executor.unsafe_compute_mask_ptr([(m, b) for b, m in rows], *target)
            else:
                jobs = [(m, b * width, list(drafts[b])) for b, m in rows]
                self._executor.unsafe_compute_mask_ptr_with_draft_token(jobs, *target)
        return masks.view(len(requests), width, self.words)


def forced_drafts(matcher, drafts: Sequence[int], k: int) -> list[int]:
    """A constrained request's next k drafts: the tokens its grammar forces after its output (llguidance's
    fast-forward tokens: the bytes only one continuation allows, in the tokenizer's own spelling), then the head's
    drafts for the positions after them. Drafts change acceptance only, never a token."""
    forced = matcher.compute_ff_tokens()[:k]
    return forced + list(drafts[len(forced) : k])


def constrained(requests: Sequence[Request]) -> bool:
    return any(r.grammar is not None for r in requests)


def token_masks(requests: Sequence[Request], words: int, drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """The allowed tokens [B, T, words] (int32 bitmasks, on the host) of each request's T chosen positions: the
    grammar's after its output, then after each of `drafts[b]` (T - 1 of them) in turn (module docstring). Rows of
    unconstrained requests, and positions past a draft the grammar refuses, allow every token. One matcher at a
    time: the reference `Grammars.masks` is checked against."""
    width = 1 + (len(drafts[0]) if drafts else 0)
    masks = torch.full((len(requests), width, words), -1, dtype=torch.int32)
    for b, request in enumerate(requests):
        matcher = request.grammar
        if matcher is None:
            continue
        _fill(matcher, masks[b, 0])
        consumed = 0
        for i, token in enumerate(drafts[b] if drafts else ()):
            if matcher.is_stopped() or matcher.try_consume_tokens([token]) != 1:
                break
            consumed += 1
            _fill(matcher, masks[b, i + 1])
        if consumed:
            matcher.rollback(consumed)
    return masks


def _fill(matcher, row: torch.Tensor) -> None:
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def apply_token_mask(logits: torch.Tensor, allowed: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`logits` [..., V] of token ids start..start+V-1 (a tensor-parallel rank's vocabulary shard from `start`) with
    every token not set in `allowed` [..., words] (int32 bitmasks of the whole vocabulary, as many rows as the
    logits, in any layout: a verify's [B, T, words] against its [B * T, V]) at -inf.

    Plain torch, no kernel: it is elementwise (each row and token on its own, so batch-invariant by construction)
    and runs only in steps with a constrained request."""
    vocab = logits.shape[-1]
    rows = allowed.reshape(-1, allowed.shape[-1])
    bits = torch.arange(WORD_BITS, dtype=torch.int32, device=allowed.device)
    keep = ((rows[:, :, None] >> bits) & 1).reshape(rows.shape[0], -1)[:, start : start + vocab]
    if keep.shape[1] < vocab:  # ids past the vocabulary the masks cover (a padded lm_head): never allowed
        keep = torch.nn.functional.pad(keep, (0, vocab - keep.shape[1]))
    return logits.masked_fill(keep.view(logits.shape) == 0, float("-inf"))
