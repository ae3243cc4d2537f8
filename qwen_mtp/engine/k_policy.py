"""K per step (`mtp.k: auto`): how many drafts the running batch verifies next. The choice maximises expected
tokens per second, from the acceptance per draft position measured so far and the verify and draft step times
of the batch's bucket at each K (measured at warm-up); K = 0 is a plain decode step.

Expected tokens of a step with K drafts: E(K) = 1 + sum_{i<=K} a_1 * ... * a_i, with a_i the acceptance of draft
i given that the drafts before it were accepted. A step costs T(K) = verify(K) + draft(K) for the whole batch,
so the batch's tokens per second are B * E(K) / T(K): the best K does not depend on B beyond T's bucket.
Whatever K is chosen, the tokens are the target's: K changes only the speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimes:
    """Seconds per step at one batch bucket, indexed by K = 0..max_k: `verify[K]` the target over K+1 tokens
    per request, `draft[K]` the MTP catch-up over those K+1 positions plus a K-draft chain."""

    verify: tuple[float, ...]
    draft: tuple[float, ...]

    def step(self, k: int) -> float:
        return self.verify[k] + self.draft[k]


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(K) = 1 + sum_{i=1..K} prod_{m<=i} a_m: the tokens a step with K drafts emits on average."""
    total, run = 1.0, 1.0
    for rate in acceptance[:k]:
        run *= rate
        total += run
    return total


def best_k(
    acceptance: Sequence[float],
    times: StepTimes,
    current: int | None = None,
    margin: float = 0.02,
    plain_margin: float = 0.03,
) -> int:
    """The K in 0..len(times.verify)-1 with the most expected tokens per second (ties: the smaller K), but plain
    decoding (K = 0) unless speculation is expected to be faster by more than `plain_margin`: the step times
    come from padding rows at warm-up (one scratch page of context, no host work), so a K > 0 that wins by less
    than their error can lose to plain in traffic. The `current` K is kept unless another is faster by more than
    `margin` (a fraction): a change of K costs a step with fewer real drafts (see speculative.py), so noise in
    the figures must not flip it back and forth."""
    rates = [expected_tokens(acceptance, k) / times.step(k) for k in range(len(times.verify))]
    best = max(range(len(rates)), key=lambda k: (rates[k], -k))
    if best > 0 and rates[best] <= rates[0] * (1.0 + plain_margin):
        best = 0
    if current is not None and current < len(rates) and rates[best] <= rates[current] * (1.0 + margin):
        return current
    return best


class AcceptanceAverage:
    """Exponential moving averages of the conditional acceptance a_i of each draft position i = 1..max_k. A
    request's step with `drafted` real drafts and `accepted` of them accepted is one observation of positions
    1..min(accepted + 1, drafted): accepted up to `accepted`, rejected at the next. Positions never tried keep
    the optimistic `prior`, so the policy tries them once and learns.

    Positions that a step does not try (those beyond its K) drift back towards the prior by `relax` per request
    in the step (`untried`). Without that, a stretch of poor acceptance that made the policy choose K = 0 (or a
    small K) would keep it there for good: a step that does not draft at a position observes nothing there, so
    the low figure would never be revised when the text becomes predictable again. The drift per request is 1%
    of an observation's `weight`, so where acceptance really is poor the policy drafts again for a step now and
    then, and that step's observations (one per request) push the figure back down. In a simulation at the 27B
    step times of B1, B8 and B32 this cost at most 1.3% of plain decoding's speed at acceptance 0.02-0.1, and
    after acceptance fell to ~0 and rose to 0.8 the policy was back at the best K within 7 s (docs/development.md)."""

    def __init__(self, max_k: int, prior: float = 0.8, weight: float = 0.02, relax: float = 0.0002):
        self.rates, self.prior, self.weight, self.relax = [prior] * max_k, prior, weight, relax

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(accepted + 1, drafted)):
            hit = 1.0 if i < accepted else 0.0
            self.rates[i] += self.weight * (hit - self.rates[i])

    def untried(self, k: int, count: int) -> None:
        """A step verified K = `k` drafts for each of `count` requests: positions k+1..max_k drift towards the
        prior (by `relax` once per request)."""
        drift = 1.0 - (1.0 - self.relax) ** count
        for i in range(k, len(self.rates)):
            self.rates[i] += drift * (self.prior - self.rates[i])


class KPolicy:
    """`mtp.k: auto`: K for a step of `count` requests, from the running acceptance and the times of the
    bucket that runs it. `times_of(bucket)` measures a bucket's `StepTimes` (on first use, or at warm-up)."""

    def __init__(self, max_k: int, buckets: Sequence[int], times_of: Callable[[int], StepTimes]):
        self.max_k, self.buckets, self.times_of = max_k, sorted(buckets), times_of
        self.acceptance = AcceptanceAverage(max_k)
        self.times: dict[int, StepTimes] = {}
        self.current: int | None = None

    def bucket(self, count: int) -> int:
        return next((size for size in self.buckets if size >= count), self.buckets[-1])

    def measured(self, count: int) -> bool:
        """Whether the times of the bucket that runs `count` requests are known (`choose` needs no measuring)."""
        return self.bucket(count) in self.times

    def measure(self, bucket: int) -> StepTimes:
        if bucket not in self.times:
            self.times[bucket] = self.times_of(bucket)
        return self.times[bucket]

    def choose(self, count: int) -> int:
        times = self.measure(self.bucket(count))
        self.current = best_k(self.acceptance.rates, times, self.current)
        return self.current

    def stepped(self, k: int, count: int) -> None:
        """A verify step of `count` requests at K = `k` ran."""
        self.acceptance.untried(k, count)

    def observe(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(drafted, min(accepted, drafted))

    def forget_acceptance(self) -> None:
        """Start the acceptance figures afresh (the step times are kept): the bench, after a warm-up whose drafts
        were random tokens, so that a row measures the policy at the acceptance it sets."""
        self.acceptance = AcceptanceAverage(self.max_k)
        self.current = None
