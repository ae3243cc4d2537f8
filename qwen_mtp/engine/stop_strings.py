"""Stop strings (`SamplingParams.stop`): whether the token just appended makes a request's detokenized output
contain one of them, and the text a finished request returns.

Semantics: after each output token (in order, also inside a verify's accepted tokens) the output text is
checked; the first token after which some stop string occurs in it ends the request (finish_reason "stop"). That
token is the last of `token_ids`; the returned text is the output's text up to the first occurrence of any stop
string, the stop string excluded (as the OpenAI API returns it). Only generated text is searched, never the prompt.
MTP on or off, the check sees the same tokens one by one, so both cut at the same token.

The check decodes only the output's last `4 * longest + 4` tokens: an occurrence that the newest token completes
spans at most 4 bytes per character, each token carrying at least one byte, and a few tokens more let a
character cut at the window's start decode before the occurrence begins (Qwen's byte-level BPE decodes locally).
"""

from __future__ import annotations

from collections.abc import Callable

from qwen_mtp.engine.request import Request


def completes_stop_string(request: Request, decode: Callable[[list[int]], str]) -> bool:
    """True if the request's output, with its newest token, contains one of its stop strings."""
    stops = request.params.stop
    window = 4 * max(len(s) for s in stops) + 4
    tail = request.tokens[max(len(request.prompt), len(request.tokens) - window) :]
    text = decode(tail)
    return any(s in text for s in stops)


def cut_at_stop_string(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first occurrence of any stop string (all of it when none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text
