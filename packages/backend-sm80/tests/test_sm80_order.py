"""The Hopper kernel's tile order under ``SPREAD_LIGHT`` (:mod:`pagedprefill_sm80.hopper.order`): its Python model
covers every tile of a batch exactly once, spreads the light tiles evenly and keeps each class heaviest first; on
an sm90 GPU the kernel's order equals the model's."""

from __future__ import annotations

import random

import pytest
import torch
from pagedprefill_sm80.hopper.order import spread_order, spread_tile
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TPT, LIGHT = 32, 16


def batch(rng: random.Random, seqs: int) -> list[int]:
    """Cumulative starts of a batch mixing decode, speculative, chunk and empty rows."""
    lens = [rng.choice([0, 1, 1, 4, 8, 16, 17, 33, rng.randint(1, 3000)]) for _ in range(seqs)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return starts


def owned_tiles(starts: list[int]) -> list[tuple[int, int]]:
    """Every (sequence, first token) core's tile index space holds, in index order, done tiles included."""
    tiles = []
    for s in range(len(starts) - 1):
        for i in range(starts[s + 1] // TPT - starts[s] // TPT + 1):
            tiles.append((s, i * TPT))
    return tiles


@pytest.mark.parametrize("seed", range(40))
def test_every_tile_once_light_spread_heaviest_first(seed):
    rng = random.Random(seed)
    starts = batch(rng, rng.randint(1, 300))
    tiles = owned_tiles(starts)
    extra = rng.choice([0, 0, 5])  # a grid larger than the batch
    grid = len(tiles) + extra
    order = spread_order(starts, TPT, LIGHT, grid)
    found = [(s, t) for s, t, ok in order if ok]
    assert sorted(found) == sorted(tiles), "every tile exactly once"
    assert sum(not ok for _, _, ok in order) == extra
    q_len = [starts[s + 1] - starts[s] for s in range(len(starts) - 1)]
    light = [ok and 1 <= q_len[s] <= LIGHT for s, _, ok in order]
    m = sum(light)
    # Spread: among the first p programs, floor(p * m / grid) are light.
    for p in range(grid + 1):
        assert sum(light[:p]) == p * m // grid
    # Each class in descending index order: the end of the batch (a sequence's last tiles) first.
    index = {tile: i for i, tile in enumerate(tiles)}
    for cls in (True, False):
        seen = [index[(s, t)] for (s, t, ok), lt in zip(order, light) if ok and lt == cls]
        assert seen == sorted(seen, reverse=True)


def test_a_batch_of_one_class_keeps_the_reversed_index_order():
    """With no light tile, or nothing but, the order is ``HEAVY_FIRST``'s: the index space reversed."""
    for lens in ([2048, 1000, 50], [1] * 50, [4] * 9):
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        tiles = owned_tiles(starts)
        order = spread_order(starts, TPT, LIGHT, len(tiles))
        assert [(s, t) for s, t, _ in order] == tiles[::-1]


@gluon.jit
def probe(query_start, num_seqs, out, TPT: gl.constexpr, LIGHT: gl.constexpr):
    """Each program's ``spread_tile`` as three integers: sequence, first token, found."""
    pid = gl.program_id(0)
    seq, tok0, found = spread_tile(pid, gl.num_programs(0), query_start, num_seqs, TPT, LIGHT, 4)
    gl.store(out + pid * 3, seq)
    gl.store(out + pid * 3 + 1, tok0)
    gl.store(out + pid * 3 + 2, found.to(gl.int32))


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _sm90(), reason="needs an sm90 GPU: Gluon kernels do not run in Triton's interpreter")
@pytest.mark.parametrize("seed", range(6))
def test_the_kernels_order_is_the_models(seed):
    rng = random.Random(seed)
    starts = batch(rng, rng.choice([1, 3, 130, 1500]))  # 1500: more sequences than one chunk
    grid = len(owned_tiles(starts)) + rng.choice([0, 3])
    starts_gpu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    out = torch.full((grid, 3), -7, dtype=torch.int32, device="cuda")
    probe[(grid,)](starts_gpu, len(starts) - 1, out, TPT, LIGHT, num_warps=4)
    expect = [(s, t, int(ok)) if ok else (0, 0, 0) for s, t, ok in spread_order(starts, TPT, LIGHT, grid)]
    assert [tuple(row) for row in out.tolist()] == expect
