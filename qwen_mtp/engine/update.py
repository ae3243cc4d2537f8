"""The one writer of request state. After a step's results are read back, `RequestUpdater.apply` is the only
code that advances `num_computed`, appends output tokens (and their logprobs), stores the next drafts, and
finishes requests (EOS, a stop token, a stop string, a structured output complete or `max_new_tokens`, cut
exactly where plain decoding stops, token by token also inside a verify's accepted tokens; or the error a step
raised), and advances a structured output's matcher by each emitted token; `finish`
(called by it and by `Engine.cancel`) is the only code that ends a request and gives back its pages and row.
The scheduler's one write is admission (waiting -> running); the runner and the speculator write nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qwen_mtp.engine.request import Request, Status
from qwen_mtp.engine.stop_strings import completes_stop_string
from qwen_mtp.errors import RequestError


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (`SamplingParams.logprobs` / `prompt_logprobs`), on the unfiltered,
    temperature-1 distribution as the OpenAI API reports them: the token at the position, its log-probability,
    and the `n` most likely tokens with theirs (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Update:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


@dataclass
class Outcome:
    """What one step did for one request, as read back from the device."""

    request: Request
    computed: int = 0  # positions the target consumed
    tokens: tuple[int, ...] | list[int] = ()  # tokens emitted, before any cut
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when the request asks
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt positions a prefill chunk scored
    drafts: list[int] | None = None  # the next verify's drafts
    accepted: int | None = None  # drafts the verify accepted
    drafted: int = 0  # real drafts the verify checked (a step's K, less the fillers of a request that had fewer)
    error: BaseException | None = None  # the step raised: the request ends with finish_reason "error"


class RequestUpdater:
    def __init__(
        self,
        eos_ids: Callable[[], set[int]],
        release: Callable[[Request], None],
        record_acceptance: Callable[[Request, int, int], None],
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.eos_ids, self.release, self.record_acceptance = eos_ids, release, record_acceptance
        self.decode = decode  # the tokenizer's, for stop strings (requests with stop strings need one)

    def apply(self, outcomes: list[Outcome]) -> list[Update]:
        """Write each outcome into its request; returns the new tokens of every request that got some or ended."""
        eos = self.eos_ids()
        updates = []
        for outcome in outcomes:
            request = outcome.request
            if request.done:
                continue  # cancelled while its step ran
            if outcome.error is not None:
                self.finish(request, "error", outcome.error)
                updates.append(Update(request.id, [], True, "error"))
                continue
            request.num_computed += outcome.computed
            if outcome.accepted is not None:
                self.record_acceptance(request, outcome.accepted, outcome.drafted)
            if outcome.prompt_logprobs is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(outcome.prompt_logprobs)
            new = self._append(request, outcome.tokens, eos, outcome.logprobs)
            if outcome.drafts is not None:
                request.drafts = outcome.drafts
            if new or request.done:
                logprobs = None if request.logprobs is None else request.logprobs[len(request.logprobs) - len(new) :]
                updates.append(Update(request.id, new, request.done, request.finish_reason, logprobs))
        return updates

    def _append(self, request: Request, tokens, eos: set[int], logprobs: list[TokenLogprob] | None = None):
        """Append tokens, cutting exactly where plain decoding would stop: each token is checked as a 1-token
        decode step would check it, so a verify's accepted tokens end where plain decoding ends."""
        params, new = request.params, []
        for i, token in enumerate(tokens):
            new.append(token)
            request.tokens.append(token)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(logprobs[i])
            may_stop = request.num_output > params.min_tokens  # the first min_tokens tokens end nothing
            if request.grammar is not None and not request.grammar.consume_token(token):
                error = RequestError(
                    f"token {token} does not satisfy the structured output: {request.grammar.get_error()}"
                )
                self.finish(request, "error", error)
            elif request.grammar is not None and request.grammar.is_stopped():  # complete: nothing may follow
                self.finish(request, "stop")
            elif may_stop and ((token in eos and not params.ignore_eos) or token in params.stop_token_ids):
                self.finish(request, "stop")
            elif may_stop and params.stop and completes_stop_string(request, self.decode):
                self.finish(request, "stop")
            elif request.num_output >= params.max_new_tokens:
                self.finish(request, "length")
            if request.done:
                break
        return new

    def finish(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        """End a request ("stop" | "length" | "cancelled" | "error") and give back its pages and state row."""
        request.status = Status.CANCELLED if reason == "cancelled" else Status.FINISHED
        request.finish_reason, request.error = reason, error
        self.release(request)
