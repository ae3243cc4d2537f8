"""`benchmarks/mixed_steps.py`'s decode rate after a burst: the tokens of the steps after the last first token
over that time, so a mode whose first tokens are spread (unpacked prefill) is not flattered by the tokens its
early requests decoded before the window."""

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def mixed_steps():
    return benchmark_module("mixed_steps")


def test_only_steps_after_the_last_first_token_count(mixed_steps):
    # Steps at t = 1..6 s: the last first token came with the step at t = 3 (its tokens are the window's start).
    steps = [(1.0, 5), (2.0, 9), (3.0, 4), (4.0, 8), (5.0, 8), (6.0, 8)]
    assert mixed_steps.decode_rate(steps, since=3.0, end=6.0) == pytest.approx(24 / 3)


def test_no_rate_without_steps_after_the_window_opens(mixed_steps):
    assert mixed_steps.decode_rate([(1.0, 3), (2.0, 3)], since=2.0, end=2.0) is None
    assert mixed_steps.decode_rate([(1.0, 3)], since=1.0, end=2.0) is None
