"""``pagedprefill tune``'s sweep on the CPU: a stand-in backend and a stand-in timer (the real timer needs a GPU),
so that what the sweep decides from its timings is checked, not the timings themselves."""

from __future__ import annotations

import itertools

import pagedprefill.api
import pytest
import torch
import triton.testing
from pagedprefill.cli.tune import tune
from pagedprefill.tiling import TileConfig
from pagedprefill.timing import alternating_rounds


def test_alternating_rounds_reverse_the_order_every_other_round():
    calls = []
    clock = itertools.count()

    def time_one(fn):
        calls.append(fn())
        return float(next(clock))  # a device that slows down steadily while it is measured

    times = alternating_rounds([lambda: "a", lambda: "b", lambda: "c"], 4, time_one)
    assert calls == list("abccbaabccba")
    assert times == [[0.0, 5.0, 6.0, 11.0], [1.0, 4.0, 7.0, 10.0], [2.0, 3.0, 8.0, 9.0]]
    # The drift falls on all three alike: the same total over the rounds.
    assert {sum(t) for t in times} == {22.0}
    with pytest.raises(ValueError, match="rounds: expected at least 1, got 0"):
        alternating_rounds([lambda: None], 0, time_one)


SLOW = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, heads_per_tile=1)
FAST = SLOW.with_(block_n=64)
WRONG = SLOW.with_(num_stages=3)


class StandIn:
    """A backend whose tiles differ only in their (stand-in) speed; one of them computes a wrong result."""

    def __init__(self):
        self.reference = pagedprefill.api.get_registry().get("reference")

    def search_space(self, shape, device):
        return [SLOW, WRONG, FAST]

    def run_tile(self, problem, config, device):
        if problem.q.shape[0] > 1000:  # the timed batch: nothing is timed for real
            return config
        self.reference.run(problem, device)
        if config == WRONG:
            problem.out.add_(1.0)
        return config


def sweep(monkeypatch, time_tile) -> tuple[dict, list[str]]:
    """``tune`` over :class:`StandIn`'s tiles in three rounds, each tile's timing given by ``time_tile(tile)``;
    the result and the log lines."""
    backend = StandIn()

    class Registry:
        def get(self, name):
            return backend

    monkeypatch.setattr(pagedprefill.api, "get_registry", lambda: Registry())
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: time_tile(fn()))
    lines = []
    result = tune("standin", [64], ["bf16"], ["long"], torch.device("cpu"), log=lines.append, rounds=3)
    return result, lines


def test_the_sweep_drops_a_wrong_tile_and_keeps_the_fastest_median(monkeypatch):
    slowdown = itertools.count()
    # FAST is faster in every round, and the clock drifts by more than the difference between them.
    result, lines = sweep(monkeypatch, lambda tile: (1.0 if tile == FAST else 1.2) + 0.5 * next(slowdown))
    assert list(result["entries"].values()) == [FAST]
    assert any("rejected: AssertionError" in line and "'num_stages': 3" in line for line in lines), lines
    assert sum("(rounds " in line for line in lines) == 2, lines
    # FAST leads by 0.7 ms at the median, but its own rounds spread 2 ms with the drift.
    assert [r[3] for r in result["report"]] == [False]
    assert any("more --rounds would separate them" in line for line in lines), lines


def test_the_sweep_says_when_the_winner_stands_clear_of_its_rounds_spread(monkeypatch):
    jitter = itertools.cycle([0.0, 0.01, 0.02])
    result, lines = sweep(monkeypatch, lambda tile: (1.0 if tile == FAST else 1.2) + next(jitter))
    assert [(r[2], r[3]) for r in result["report"]] == [(FAST, True)]
    assert not any("separate them" in line for line in lines), lines
