"""The order in which a launch's programs take the query tiles: every tile of every sequence exactly once.

A probe kernel runs the kernels' building blocks :func:`~pagedprefill.triton.blocks.program_tile` (index order,
or reversed under ``HEAVY_FIRST`` as the Hopper kernel runs) and :func:`~pagedprefill.triton.blocks.tile_sequence`
for every program of a launch, in Triton's interpreter (a process of its own: ``TRITON_INTERPRET`` must be set
before Triton is imported), on ragged batches: decode rows of one token, sequences without new tokens, long
ones, several tokens per tile, contexts read from their own tensor or from the starts, with and without
``SKIP_DECODE``. What each program took must be what :func:`pagedprefill.tiling.launch_order` computes on the
host, and must cover each query tile of each sequence once (decode rows none under ``SKIP_DECODE``), no program
taking two or a tile taken twice.
"""

from __future__ import annotations

import itertools
import json
import random
import textwrap

import pytest
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.testing.interpreted import run_interpreted
from pagedprefill.tiling import TileConfig, launch_grid, launch_order, problem_shape, query_tile_programs

#: New tokens per sequence of each probed batch.
BATCHES = {
    "ragged": (0, 5, 1, 17, 64, 1, 3, 128, 2),
    "decode": (1, 1, 1, 1),
    "long_and_empty": (300, 0, 1, 0, 77),
    "one_sequence": (9,),
    "empty": (0, 0),
}
TOKENS_PER_TILE = (1, 4, 16, 64)


def cases() -> dict[str, dict]:
    """Every batch with every tile, both orders and both ways of giving the contexts; skip_decode in half of
    them: in index order with the contexts from the starts, in reverse with their own tensor."""
    out = {}
    combos = itertools.product(BATCHES.items(), TOKENS_PER_TILE, (False, True), (False, True))
    for index, ((name, query_lens), tpt, heavy_first, from_starts) in enumerate(combos):
        rng = random.Random(index)
        out[f"{name}-tpt{tpt}-{'heavy' if heavy_first else 'index'}{'-starts' if from_starts else ''}"] = dict(
            query_lens=list(query_lens), context_lens=[rng.choice((0, 1, 15, 700)) for _ in query_lens],
            tokens_per_tile=tpt, heavy_first=heavy_first, context_from_starts=from_starts,
            skip_decode=index % 4 in (1, 2))
    return out


CASES = cases()

PROBE = textwrap.dedent("""
    import json

    import torch
    import triton
    import triton.language as tl
    from pagedprefill.tiling import query_tile_programs
    from pagedprefill.triton.blocks import program_tile, tile_sequence


    @triton.jit
    def probe(query_start, seq_lens, ctx_lens, num_seqs, out, TOKENS_PER_TILE: tl.constexpr,
              HEAVY_FIRST: tl.constexpr, SKIP_DECODE: tl.constexpr, CONTEXT_FROM_STARTS: tl.constexpr):
        program = tl.program_id(0)
        tile = program_tile(program, tl.num_programs(0), HEAVY_FIRST)
        seq, tok0, _, _, _, done = tile_sequence(tile, query_start, seq_lens, ctx_lens, num_seqs, TOKENS_PER_TILE,
                                                 SKIP_DECODE, CONTEXT_FROM_STARTS)
        tl.store(out + program * 3, seq)
        tl.store(out + program * 3 + 1, tok0)
        tl.store(out + program * 3 + 2, done.to(tl.int32))


    taken = {}
    for name, case in json.loads(CASES).items():
        q, c = case["query_lens"], case["context_lens"]
        starts = torch.tensor([0] + q, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([a + b for a, b in zip(q, c)], dtype=torch.int32)
        ctx_lens = torch.tensor(c, dtype=torch.int32)
        programs = query_tile_programs(sum(q), len(q), case["tokens_per_tile"])
        out = torch.full((programs, 3), -7, dtype=torch.int32)
        probe[(programs,)](starts, seq_lens, ctx_lens, len(q), out, case["tokens_per_tile"], case["heavy_first"],
                           case["skip_decode"], case["context_from_starts"])
        taken[name] = out.tolist()
    print("TAKEN", json.dumps(taken))
""")


