"""What the penalties of a request read: its output token counts, its prompt's tokens, its logit bias and its stop
tokens (`min_tokens`), on the device, by state row.

A penalized request's token at position p depends on the tokens it emitted before p (`ops/penalties.py`). With
MTP on, a verify chooses K+1 positions at once, and the step after it may be launched before the host has read
what it accepted (`cache.lookahead`); so the counts live on the device, one row per state-pool row, and the step
that emits tokens adds them there, in stream order, before any later step reads them:

- `start(row, prompt, bias, stops)`: when a request chooses its first token (its prompt's last chunk): counts
  zero, the prompt's tokens marked seen, its logit bias and stop tokens written.
- `count(rows, tokens, accepted)`: after a decode (one token per row) or a verify (tokens c_0..c_K, of which
  c_0..c_j are emitted, j the accepted drafts), add the emitted tokens.
- `inputs(rows, positions, tokens)`: what each chosen position reads. Verify position i chooses the token after
  d_i; it matters only when d_1..d_i are all accepted, and then they are the tokens emitted there: so it reads its
  row's counts plus d_1..d_i, which is what plain decoding reads at that position. `inputs_after` does the same for
  a draft chain's steps (the drafts guess what the target will choose, penalties included).

- `neutral(row)`: when a request without penalties chooses its first token on `row`: the bias and stop tokens a
  request before it left there go back to none. A penalized step applies every row's bias (`ops/penalties.py`), and
  a request without penalties shares such steps: a stale bias would steer its tokens.

The counts are integers and every addition is exact, so they are the same whatever order adds them. Rows of
requests without penalties are never started and hold stale counts; their neutral penalties ignore them. The
buffers ([rows + 1, V] int32, float32 and two bool, the scratch row included: ~2.4 MiB a row at a 248k vocabulary)
are made with the runner; only steps with a penalized request touch them (`sampling.Mode.penalized`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PenaltyInputs(NamedTuple):
    """What `qwen_mtp::apply_penalties` reads besides the logits and the per-request values: the count, prompt, bias
    and stop buffers, the state row of each logit row [R], the drafts counted before each logit row's position
    [R, D] (-1: none), and the position each logit row chooses [R]."""

    counts: torch.Tensor
    seen: torch.Tensor
    bias: torch.Tensor
    stops: torch.Tensor
    rows: torch.Tensor
    drafts: torch.Tensor
    positions: torch.Tensor


class PenaltyState:
    def __init__(self, rows: int, vocab: int, device: torch.device | str):
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.marked: set[int] = set()  # rows whose bias or stop tokens a request set (host-side: no device read)

    def start(
        self, row: int, prompt: torch.Tensor, bias_ids: torch.Tensor, bias: torch.Tensor, stops: torch.Tensor
    ) -> None:
        """A request's state row before its first token: no output yet; `prompt` [P] (long, on the device) seen;
        the bias of tokens `bias_ids` [N] (long) is `bias` [N] (float32), 0 elsewhere; `stops` [M] (long) its stop
        tokens."""
        self.counts[row] = 0
        self.seen[row] = False
        self.seen[row, prompt] = True
        self.bias[row] = 0.0
        self.bias[row, bias_ids] = bias
        self.stops[row] = False
        self.stops[row, stops] = True
        if bias_ids.numel() or stops.numel():
            self.marked.add(row)
        else:
            self.marked.discard(row)

    def neutral(self, row: int) -> None:
        """A request without penalties takes state row `row`: no logit bias and no stop tokens there (device work
        only if a request before it set some)."""
        if row in self.marked:
            self.bias[row] = 0.0
            self.stops[row] = False
            self.marked.discard(row)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor | None = None) -> None:
        """Add the tokens a step emitted: `tokens` [B, T] chosen for the requests on `rows` [B]; with
        `accepted` [B] (a verify) only tokens 0..accepted[b] of row b, else all of them."""
        width = tokens.shape[1]
        emitted = torch.ones_like(tokens, dtype=torch.int32)
        if accepted is not None:
            emitted = (torch.arange(width, device=tokens.device)[None, :] <= accepted[:, None]).int()
        self.counts.index_put_((rows[:, None].expand_as(tokens), tokens), emitted, accumulate=True)

    def inputs_after(self, rows: torch.Tensor, positions: torch.Tensor, before: torch.Tensor) -> PenaltyInputs:
        """For one position [B] each, after the tokens `before` [B, S] that are not counted yet (a draft chain's
        earlier drafts: the drafts guess what the target will choose there, so they count what it would)."""
        return PenaltyInputs(self.counts, self.seen, self.bias, self.stops, rows, before, positions)

    def inputs(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None = None) -> PenaltyInputs:
        """For the T positions [B, T] (or [B]) a step over `tokens` [B, T] chooses (request b on state row rows[b];
        None: one position each): position i counts tokens[b, 1..i] (the drafts before it) on top of its row's
        counts."""
        buffers = (self.counts, self.seen, self.bias, self.stops)
        if tokens is None or tokens.shape[1] == 1:
            return PenaltyInputs(*buffers, rows, rows.new_empty(rows.shape[0], 0), positions.reshape(-1))
        count, width = tokens.shape
        position, draft = torch.arange(width, device=tokens.device), torch.arange(width - 1, device=tokens.device)
        before = position[:, None] > draft[None, :]  # [T, T-1]: d_(l+1) precedes position i
        drafts = torch.where(before, tokens[:, None, 1:], -1)  # [B, T, T-1]
        rows = rows[:, None].expand(count, width).reshape(-1)  # (no repeat_interleave: nothing that may sync)
        drafts = drafts.reshape(count * width, -1)
        return PenaltyInputs(*buffers, rows, drafts, positions.reshape(-1))
