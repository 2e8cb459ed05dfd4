"""Conformance cases and the comparison with the reference (no pytest needed: tools import this too)."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Optional

import torch

from ..reference_impl import reference_prefill
from ..types import PrefillProblem
from ..workloads import BatchSpec, fresh_output, with_output

#: (atol, rtol) per query dtype for N(0, 1) data; FP8 caches compare against the reference on the same
#: dequantised cache, so they use the query dtype's tolerance too.
DEFAULT_TOLERANCES = {
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float32: (2e-4, 2e-4),
}

#: (atol, rtol) of an FP8 e4m3 output (``fp8_out_scale``): one e4m3 step is 12.5 % of the value, and a
#: backend may round a value near a step boundary to the other side.
FP8_OUT_TOLERANCE = (2.0 ** -6, 0.13)

BASE = BatchSpec(query_lens=(5, 1, 17, 0, 3), context_lens=(9, 40, 0, 6, 1), num_heads=4, num_kv_heads=2,
                 head_size=32, block_size=8)

#: name -> changes to BASE. Small enough for Triton's interpreter; ``large`` size scales the lengths.
CASES: dict[str, dict] = {
    "basic": {},
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "gqa_4": {"num_heads": 8, "num_kv_heads": 2},
    "mqa_8": {"num_heads": 8, "num_kv_heads": 1},
    "gqa_3": {"num_heads": 6, "num_kv_heads": 2},
    # every head group of the models' shards (1-8) and MQA with many heads: groups that no power of two divides
    # are packed whole or one head per tile (tiling.pack_heads), their last tile's rows partly empty
    "gqa_5": {"num_heads": 10, "num_kv_heads": 2},
    "gqa_6": {"num_heads": 12, "num_kv_heads": 2},
    "gqa_7": {"num_heads": 14, "num_kv_heads": 2},
    "gqa_8": {"num_heads": 16, "num_kv_heads": 2},
    "mqa_24": {"num_heads": 24, "num_kv_heads": 1, "head_size": 16},
    "head_size_1": {"head_size": 1},
    "head_size_24": {"head_size": 24},
    "head_size_80": {"head_size": 80},
    "head_size_96": {"head_size": 96},
    "head_size_256": {"head_size": 256, "num_heads": 2, "num_kv_heads": 1},
    "split_layout": {"layout": "split"},
    "split_layout_head_24": {"layout": "split", "head_size": 24},
    "block_size_1": {"block_size": 1},
    "block_size_7": {"block_size": 7},
    "block_size_544": {"block_size": 544, "context_lens": (600, 40, 0, 6, 1)},
    "block_size_128": {"block_size": 128, "context_lens": (300, 40, 0, 6, 129)},
    "block_size_32_split_fp8": {"block_size": 32, "layout": "split", "kv_cache_dtype": "fp8_e4m3",
                                "context_lens": (100, 40, 0, 6, 33)},
    "float32": {"dtype": torch.float32},
    "bfloat16": {"dtype": torch.bfloat16},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8_split_tensor_scales": {"kv_cache_dtype": "fp8", "layout": "split", "scale_as_tensor": True},
    "alibi": {"alibi": True},
    "window_1": {"sliding_window": 1},
    "window_6": {"sliding_window": 6},
    "window_alibi": {"sliding_window": 10, "alibi": True},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
    "sm_scale": {"sm_scale": 0.3},
    "all_features": {"alibi": True, "sliding_window": 13, "softcap": 8.0, "sinks": True, "sm_scale": 0.2,
                     "layout": "split"},
    "no_context": {"context_lens": (0, 0, 0, 0, 0)},
    "decode_rows": {"query_lens": (1, 1, 40, 1), "context_lens": (70, 3, 5, 0)},
    "start_loc_b_entries": {"start_loc_entries": "B"},
    # no context lengths given: the kernels derive them from the starts (the serving engine's signature), with
    # decode rows, sequences without context and one without new tokens
    "context_from_starts": {"context_from_starts": True, "query_lens": (1, 6, 1, 13, 0),
                            "context_lens": (20, 0, 0, 3, 5)},
    "long_query": {"query_lens": (150, 2), "context_lens": (35, 130), "num_heads": 2, "num_kv_heads": 1},
    # the split K cache with any x dividing the head size (strides decide the addressing)
    "split_x_1": {"layout": "split", "x": 1},
    "split_x_2_head_24": {"layout": "split", "x": 2, "head_size": 24},
    "split_x_4": {"layout": "split", "x": 4},
    "split_x_16": {"layout": "split", "x": 16},
    "split_x_8_float32": {"layout": "split", "x": 8, "dtype": torch.float32},
    "split_x_1_float32": {"layout": "split", "x": 1, "dtype": torch.float32},
    "split_x_8_fp8_e4m3": {"layout": "split", "x": 8, "kv_cache_dtype": "fp8_e4m3"},
    "split_x_2_fp8_e5m2": {"layout": "split", "x": 2, "kv_cache_dtype": "fp8_e5m2", "scale_as_tensor": True},
    "split_x_16_fp8_window_alibi": {"layout": "split", "x": 16, "kv_cache_dtype": "fp8", "sliding_window": 10,
                                    "alibi": True},
    # optional features (see FEATURE_CASES): a backend that refuses one skips its cases, with the reason
    "skip_decode": {"skip_decode": True, "query_lens": (1, 6, 1, 13, 0), "context_lens": (20, 9, 0, 3, 5)},
    # two new tokens are a prefill, not a decode row: written, with and without a prefix
    "skip_decode_two_tokens": {"skip_decode": True, "query_lens": (2, 1, 2, 3), "context_lens": (11, 4, 0, 2)},
    "fp8_out": {"fp8_out_scale": 0.02},
    "fp8_out_clamped": {"fp8_out_scale": 0.002, "dtype": torch.float32},
    "non_causal": {"causal": False},
    "non_causal_window_alibi_sinks": {"causal": False, "sliding_window": 6, "alibi": True, "sinks": True},
    "kv_in_cache": {"kv_in_cache": True},
    "kv_in_cache_split_fp8": {"kv_in_cache": True, "layout": "split", "x": 8, "kv_cache_dtype": "fp8_e4m3",
                              "block_size": 16},
    "vllm_options": {"kv_in_cache": True, "causal": False, "skip_decode": True, "fp8_out_scale": 0.05,
                     "sinks": True, "sliding_window": 9, "layout": "split",
                     "query_lens": (1, 6, 1, 13, 0), "context_lens": (20, 9, 0, 3, 5)},
    "context_from_starts_kv_in_cache_skip_decode": {"context_from_starts": True, "kv_in_cache": True,
                                                    "skip_decode": True, "query_lens": (1, 6, 1, 13, 0),
                                                    "context_lens": (20, 0, 0, 3, 5)},
    # an FP8 q (fp8_query): e4m3 with a per-tensor descale, beside 16-bit and FP8 caches, new keys in the cache
    "fp8_query": {"fp8_query": True},
    "fp8_query_bfloat16": {"fp8_query": True, "dtype": torch.bfloat16},
    "fp8_query_split_fp8_e4m3": {"fp8_query": True, "layout": "split", "kv_cache_dtype": "fp8_e4m3"},
    "fp8_query_fp8_e5m2_alibi_sinks": {"fp8_query": True, "kv_cache_dtype": "fp8_e5m2", "alibi": True,
                                       "sinks": True, "softcap": 5.0},
    "fp8_query_tensor_scales_kv_in_cache": {"fp8_query": True, "kv_in_cache": True, "kv_cache_dtype": "fp8_e4m3",
                                            "scale_as_tensor": True, "sliding_window": 9},
    "fp8_query_fp8_out": {"fp8_query": True, "kv_in_cache": True, "fp8_out_scale": 0.03},
    # nothing 16-bit beside the FP8 q (FP8 cache and output, k = v = None): the call computes in bfloat16
    "fp8_query_only_fp8": {"fp8_query": True, "kv_in_cache": True, "kv_cache_dtype": "fp8_e4m3",
                           "fp8_out_scale": 0.03, "dtype": torch.bfloat16},
    # every slot no sequence holds is NaN (BatchSpec.nan_unused_slots): the tails of sequences' last blocks and
    # the blocks no table names, which a kernel that loads whole pages reads but must not let reach an output
    "nan_unused_slots": {"nan_unused_slots": True},
    "nan_unused_slots_kv_in_cache": {"nan_unused_slots": True, "kv_in_cache": True, "block_size": 16},
    "nan_unused_slots_split": {"nan_unused_slots": True, "layout": "split", "block_size": 16},
    "nan_unused_slots_fp8_e4m3_kv_in_cache": {"nan_unused_slots": True, "kv_in_cache": True,
                                              "kv_cache_dtype": "fp8_e4m3", "block_size": 16},
    "nan_unused_slots_bfloat16_head_96": {"nan_unused_slots": True, "kv_in_cache": True, "dtype": torch.bfloat16,
                                          "head_size": 96, "block_size": 16},
    "nan_unused_slots_decode_rows": {"nan_unused_slots": True, "kv_in_cache": True, "block_size": 16,
                                     "query_lens": (1, 1, 1, 4), "context_lens": (70, 3, 33, 12)},
}

#: case name -> the optional features (:data:`pagedprefill.types.FEATURES`) it needs.
FEATURE_CASES: dict[str, frozenset] = {
    name: frozenset(f for f, on in (("skip_decode", c.get("skip_decode")), ("fp8_out_scale", "fp8_out_scale" in c),
                                    ("non_causal", c.get("causal") is False), ("kv_in_cache", c.get("kv_in_cache")),
                                    ("fp8_query", c.get("fp8_query")))
                    if on)
    for name, c in CASES.items()
}
FEATURE_CASES = {name: features for name, features in FEATURE_CASES.items() if features}

#: Lengths of the multi-tile cases: with the tile forced to :data:`SMALL_TILE` contexts span up to 9 key tiles
#: and queries up to 4 query tiles, so windows skip whole tiles, the mask-free middle tiles run, and edge tiles
#: fall at every offset.
MULTI_TILE_LENGTHS = {"query_lens": (37, 1, 20, 0, 50), "context_lens": (70, 0, 45, 130, 3)}
#: The tile the multi-tile cases force on a backend (keys 16 at a time, 32 rows).
SMALL_TILE = {"block_m": 32, "block_n": 16}
#: name -> changes to BASE with :data:`MULTI_TILE_LENGTHS`: the window, ALiBi, sinks and optional-feature paths
#: over several key tiles. Run with :data:`SMALL_TILE` by the conformance suite.
MULTI_TILE_CASES: dict[str, dict] = {
    "window_1": {"sliding_window": 1},
    "window_20": {"sliding_window": 20},
    "window_33_alibi": {"sliding_window": 33, "alibi": True},
    "alibi": {"alibi": True},
    "sinks_softcap": {"sinks": True, "softcap": 6.0},
    "window_17_split_fp8_sinks": {"sliding_window": 17, "layout": "split", "kv_cache_dtype": "fp8_e4m3",
                                  "sinks": True},
    "window_21_block_size_1": {"sliding_window": 21, "block_size": 1},
    "window_40_block_size_64": {"sliding_window": 40, "block_size": 64, "head_size": 24},
    "non_causal": {"causal": False},
    "non_causal_window_24_alibi": {"causal": False, "sliding_window": 24, "alibi": True},
    "skip_decode_window_17": {"skip_decode": True, "sliding_window": 17},
    "kv_in_cache_window_40": {"kv_in_cache": True, "sliding_window": 40},
    "kv_in_cache_non_causal_sinks": {"kv_in_cache": True, "causal": False, "sinks": True, "layout": "split", "x": 4},
    "fp8_out_window_29": {"fp8_out_scale": 0.03, "sliding_window": 29},
}


def multi_tile_spec(name: str, seed: int = 0) -> BatchSpec:
    """The :class:`BatchSpec` of a multi-tile case."""
    return BASE.replace(seed=seed, **{**MULTI_TILE_LENGTHS, **MULTI_TILE_CASES[name]})


#: Lengths of the split-key cases: contexts of several key tiles at any policy's tile, a decode row, a sequence
#: without new tokens and one without context, so that splits get uneven shares, the cached and new parts
#: meet inside a split, and the last splits of the short sequences get no key at all.
SPLIT_KEY_LENGTHS = {"query_lens": (37, 1, 20, 0, 50, 4), "context_lens": (300, 530, 0, 45, 3, 260)}
#: Splits the split-key cases run with: an even one, and one that leaves splits empty.
SPLIT_KEY_COUNTS = (2, 5)
#: name -> changes to BASE with :data:`SPLIT_KEY_LENGTHS`: each tile's keys shared by several programs
#: (``TileConfig.key_splits``) and merged by the combine, with the options that the combine or the split walk
#: handle (sinks, the FP8 value and output scales, skipped decode rows, the walk over new tokens in the cache).
SPLIT_KEY_CASES: dict[str, dict] = {
    "causal": {},
    "kv_in_cache": {"kv_in_cache": True},
    "split_fp8_sinks": {"layout": "split", "kv_cache_dtype": "fp8_e4m3", "sinks": True},
    "window_33_alibi": {"sliding_window": 33, "alibi": True},
    "skip_decode_fp8_out": {"skip_decode": True, "fp8_out_scale": 0.03},
    "non_causal_softcap": {"causal": False, "softcap": 6.0},
    "kv_in_cache_fp8_e5m2": {"kv_in_cache": True, "kv_cache_dtype": "fp8_e5m2"},
    "fp8_query_kv_in_cache": {"fp8_query": True, "kv_in_cache": True, "kv_cache_dtype": "fp8_e4m3"},
    "context_from_starts_kv_in_cache": {"context_from_starts": True, "kv_in_cache": True},
    # a padded head (96 of a 128-wide tile): each split's partial rows and the merge cover its columns only
    "head_96_kv_in_cache": {"head_size": 96, "kv_in_cache": True},
    "split_head_96": {"layout": "split", "head_size": 96},
}


def split_key_spec(name: str, seed: int = 0) -> BatchSpec:
    """The :class:`BatchSpec` of a split-key case."""
    return BASE.replace(seed=seed, **{**SPLIT_KEY_LENGTHS, **SPLIT_KEY_CASES[name]})


LARGE_LENGTHS = {"query_lens": (300, 1, 1000, 0, 77, 1), "context_lens": (2000, 3000, 0, 64, 513, 1)}


def case_spec(name: str, size: str = "small", seed: int = 0) -> BatchSpec:
    """The :class:`BatchSpec` of a named case at ``size`` (``small`` or ``large``)."""
    changes = dict(CASES[name])
    if size == "large" and "query_lens" not in changes and "context_lens" not in changes:
        changes.update(LARGE_LENGTHS)
        if changes.get("block_size") == 1:
            changes["block_size"] = 3
    return BASE.replace(seed=seed, **changes)


#: The cache formats a random case draws from (``auto`` twice as often as each FP8 format).
RANDOM_KV_CACHE_DTYPES = ("auto", "auto", "fp8_e4m3", "fp8_e5m2")
#: The head sizes and head groups (query heads per KV head) :func:`random_spec` draws by default.
RANDOM_HEAD_SIZES = (8, 16, 24, 40, 64, 72, 128)
RANDOM_GROUPS = (1, 2, 3, 4, 8)
#: What models run, which :func:`model_heads_spec` draws instead: the head sizes of Llama, Qwen, Gemma-2, Phi-3
#: and Falcon, and head groups that do not divide a tile (3, 5, 6, 7) beside MHA and a group of 8.
MODEL_HEAD_SIZES = (64, 80, 96, 128, 256)
MODEL_GROUPS = (1, 3, 5, 6, 7, 8)


def random_spec(seed: int, size: str = "small", dtypes=(torch.float16, torch.float32),
                kv_cache_dtypes: Optional[Collection[str]] = None,
                features: Optional[Collection[str]] = None,
                head_sizes: Sequence[int] = RANDOM_HEAD_SIZES, groups: Sequence[int] = RANDOM_GROUPS) -> BatchSpec:
    """A random case for property sweeps: ragged lengths, block size, head size, GQA ratio, options.

    ``kv_cache_dtypes`` (default: every format) and ``features`` (the optional features of
    :data:`pagedprefill.options.FEATURES` a case may use; default: all) narrow the draw to what a backend runs;
    ``head_sizes`` and ``groups`` are what the head size and the query heads per KV head are drawn from.
    Left at their defaults, a seed gives the same case as it always has.
    """
    rng = random.Random(seed)
    hkv = rng.choice([1, 2])
    group = rng.choice(list(groups))
    scale = 8 if size == "large" else 1
    n = rng.randint(1, 4)
    formats = [f for f in RANDOM_KV_CACHE_DTYPES if kv_cache_dtypes is None or f in kv_cache_dtypes]
    if not formats:
        raise ValueError(f"kv_cache_dtypes: expected at least one of {sorted(set(RANDOM_KV_CACHE_DTYPES))}, got "
                         f"{sorted(kv_cache_dtypes)}")
    kv_dtype = rng.choice(formats)
    layout = rng.choice(["nhd", "split"])
    spec = BatchSpec(
        query_lens=tuple(rng.choice([0, 1, rng.randint(1, 40 * scale)]) for _ in range(n)),
        context_lens=tuple(rng.choice([0, rng.randint(1, 60 * scale)]) for _ in range(n)),
        num_heads=hkv * group, num_kv_heads=hkv,
        head_size=rng.choice(list(head_sizes)),
        block_size=rng.choice([1, 3, 8, 16, 19, 32]),
        dtype=rng.choice(list(dtypes)),
        kv_cache_dtype=kv_dtype,
        layout=layout,
        alibi=rng.random() < 0.3,
        sliding_window=rng.choice([None, None, 1, 4, 17, 64]),
        softcap=rng.choice([0.0, 0.0, 10.0]),
        sinks=rng.random() < 0.3,
        seed=seed,
    )
    if layout == "split":  # any x dividing the head size (drawn last: earlier draws stay as they were)
        x = rng.choice([None, None, 1, 2, 4, 8, 16])
        if x is not None and spec.head_size % x == 0:
            spec = spec.replace(x=x)
    # The optional features (a backend without one checks that it refuses the case, naming it). Every number is
    # drawn whatever ``features`` allows, so that narrowing one feature leaves the others' draws as they were.
    def allowed(feature: str) -> bool:
        return features is None or feature in features

    non_causal, skip_decode, kv_in_cache = rng.random() < 0.15, rng.random() < 0.15, rng.random() < 0.15
    fp8_out_scale = round(rng.uniform(0.01, 0.1), 3) if rng.random() < 0.1 else None
    spec = spec.replace(causal=not (non_causal and allowed("non_causal")),
                        skip_decode=skip_decode and allowed("skip_decode"),
                        kv_in_cache=kv_in_cache and allowed("kv_in_cache"),
                        fp8_out_scale=fp8_out_scale if allowed("fp8_out_scale") else None,
                        nan_unused_slots=seed % 2 == 1)  # not drawn: the draws above stay as they were
    return spec


def model_heads_spec(seed: int, size: str = "small", dtypes=(torch.float16, torch.float32),
                     kv_cache_dtypes: Optional[Collection[str]] = None,
                     features: Optional[Collection[str]] = None) -> BatchSpec:
    """A random case as :func:`random_spec` draws it, at the head sizes and head groups models run
    (:data:`MODEL_HEAD_SIZES`, :data:`MODEL_GROUPS`): head sizes 80, 96 and 256 and groups of 5-7 heads beside
    every option, which the default draw never combines."""
    return random_spec(seed, size, dtypes, kv_cache_dtypes=kv_cache_dtypes, features=features,
                       head_sizes=MODEL_HEAD_SIZES, groups=MODEL_GROUPS)


def written_rows(problem: PrefillProblem) -> torch.Tensor:
    """``[T]`` bool: the output rows a backend must write (all new tokens, but those of sequences that
    ``skip_decode`` skips). Reads the metadata on the host."""
    b = problem.batch
    mask = torch.zeros(problem.num_tokens, dtype=torch.bool)
    starts = b.query_start.tolist()
    for i, (seq, ctx) in enumerate(zip(b.seq_lens.tolist(), b.context_lengths().tolist())):
        n = seq - ctx
        if n > 0 and not (problem.options.skip_decode and n == 1):
            mask[starts[i]:starts[i] + n] = True
    return mask.to(problem.device)


def assert_matches_reference(out: torch.Tensor, problem: PrefillProblem, atol: float, rtol: float,
                             label: str = "") -> None:
    """Every output element is finite and within tolerance of the reference (computed in float32 and, but for
    an FP8 output, kept in float32).

    ``out`` must start NaN-poisoned (as :func:`~pagedprefill.testing.make_problem` makes it): rows that
    ``skip_decode`` skips must still be NaN (untouched). An FP8 output is compared with at least
    :data:`FP8_OUT_TOLERANCE`, and with the input dtype's absolute tolerance divided by the output scale: the
    output is ``attention / scale``, so a small scale magnifies the attention's own rounding (fp16 P and V in
    the kernel) by ``1 / scale`` before the FP8 rounding.
    """
    got = out.float()
    if out.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):  # the reference rounds to FP8 the same way
        ref = reference_prefill(fresh_output(problem)).float()
        scale = problem.options.fp8_out_scale
        scale = float(scale.float().reshape(-1)[0]) if isinstance(scale, torch.Tensor) else float(scale)
        atol, rtol = max(atol / scale, FP8_OUT_TOLERANCE[0]), max(rtol, FP8_OUT_TOLERANCE[1])
    else:  # computed and kept in float32: no rounding to the output dtype on the reference's side
        ref = reference_prefill(with_output(problem, torch.full(out.shape, float("nan"), device=out.device)))
    rows = written_rows(problem)
    if not bool(rows.all()):
        skipped = got[~rows]
        assert torch.isnan(skipped).all(), \
            f"{label}: {int((~torch.isnan(skipped)).sum())} elements of skipped rows were written"
        got, ref = got[rows], ref[rows]
    assert torch.isfinite(got).all(), f"{label}: output has {int((~torch.isfinite(got)).sum())} non-finite elements"
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
