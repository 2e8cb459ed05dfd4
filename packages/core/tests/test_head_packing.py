"""How many query heads of a KV group a tile holds (``tiling.pack_heads``), for every group the models' shards
have: the policies' measured packing where it fills the rows, else the packing that wastes the fewest."""

from __future__ import annotations

import pytest
import torch
from pagedprefill.tiling import (
    PACKING_TOLERANCE,
    ProblemShape,
    TileConfig,
    launch_grid,
    pack_heads,
    packing_score,
    row_efficiency,
)


def shape(group: int, tokens_per_seq: int, seqs: int = 8, kv_heads: int = 8) -> ProblemShape:
    return ProblemShape(head_size=128, num_heads=group * kv_heads, num_kv_heads=kv_heads, dtype=torch.bfloat16,
                        num_tokens=tokens_per_seq * seqs, num_seqs=seqs, max_query_len=tokens_per_seq)


def rows_used(s: ProblemShape, heads: int, block_m: int = 128) -> float:
    """The share of rows holding a (token, head) pair, counted from the launch grid itself: a check of
    ``row_efficiency`` independent of its formula."""
    config = TileConfig(block_m=block_m, heads_per_tile=heads)
    tokens = s.num_tokens // s.num_seqs
    tiles_per_seq = -(-tokens // config.tokens_per_tile)
    _, heads_programs, _ = launch_grid(s, config)
    return s.num_tokens * s.num_heads / (s.num_seqs * tiles_per_seq * heads_programs * block_m)


@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("tokens", [1, 4, 128, 1000, 1024, 2048])
def test_row_efficiency_counts_the_rows_the_launch_grid_fills(group, tokens):
    s = shape(group, tokens)
    for heads in range(1, group + 1):
        assert row_efficiency(s, 128, heads) == pytest.approx(rows_used(s, heads)), heads


@pytest.mark.parametrize("group", [3, 5, 7])
def test_groups_no_preferred_packing_divides_leave_the_preferred_packing(group):
    """Two heads per tile leave a group of 3 a quarter of its rows empty (5: a sixth, 7: an eighth). A group of 3
    takes one head per tile (three heads fill 96% of the rows: below the tolerance); 5 and 7 take the whole group
    (98% full, level with one head per tile: the larger count wins)."""
    s = shape(group, 1024)
    assert row_efficiency(s, 128, 2) < PACKING_TOLERANCE
    assert pack_heads(s, 128, preferred=2) == (1 if group == 3 else group)


def test_the_waves_decide_a_group_of_3_on_prefix_cached_rows_and_chunks():
    """On 132 multiprocessors, 1024-token sequences of a group of 3 in tiles of 42 tokens x 3 heads make 1600
    programs: 12 full waves and 16 programs in a 13th (an H100 measured one head per tile 1.09 x); 2048-token
    chunks make 392 programs per sequence, as many waves as one head per tile, so the three heads share each K/V
    tile (1.16 x one head per tile on the models suite's chunked row)."""
    prefix = shape(3, 1024)
    assert packing_score(prefix, 128, 3, 132) < PACKING_TOLERANCE * packing_score(prefix, 128, 1, 132)
    assert pack_heads(prefix, 128, preferred=2, sms=132) == 1
    chunks = shape(3, 2048, seqs=4)
    assert pack_heads(chunks, 128, preferred=2, sms=132) == 3
    assert packing_score(prefix, 128, 2) == row_efficiency(prefix, 128, 2)  # no device: the rows alone


@pytest.mark.parametrize("group", [1, 2, 4, 6, 8, 16])
def test_the_measured_packing_stays_where_it_fills_the_rows(group):
    s = shape(group, 1024)
    assert pack_heads(s, 128, preferred=2) == min(2, group)
    # 128 new tokens: four heads per tile where they divide the group; a group of 6 in chunks of 4 would leave a
    # quarter of its rows empty, in chunks of 2 none
    assert pack_heads(shape(group, 128), 128, preferred=4) == (2 if group == 6 else min(4, group))


@pytest.mark.parametrize("group", [3, 4, 5, 7, 8, 16, 71])
def test_a_decode_row_packs_its_whole_group_into_one_tile(group):
    s = shape(group, 1, kv_heads=1)
    assert pack_heads(s, 128, preferred=4) == group
    assert TileConfig(block_m=128, heads_per_tile=group).tokens_per_tile == 128 // group


def test_the_packing_never_exceeds_the_group_or_the_tile():
    assert pack_heads(shape(1, 1), 128, preferred=4) == 1
    assert pack_heads(shape(200, 1, kv_heads=1), 64, preferred=4) == 64
    assert pack_heads(shape(3, 1024), 16, preferred=0) in (1, 2, 3)
