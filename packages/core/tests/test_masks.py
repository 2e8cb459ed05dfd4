"""The key ranges and masks of :mod:`pagedprefill.triton.masks` against a plain model of what each query sees.

Probe kernels compose the shared functions as the two kernels do, in Triton's interpreter (a process of its own:
``TRITON_INTERPRET`` must be set before Triton is imported): the portable kernel's walk (a cached range and a
new-token range, each cut by :func:`~pagedprefill.triton.masks.split_range` into masked edges and a mask-free
middle) and the Hopper kernel's (tiles counted in one loop, :func:`~pagedprefill.triton.masks.walk_tile` judging
each), over many lengths, tiles, windows, causal or not, new K/V in the cache or not, and split keys. Each
writes, for every key tile a (query tile, split) program visits, where the tile is, whether it was judged
mask-free, and which (query, key) pairs the kernel attends there (all of the tile's for a mask-free tile, those
:func:`~pagedprefill.triton.masks.visible` keeps otherwise).

Checked against the model (query ``p`` sees key ``k`` when ``k`` exists, ``k <= p`` under a causal mask and
``p - k < window`` with a window): a tile judged mask-free has every pair visible; every visible pair is attended
exactly once over the walk and its splits, and no other pair is; and every visited tile holds a visible pair,
but for the one documented exception (:func:`~pagedprefill.triton.masks.visible_keys`: a window that starts past
the context, inside the context's last tile, visits that tile for nothing).
"""

from __future__ import annotations

import itertools
import json
import random
import textwrap

import numpy as np
import pytest
from pagedprefill.testing.interpreted import run_interpreted

#: Windows probed (None: no window): one key, a few, and wider than a key tile.
WINDOWS = (None, 1, 3, 17, 64)
#: (context length, query length) pairs: no context, a single query, short ones, several tiles of each, contexts
#: ending at every few positions of a key tile.
LENGTHS = ((0, 1), (0, 40), (1, 64), (5, 9), (6, 30), (14, 17), (32, 1), (32, 33), (77, 9), (77, 40), (150, 21))
TOKENS_PER_TILE = (1, 2, 4, 16)
BLOCK_N = (8, 32)
#: Cases drawn for each combination of kernel, window, mask, cache placement and split count.
DRAWS = 3


def cases() -> dict[str, dict]:
    """Every window, mask, cache placement, split count and kernel, each with :data:`DRAWS` lengths and tile sizes
    drawn at random (fixed seed), so that each length and tile size meets each of the others."""
    out = {}
    combos = itertools.product(("portable", "hopper"), WINDOWS, (True, False), (False, True), (1, 3))
    for index, (form, window, causal, in_cache, splits) in enumerate(combos):
        rng = random.Random(index)
        for _ in range(DRAWS):
            ctx_len, q_len = rng.choice(LENGTHS)
            case = dict(form=form, ctx_len=ctx_len, q_len=q_len, window=window, causal=causal,
                        new_kv_in_cache=in_cache, key_splits=splits, tokens_per_tile=rng.choice(TOKENS_PER_TILE),
                        block_n=rng.choice(BLOCK_N))
            name = (f"{form}-ctx{ctx_len}-q{q_len}-tpt{case['tokens_per_tile']}-n{case['block_n']}-w{window}"
                    f"{'-causal' if causal else ''}{'-in_cache' if in_cache else ''}-split{splits}")
            out[name] = case
    return out


CASES = cases()

