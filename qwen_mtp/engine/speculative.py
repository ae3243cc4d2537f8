"""Greedy MTP speculation: draft K tokens with the model's MTP head, verify them in one packed target forward,
accept the longest matching prefix plus a bonus token, and commit the GDN state by index.

Per running request, between steps: `num_computed = n` target positions are cached, the last emitted token
`t_n` is not yet consumed, and `drafts = [d1..dK]` guess the tokens at n+1..n+K.

    verify   target over [t_n, d1..dK] at positions n..n+K   -> hidden H_0..H_K, argmax a_0..a_K
    accept   j = longest prefix with d_i == a_{i-1}; emit d1..dj and the bonus a_j
    commit   SSM slot j and conv offset j (written by the verify itself); attention KV rolls back by length
    catch-up MTP over positions n..n+K with (a_i, H_i): rewrites the MTP KV of the accepted positions from the
             target's hidden states (draft-chain entries there were provisional); its output at index j drafts
             d1 of the next step
    chain    d_k (k >= 2) from the MTP's own post-norm output and d_{k-1}, one position further each time

The emitted tokens are always the target's argmax, so the output equals plain greedy decoding whenever the
verify computes each position as a 1-token decode does (batch-invariant ops; see runner.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from qwen_mtp.engine.request import Request, SpecStats
from qwen_mtp.engine.runner import Runner, StepBatch, StepKind


class Speculator:
    def __init__(self, runner: Runner, k: int, draft: str = "head", oracle_accept: float = 1.0, seed: int = 0):
        self.runner, self.k = runner, k
        self.draft_mode, self.oracle_accept, self.seed = draft, oracle_accept, seed
        self.totals = SpecStats(k)  # every verify step of every request, for Engine.stats()
        self._rngs: dict[int, random.Random] = {}

    def start(self, request: Request) -> None:
        request.spec = SpecStats(self.k)
        # Oracle choices are seeded per request, so they never depend on the batch.
        self._rngs[request.id] = random.Random(f"{self.seed}:{request.id}")

    def forget(self, request: Request) -> None:
        self._rngs.pop(request.id, None)

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill_chunk(self, request: Request, start: int, hidden: torch.Tensor, first_token: int | None) -> None:
        """Fill the MTP KV for a prompt chunk's positions from the target's hidden states [1, T, H]. On the
        last chunk (`first_token` given, the request still running) also draft for the first verify."""
        length = hidden.shape[1]
        following = request.prompt[start + 1 : start + length + 1]
        if first_token is not None:
            following = following + [first_token]
        batch = self.runner.batch(StepKind.PREFILL, [request], [following], [start])
        mtp_hidden = self.runner.prefill_mtp(batch, hidden)
        if first_token is not None:
            chain = self._chain_batch([request], StepKind.PREFILL)
            first = torch.tensor([request.num_computed], device=hidden.device)
            drafts = self.runner.chain(chain, mtp_hidden[:, -1], first, *self._overrides([request], hidden.device))
            request.drafts = drafts.tolist()[0]

    # ---- decode --------------------------------------------------------------------------------------------
    def verify(self, requests: list[Request]) -> tuple[list[list[int]], _Verified]:
        """One packed target forward over [t_n, d1..dK] per request; commits each request's state at its
        accepted boundary. Returns the tokens each request gains (accepted drafts + bonus), uncut by EOS or
        max_new_tokens, and what `propose` needs."""
        starts = [r.num_computed for r in requests]
        tokens = [[r.tokens[r.num_computed]] + r.drafts for r in requests]
        batch = self.runner.batch(StepKind.DECODE, requests, tokens, starts)
        hidden, argmax = self.runner.decode(batch)  # [B, K+1, H], [B, K+1]
        argmax = argmax.tolist()  # the verify's one host sync
        gained, accepted = [], []
        for request, row in zip(requests, argmax, strict=True):
            j = 0
            while j < self.k and request.drafts[j] == row[j]:
                j += 1
            gained.append(request.drafts[:j] + [row[j]])
            accepted.append(j)
            request.num_computed += j + 1
            request.spec.record(j)
            self.totals.record(j)
        self.runner.states.commit(batch.state_rows, torch.tensor(accepted, device=batch.state_rows.device))
        return gained, _Verified(requests, starts, hidden, argmax, accepted)

    def propose(self, verified: _Verified, live: list[Request]) -> None:
        """MTP catch-up over the verified positions, then the draft chain, for the requests still running."""
        if not live:
            return
        keep = [i for i, r in enumerate(verified.requests) if r in live]
        self._chain_batch(live, StepKind.DECODE)  # grows the pages the chain writes
        batch = self.runner.batch(
            StepKind.DECODE,
            live,
            [verified.argmax[i] for i in keep],
            [verified.starts[i] for i in keep],
        )
        device = verified.hidden.device
        accepted = torch.tensor([verified.accepted[i] for i in keep], device=device)
        hidden = verified.hidden[torch.tensor(keep, device=device)]
        drafts = self.runner.draft(batch, hidden, accepted, *self._overrides(live, device)).tolist()
        for request, proposal in zip(live, drafts, strict=True):
            request.drafts = proposal

    def _chain_batch(self, requests: list[Request], kind: StepKind) -> StepBatch:
        """The pages (and a batch for) the draft chain: steps 2..K sit at positions n'..n'+K-2, where n' =
        `num_computed` after the step."""
        last = max(self.k - 1, 1)
        return self.runner.batch(kind, requests, [[0] * last for _ in requests], [r.num_computed for r in requests])

    def _overrides(self, requests: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Oracle mode: the plain-greedy tokens that replace the head's proposals ([B, K]) and where ([B, K]
        bool), each draft replaced with probability `oracle_accept` (seeded per request). The head still runs,
        so a step costs the same."""
        override = [[0] * self.k for _ in requests]
        use = [[False] * self.k for _ in requests]
        if self.draft_mode == "oracle":
            for i, request in enumerate(requests):
                for step in range(self.k):
                    index = request.num_computed + 1 + step - len(request.prompt)  # output index of this draft
                    if request.oracle is None or index >= len(request.oracle):
                        continue
                    if self._rngs[request.id].random() < self.oracle_accept:
                        override[i][step], use[i][step] = request.oracle[index], True
        return torch.tensor(override, device=device), torch.tensor(use, device=device)


@dataclass
class _Verified:
    """What a verify step leaves for the MTP catch-up."""

    requests: list[Request]
    starts: list[int]  # each request's first verified position (n)
    hidden: torch.Tensor  # target hidden [B, K+1, H]
    argmax: list[list[int]]  # target argmax [B][K+1]
    accepted: list[int]  # drafts accepted per request (j)
