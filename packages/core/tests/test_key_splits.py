"""Split keys: the rule that decides them and the tile field that carries them.

The walk each split takes and the combine are checked through the kernels' results, by the conformance suite's
split-key cases (``test_split_keys_case_matches_reference``: uneven shares, empty splits, every option the
combine handles) in every backend's tests, in the interpreter and on GPUs.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import (
    MAX_KEY_SPLITS,
    MAX_SPLIT_WAVES,
    SPLIT_WAVE_EFFICIENCY,
    UNSPLIT_WALK_TILES,
    ProblemShape,
    TileConfig,
    key_splits_for,
    launch_grid,
    split_scratch_bytes,
    wave_efficiency,
)

H200 = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0), warp_size=32,
                  num_sms=132, max_shared_mem=227 * 1024, triton_backend="cuda")
TILE = TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, heads_per_tile=4)


def shape(num_seqs: int, tokens_per_seq: int, **changes) -> ProblemShape:
    fields = dict(head_size=128, num_heads=32, num_kv_heads=8, dtype=torch.bfloat16,
                  num_tokens=num_seqs * tokens_per_seq, num_seqs=num_seqs, max_query_len=tokens_per_seq)
    return ProblemShape(**{**fields, **changes})


@pytest.mark.parametrize(("num_seqs", "tokens", "expected"), [
    (4, 1, 4),        # 4 decode rows x 8 KV heads: 32 programs; 4 splits fill one wave to 97%
    (2, 8, 8),        # speculative rows on few sequences: 16 programs
    (1, 256, 5),      # one 256-token chunk: 9 tiles x 8 heads = 72 programs, 5 x 72 = 360 fill 3 waves to 91%
    (16, 1, 1),       # 128 programs: one wave, 97% full already
    (256, 1, 1),      # a full decode batch fills the GPU as it is
    (8, 1024, 1),     # prefill
])
def test_launches_that_cannot_fill_the_gpu_split_their_keys_into_full_waves(num_seqs, tokens, expected):
    s = shape(num_seqs, tokens)
    splits = key_splits_for(s, TILE, H200)
    assert splits == expected
    tiles, heads, _ = launch_grid(s, TILE)
    if splits > 1:  # the fewest splits that fill their waves
        assert wave_efficiency(splits * tiles * heads, H200.num_sms) >= SPLIT_WAVE_EFFICIENCY
        assert all(wave_efficiency(n * tiles * heads, H200.num_sms) < SPLIT_WAVE_EFFICIENCY for n in range(1, splits))
    assert launch_grid(s, TILE.with_(key_splits=splits))[2] == splits


def test_without_a_split_count_that_fills_its_waves_the_best_one_within_the_wave_bound_is_taken():
    one = shape(1, 1, num_kv_heads=1, num_heads=1)  # one program: 32 splits fill a quarter of one wave
    assert key_splits_for(one, TILE, H200) == MAX_KEY_SPLITS
    odd = shape(1, 2048, num_kv_heads=1, num_heads=4, head_size=256)  # 68 programs: the wave bound decides
    tile = TILE.with_(heads_per_tile=1)
    programs = math.prod(launch_grid(odd, tile)[:2])
    splits = key_splits_for(odd, tile, H200)
    allowed = range(1, MAX_SPLIT_WAVES * H200.num_sms // programs + 1)
    assert splits in allowed and wave_efficiency(splits * programs, H200.num_sms) == max(
        wave_efficiency(n * programs, H200.num_sms) for n in allowed)
    assert split_scratch_bytes(odd, splits) <= 4 * MAX_SPLIT_WAVES * H200.num_sms * tile.block_m * (256 + 1)


def test_a_launch_of_no_programs_does_not_split():
    s = shape(0, 0)  # a batch of no sequences: an empty launch, not a division by its zero programs
    assert math.prod(launch_grid(s, TILE)[:2]) == 0
    assert key_splits_for(s, TILE, H200) == 1


def test_a_device_without_multiprocessor_count_never_splits():
    cpu = DeviceInfo.detect(torch.device("cpu"))
    assert key_splits_for(shape(1, 1), TILE, cpu) == 1


@pytest.mark.parametrize("bad", [0, MAX_KEY_SPLITS + 1])
def test_a_tile_refuses_key_splits_outside_its_range(bad):
    with pytest.raises(ValueError, match="key_splits"):
        TileConfig(key_splits=bad)


@pytest.mark.parametrize(("num_seqs", "tokens", "pages", "kv_in_cache", "expected"), [
    (4, 1, 2, True, 1),      # 32 keys of pages of 16: one tile, nothing to split
    (4, 1, 2, False, 1),     # and the new tokens' keys passed apart: a tile of their own, two in all
    (4, 1, 128, True, 1),    # 2048 keys: 16 tiles, a walk shorter than a split launch and its combine cost
    (4, 1, 120, False, 1),   # 15 cached tiles and the new tokens' one
    (4, 1, 129, True, 4),    # 17 tiles: the wave rule decides (4 decode rows x 8 KV heads, 4 splits)
    (1, 1, 160, True, 20),   # one row of two KV heads would take 32 splits; 20 tiles allow 20
    (1, 1, 152, False, 20),  # 19 cached tiles and the new tokens' one
    (4, 1, None, True, 4),   # a width the shape does not know: the wave rule alone
])
def test_no_more_splits_than_the_block_tables_width_holds_key_tiles(num_seqs, tokens, pages, kv_in_cache,
                                                                     expected):
    heads = dict(num_heads=8, num_kv_heads=2) if num_seqs == 1 else {}
    s = shape(num_seqs, tokens, pages_per_seq=pages, kv_in_cache=kv_in_cache, **heads)
    splits = key_splits_for(s, TILE, H200)
    assert splits == expected
    bound = s.key_tiles_bound(TILE.block_n)
    assert bound is None or (splits == 1 if bound <= UNSPLIT_WALK_TILES else splits <= bound)


def test_problem_shapes_carry_the_block_tables_width():
    from pagedprefill.testing import BatchSpec, make_problem
    from pagedprefill.tiling import problem_shape

    p = make_problem(BatchSpec(query_lens=(4, 3), context_lens=(16, 9), num_heads=4, num_kv_heads=2,
                               head_size=64, block_size=16, dtype=torch.float32), "cpu")
    assert problem_shape(p).pages_per_seq == p.batch.block_table.shape[1]