@pytest.fixture(scope="module")
def probed() -> dict[str, list[list[int]]]:
    """What each program of each case's launch took in the probe kernel: ``[seq, tok0, done]`` per program."""
    proc = run_interpreted(f"CASES = {json.dumps(json.dumps(CASES))}\n" + PROBE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("TAKEN "))
    return json.loads(line[len("TAKEN "):])


def query_tiles(query_lens, tokens_per_tile: int, skip_decode: bool) -> set[tuple[int, int]]:
    """Each sequence's query tiles, by (sequence, first token): the tiles a launch must compute."""
    return {(seq, tok0) for seq, length in enumerate(query_lens) if not (skip_decode and length == 1)
            for tok0 in range(0, length, tokens_per_tile)}


def assert_each_tile_once(order, query_lens, tokens_per_tile: int, skip_decode: bool) -> None:
    taken = [tile for tile in order if tile is not None]
    twice = sorted({tile for tile in taken if taken.count(tile) > 1})
    assert not twice, f"tiles taken by two programs: {twice}"
    expected = query_tiles(query_lens, tokens_per_tile, skip_decode)
    assert set(taken) == expected, (f"tiles no program took: {sorted(expected - set(taken))}; "
                                    f"taken but not a query tile: {sorted(set(taken) - expected)}")


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernels_order_is_the_hosts_and_takes_every_tile_once(probed, name):
    case = CASES[name]
    got = [None if done else (seq, tok0) for seq, tok0, done in probed[name]]
    expected = launch_order(case["query_lens"], case["tokens_per_tile"], case["heavy_first"], case["skip_decode"])
    assert got == expected, f"{name}: the kernel's order differs from launch_order's"
    assert_each_tile_once(got, case["query_lens"], case["tokens_per_tile"], case["skip_decode"])


def test_heavy_first_reverses_the_index_order():
    for query_lens, tpt in itertools.product(BATCHES.values(), TOKENS_PER_TILE):
        assert launch_order(query_lens, tpt, heavy_first=True) == launch_order(query_lens, tpt)[::-1]
    # The last sequence's last tile first, each sequence's tiles from its last token down.
    assert launch_order((3, 12), 8, heavy_first=True) == [(1, 8), (1, 0), (0, 0)]
    assert launch_order((3, 12), 4, heavy_first=True) == [None, (1, 8), (1, 4), (1, 0), (0, 0)]  # 12 / 4: one surplus


@pytest.mark.parametrize("seed", range(20))
def test_the_hosts_order_takes_every_tile_once_on_random_batches(seed):
    rng = random.Random(seed)
    query_lens = [rng.choice((0, 1, 1, 2, rng.randrange(1, 300))) for _ in range(rng.randrange(1, 12))]
    tpt = rng.choice((1, 2, 3, 16, 64, 128))
    for heavy_first, skip_decode in itertools.product((False, True), repeat=2):
        order = launch_order(query_lens, tpt, heavy_first, skip_decode)
        assert len(order) == query_tile_programs(sum(query_lens), len(query_lens), tpt)
        assert_each_tile_once(order, query_lens, tpt, skip_decode)


def test_the_checks_catch_a_dropped_and_a_repeated_tile():
    order = launch_order((5, 1, 3), 2)
    with pytest.raises(AssertionError, match="no program took"):
        assert_each_tile_once(order[1:], (5, 1, 3), 2, False)
    with pytest.raises(AssertionError, match="taken by two programs"):
        assert_each_tile_once(order + order[:1], (5, 1, 3), 2, False)


def test_the_launch_has_as_many_programs_as_its_grid():
    problem = make_problem(BatchSpec(query_lens=(3, 1, 20), context_lens=(5, 0, 9)))
    config = TileConfig(block_m=16, block_n=16, heads_per_tile=1)
    programs = launch_grid(problem_shape(problem), config)[0]
    assert len(launch_order((3, 1, 20), config.tokens_per_tile)) == programs


def test_lengths_it_cannot_order_are_refused():
    with pytest.raises(ValueError, match="tokens_per_tile"):
        launch_order((3,), 0)
    with pytest.raises(ValueError, match="query_lens"):
        launch_order((3, -1), 4)
