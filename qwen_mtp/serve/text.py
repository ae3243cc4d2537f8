"""Tokens -> the text a client sees: incremental detokenization that never emits half a UTF-8 character, and
the cut at a stop string (the stop string itself is not returned, as in the OpenAI API)."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes an incomplete UTF-8 sequence to


def output_decoder(tokenizer) -> Callable[[list[int]], str | None]:
    """Generated tokens -> text without special tokens (an EOS that ended the request is not text), as the
    OpenAI API and lm-eval return it; None without a tokenizer."""
    if tokenizer is None:
        return lambda token_ids: None
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)


class TextAssembler:
    """One choice's output text. `push` returns the text that became final; while a stop string may still be
    forming, its possible beginning is held back. Without a tokenizer (`decode` returns None) the text is ""."""

    def __init__(self, decode: Callable[[list[int]], str | None], stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, stop
        self.tokens: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string was found: nothing more is emitted

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        full = self.decode(self.tokens) or ""
        if not final:
            full = full.rstrip(REPLACEMENT)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            full, self.stopped = full[:cut], True
        elif not final:
            full = full[: len(full) - held_back(full, self.stop)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of `text` that begins one of `stops` (stop strings, or a tag the next text may complete)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
