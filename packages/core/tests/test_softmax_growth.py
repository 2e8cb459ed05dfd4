"""Core's online-softmax step with a growth threshold (``softmax_step(..., MAX_GROWTH=8)``, what the Hopper
kernel's ``LAZY_RESCALE`` runs): a row's running max moves only when a tile's maximum passes it by more than the
threshold, the accumulator is rescaled only on tiles where some row's max moved (the consumers' vote), and the
normalised result is the exact softmax's.

The kernel below walks tiles of logits and values the way a consumer does; it runs in Triton's interpreter in a
child process (``TRITON_INTERPRET=1`` is read when Triton is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROWS, KEYS, HEAD, TILES = 16, 16, 16, 8


def run_walk(max_growth: float) -> dict:
    """The walk's output, the exact softmax's, and per tile whether the accumulator was rescaled and the largest
    probability, as the child reports them."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, str(max_growth)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("max_growth", [0.0, 8.0])
def test_walk_matches_the_exact_softmax(max_growth):
    got = run_walk(max_growth)
    assert got["max_abs_err"] < 2e-5, got
    assert got["largest_p"] <= 2.0 ** max_growth * (1 + 1e-6), got


def test_threshold_skips_the_rescale_on_tiles_where_no_max_moved_far():
    exact, lazy = run_walk(0.0), run_walk(8.0)
    # The logits climb by about 2 (log2 units) per tile, with one jump of 20 at tile 5: every tile moves some
    # row's max exactly, only the first tile, the jump and the tile a climb of 8 has accumulated take it lazily.
    assert all(exact["rescaled"][1:]), exact
    assert lazy["rescaled"][0] and lazy["rescaled"][5], lazy
    assert sum(lazy["rescaled"]) <= 4, lazy
    assert lazy["p_above_one"], lazy  # stale maxima leave probabilities above 1, below 2^8


if __name__ == "__main__":
    # The kernel at module level: a JIT function resolves the names it calls among its module's globals.
    import torch
    import triton
    import triton.language as tl
    from pagedprefill.triton.blocks import softmax_step

    @triton.jit
    def walk(logits, values, out, rescaled, largest, TILES: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
             HEAD: tl.constexpr, MAX_GROWTH: tl.constexpr):
        rows = tl.arange(0, ROWS)
        keys = tl.arange(0, KEYS)
        cols = tl.arange(0, HEAD)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD], tl.float32)
        for t in range(TILES):
            s = tl.load(logits + rows[:, None] * (TILES * KEYS) + t * KEYS + keys[None, :])
            v = tl.load(values + (t * KEYS + keys[:, None]) * HEAD + cols[None, :])
            m_old = m_i
            p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, 1.0, False, MAX_GROWTH)
            moved = tl.max((m_i != m_old).to(tl.int32), 0)
            if moved > 0:
                acc = acc * alpha[:, None]
            tl.store(rescaled + t, moved)
            tl.store(largest + t, tl.max(tl.max(p, 1), 0))
            acc += tl.dot(p, v, input_precision="ieee")
        tl.store(out + rows[:, None] * HEAD + cols[None, :], acc / l_i[:, None])

    max_growth = float(sys.argv[1])
    gen = torch.Generator().manual_seed(7)
    climb = 2.0 * torch.arange(TILES, dtype=torch.float32).repeat_interleave(KEYS)
    climb[5 * KEYS:] += 20.0
    logits = torch.randn(ROWS, TILES * KEYS, generator=gen) + climb
    values = torch.randn(TILES * KEYS, HEAD, generator=gen)
    out = torch.empty(ROWS, HEAD)
    rescaled = torch.zeros(TILES, dtype=torch.int32)
    largest = torch.zeros(TILES)
    walk[(1,)](logits, values, out, rescaled, largest, TILES, ROWS, KEYS, HEAD, max_growth)
    # The logits are log2-domain: the exact softmax of 2 ** s.
    expect = torch.softmax(logits.double() * torch.log(torch.tensor(2.0, dtype=torch.float64)), 1) @ values.double()
    print(json.dumps(dict(max_abs_err=(out.double() - expect).abs().max().item(),
                          rescaled=[bool(r) for r in rescaled.tolist()], largest_p=largest.max().item(),
                          p_above_one=bool((largest > 1.0).any()))))