PROBE = textwrap.dedent("""
    import json
    import sys

    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from pagedprefill.triton.masks import (new_token_keys, split_range, split_tiles, visible, visible_keys,
                                           walk_tile)


    @triton.jit
    def record(meta, pairs, slot, n0, mask_free, part, attended, TPT: tl.constexpr, BLOCK_N: tl.constexpr):
        tl.store(meta + slot * 4, n0)
        tl.store(meta + slot * 4 + 1, mask_free.to(tl.int32))
        tl.store(meta + slot * 4 + 2, part)
        tl.store(meta + slot * 4 + 3, 1)
        offs = tl.arange(0, TPT)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(pairs + slot * TPT * BLOCK_N + offs, attended.to(tl.int8))


    @triton.jit
    def program_rows(ctx_len, q_len, max_tiles, TPT: tl.constexpr, BLOCK_N: tl.constexpr, KEY_SPLITS: tl.constexpr):
        # This program's query tile and split, where its records start, its rows' positions (-1 past the
        # sequence), the rows that exist as a [TPT, BLOCK_N] mask, and its last token.
        tok0 = tl.program_id(0) * TPT
        split = tl.program_id(1)
        slot0 = (tl.program_id(0) * KEY_SPLITS + split) * max_tiles
        tok = tok0 + tl.arange(0, TPT)
        q_pos = tl.where(tok < q_len, ctx_len + tok, -1)
        exists = (q_pos >= 0)[:, None] & (tl.arange(0, BLOCK_N) >= 0)[None, :]
        tok_last = tl.minimum(tok0 + TPT, q_len) - 1
        return tok0, split, slot0, q_pos, exists, tok_last


    @triton.jit
    def probe_portable(meta, pairs, ctx_len, q_len, window, max_tiles, TPT: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, NEW_KV_IN_CACHE: tl.constexpr,
                       KEY_SPLITS: tl.constexpr):
        # prefix_prefill_kernel's walk, with split_masks on and a cache that holds the context.
        tok0, split, slot0, q_pos, exists, tok_last = program_rows(ctx_len, q_len, max_tiles, TPT, BLOCK_N,
                                                                   KEY_SPLITS)
        lo, full_from, c_end, full_to, kv_len = visible_keys(ctx_len, q_len, tok0, tok_last, window, CAUSAL, WINDOW,
                                                             NEW_KV_IN_CACHE)
        c_start = (lo // BLOCK_N) * BLOCK_N
        n_start, n_end, new_full_to, in_bounds_len = new_token_keys(lo, ctx_len, q_len, tok0, tok_last, 0, q_len,
                                                                    BLOCK_N, CAUSAL, NEW_KV_IN_CACHE)
        if KEY_SPLITS > 1:
            cache_first, cache_count, new_first, new_count = split_tiles(
                tl.cdiv(tl.maximum(c_end - c_start, 0), BLOCK_N), tl.cdiv(tl.maximum(n_end - n_start, 0), BLOCK_N),
                split, KEY_SPLITS)
            c_start = c_start + cache_first * BLOCK_N
            c_end = tl.minimum(c_start + cache_count * BLOCK_N, c_end)
            n_start = n_start + new_first * BLOCK_N
            n_end = tl.minimum(n_start + new_count * BLOCK_N, n_end)
        free_start, free_end = split_range(c_start, c_end, full_from, full_to, BLOCK_N)
        CACHE_CAUSAL: tl.constexpr = NEW_KV_IN_CACHE and CAUSAL
        slot = slot0
        for n0 in range(c_start, c_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_free = (n0 >= free_start) & (n0 < free_end)
            attended = tl.where(mask_free, exists, visible(q_pos, pos, pos < kv_len, window, CACHE_CAUSAL, WINDOW))
            record(meta, pairs, slot, n0, mask_free, 0, attended, TPT, BLOCK_N)
            slot += 1
        if not NEW_KV_IN_CACHE:
            free_start, free_end = split_range(n_start, n_end, full_from - ctx_len, new_full_to, BLOCK_N)
            for j0 in range(n_start, n_end, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                mask_free = (j0 >= free_start) & (j0 < free_end)
                attended = tl.where(mask_free, exists,
                                    visible(q_pos, ctx_len + j, j < in_bounds_len, window, CAUSAL, WINDOW))
                record(meta, pairs, slot, ctx_len + j0, mask_free, 1, attended, TPT, BLOCK_N)
                slot += 1


    @triton.jit
    def probe_hopper(meta, pairs, ctx_len, q_len, window, max_tiles, TPT: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, NEW_KV_IN_CACHE: tl.constexpr,
                     KEY_SPLITS: tl.constexpr):
        # The Hopper kernel's key_walk and its consumers' softmax_tile, with a cache that holds the context.
        tok0, split, slot0, q_pos, exists, tok_last = program_rows(ctx_len, q_len, max_tiles, TPT, BLOCK_N,
                                                                   KEY_SPLITS)
        lo, full_from, cache_end, _, kv_len = visible_keys(ctx_len, q_len, tok0, tok_last, window, CAUSAL, WINDOW,
                                                           NEW_KV_IN_CACHE)
        cache_start = (lo // BLOCK_N) * BLOCK_N
        cache_tiles = tl.cdiv(tl.maximum(cache_end - cache_start, 0), BLOCK_N)
        new_start = 0
        new_tiles = 0
        if not NEW_KV_IN_CACHE:
            new_start, new_end, _, _ = new_token_keys(lo, ctx_len, q_len, tok0, tok_last, 0, q_len, BLOCK_N, CAUSAL,
                                                      NEW_KV_IN_CACHE, False)
            new_tiles = tl.cdiv(tl.maximum(new_end - new_start, 0), BLOCK_N)
        if KEY_SPLITS > 1:
            cache_first, cache_tiles, new_first, new_tiles = split_tiles(cache_tiles, new_tiles, split, KEY_SPLITS)
            cache_start = cache_start + cache_first * BLOCK_N
            new_start = new_start + new_first * BLOCK_N
        for it in range(cache_tiles + new_tiles):
            n0, key_end, needs_mask = walk_tile(it, cache_start, cache_tiles, new_start, ctx_len, q_len, kv_len,
                                                ctx_len + tok0, full_from, BLOCK_N, CAUSAL, WINDOW, NEW_KV_IN_CACHE)
            k_pos = n0 + tl.arange(0, BLOCK_N)
            attended = tl.where(needs_mask, visible(q_pos, k_pos, k_pos < key_end, window, CAUSAL, WINDOW), exists)
            record(meta, pairs, slot0 + it, n0, needs_mask == 0, (it >= cache_tiles).to(tl.int32), attended, TPT,
                   BLOCK_N)


    arrays = {}
    for name, case in json.loads(CASES).items():
        tpt, block_n, splits = case["tokens_per_tile"], case["block_n"], case["key_splits"]
        programs = triton.cdiv(case["q_len"], tpt)
        max_tiles = triton.cdiv(case["ctx_len"] + case["q_len"], block_n) + 2
        meta = torch.zeros((programs, splits, max_tiles, 4), dtype=torch.int32)
        pairs = torch.zeros((programs, splits, max_tiles, tpt, block_n), dtype=torch.int8)
        window = case["window"]
        kernel = probe_portable if case["form"] == "portable" else probe_hopper
        kernel[(programs, splits)](meta, pairs, case["ctx_len"], case["q_len"], window or 0, max_tiles, tpt, block_n,
                                   case["causal"], window is not None, case["new_kv_in_cache"], splits)
        arrays[name + "/meta"] = meta.numpy()
        arrays[name + "/pairs"] = pairs.numpy()
    np.savez_compressed(OUT, **arrays)
    print("PROBED", len(arrays) // 2)
""")


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[str, np.ndarray]:
    """The probe kernels' records of every case: ``name/meta`` ``[programs, splits, slots, 4]`` (each visited
    tile's first key position, whether it was judged mask-free, its part: 0 cached, 1 new tokens; and 1 for a
    slot in use) and ``name/pairs`` ``[programs, splits, slots, tokens_per_tile, block_n]`` (the pairs attended)."""
    out = tmp_path_factory.mktemp("masks") / "probed.npz"
    proc = run_interpreted(f"CASES = {json.dumps(json.dumps(CASES))}\nOUT = {str(out)!r}\n" + PROBE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with np.load(out) as data:
        return {name: data[name] for name in data.files}


def seen(ctx_len: int, q_len: int, window, causal: bool) -> np.ndarray:
    """The model: ``[q_len, ctx_len + q_len]``, whether new token ``t`` (query position ``ctx_len + t``) sees each
    key position."""
    p = ctx_len + np.arange(q_len)[:, None]
    k = np.arange(ctx_len + q_len)[None, :]
    out = np.ones((q_len, ctx_len + q_len), dtype=bool)
    if causal:
        out &= k <= p
    if window is not None:
        out &= p - k < window
    return out


def tiles_of(case: dict, meta: np.ndarray, pairs: np.ndarray) -> list[dict]:
    """Every visited tile of a case's records: its query tile, split, part, first key, whether judged mask-free,
    and the attended pairs as ``[tokens_per_tile, block_n]`` booleans."""
    out = []
    for program, split, slot in zip(*np.nonzero(meta[..., 3])):
        n0, mask_free, part, _ = (int(v) for v in meta[program, split, slot])
        out.append(dict(tok0=int(program) * case["tokens_per_tile"], split=int(split), part=("cache", "new")[part],
                        n0=n0, mask_free=bool(mask_free), attended=pairs[program, split, slot].astype(bool)))
    return out


def check_walk(case: dict, tiles: list[dict]) -> None:
    """Assert the contracts of the case's walk (module docstring) on its visited ``tiles``."""
    ctx_len, q_len, tpt, block_n = case["ctx_len"], case["q_len"], case["tokens_per_tile"], case["block_n"]
    total = ctx_len + q_len
    model = seen(ctx_len, q_len, case["window"], case["causal"])
    width = total + 4 * block_n  # room for a tile reaching past the last key
    padded = np.zeros((q_len, width), dtype=bool)
    padded[:, :total] = model
    counts = np.zeros((q_len, width), dtype=int)
    for tile in tiles:
        rows = range(tile["tok0"], min(tile["tok0"] + tpt, q_len))
        keys = range(tile["n0"], tile["n0"] + block_n)
        assert 0 <= tile["n0"] and tile["n0"] + block_n <= width, f"tile outside the keys: {tile}"
        where = f"query tile {tile['tok0']}, split {tile['split']}, {tile['part']} tile at key {tile['n0']}"
        truth = padded[rows.start:rows.stop, keys.start:keys.stop]
        attended = tile["attended"][:len(rows)]
        if tile["mask_free"]:
            hidden = [(rows.start + r, keys.start + c) for r, c in zip(*np.nonzero(~truth))]
            assert not hidden, f"{where}: judged mask-free, but these (token, key) pairs are not visible: {hidden}"
        assert not tile["attended"][len(rows):].any(), f"{where}: attends rows past the sequence"
        counts[rows.start:rows.stop, keys.start:keys.stop] += attended
        if not attended.any():
            # The documented exception: the cached walk's first tile, holding a window's start that lies past the
            # context (nothing of the context is visible, but the tile is the window's).
            lo = int(np.argmax(model[rows.start]))  # the lowest key the tile's first row sees
            first = tile["part"] == "cache" and tile["n0"] <= lo < tile["n0"] + block_n and lo >= ctx_len
            assert first and not case["new_kv_in_cache"], f"{where}: visited, but no row sees any of its keys"
    missed = [(t, k) for t, k in zip(*np.nonzero(padded & (counts == 0)))]
    assert not missed, f"visible (token, key) pairs no visited tile attends: {missed[:20]}"
    twice = [(t, k) for t, k in zip(*np.nonzero(counts > 1))]
    assert not twice, f"(token, key) pairs attended more than once: {twice[:20]}"
    wrong = [(t, k) for t, k in zip(*np.nonzero(~padded & (counts > 0)))]
    assert not wrong, f"(token, key) pairs attended but not visible: {wrong[:20]}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_walk_covers_every_visible_pair_once_and_skips_masks_only_where_all_are_visible(probed, name):
    case = CASES[name]
    check_walk(case, tiles_of(case, probed[name + "/meta"], probed[name + "/pairs"]))


def test_the_probes_see_mask_free_and_masked_tiles_of_both_parts(probed):
    """The checks above are not vacuous: both kernels' walks judge tiles of both parts mask-free and masked."""
    kinds = set()
    for name, case in CASES.items():
        for tile in tiles_of(case, probed[name + "/meta"], probed[name + "/pairs"]):
            kinds.add((case["form"], tile["part"], tile["mask_free"]))
    assert kinds == set(itertools.product(("portable", "hopper"), ("cache", "new"), (False, True)))


def test_the_checks_catch_a_tile_wrongly_judged_mask_free_and_a_missing_tile(probed):
    name = next(name for name, case in CASES.items() if case["form"] == "hopper" and case["window"] == 3
                and case["causal"] and case["q_len"] > 8)
    case = CASES[name]
    tiles = tiles_of(case, probed[name + "/meta"], probed[name + "/pairs"])
    check_walk(case, tiles)
    masked = next(i for i, tile in enumerate(tiles) if not tile["mask_free"])
    wrong = [dict(tile, mask_free=True) if i == masked else tile for i, tile in enumerate(tiles)]
    with pytest.raises(AssertionError, match="judged mask-free"):
        check_walk(case, wrong)
    with pytest.raises(AssertionError, match="no visited tile attends"):
        check_walk(case, tiles[1:])
    with pytest.raises(AssertionError, match="more than once"):
        check_walk(case, tiles + tiles[:1])
