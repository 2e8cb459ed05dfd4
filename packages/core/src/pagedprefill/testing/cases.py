"""Conformance cases and the comparison with the reference (no pytest needed: tools import this too)."""

from __future__ import annotations

import random

import torch

from ..reference import reference_prefill
from ..types import PrefillProblem
from .batches import BatchSpec, fresh_output

#: (atol, rtol) per query dtype for N(0, 1) data; FP8 caches compare against the reference on the same
#: dequantised cache, so they use the query dtype's tolerance too.
DEFAULT_TOLERANCES = {
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float32: (2e-4, 2e-4),
}

BASE = BatchSpec(query_lens=(5, 1, 17, 0, 3), context_lens=(9, 40, 0, 6, 1), num_heads=4, num_kv_heads=2,
                 head_size=32, block_size=8)

#: name -> changes to BASE. Small enough for Triton's interpreter; ``large`` size scales the lengths.
CASES: dict[str, dict] = {
    "basic": {},
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "gqa_4": {"num_heads": 8, "num_kv_heads": 2},
    "mqa_8": {"num_heads": 8, "num_kv_heads": 1},
    "gqa_3": {"num_heads": 6, "num_kv_heads": 2},
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
    "long_query": {"query_lens": (150, 2), "context_lens": (35, 130), "num_heads": 2, "num_kv_heads": 1},
}

LARGE_LENGTHS = {"query_lens": (300, 1, 1000, 0, 77, 1), "context_lens": (2000, 3000, 0, 64, 513, 1)}


def case_spec(name: str, size: str = "small", seed: int = 0) -> BatchSpec:
    """The :class:`BatchSpec` of a named case at ``size`` (``small`` or ``large``)."""
    changes = dict(CASES[name])
    if size == "large" and "query_lens" not in changes and "context_lens" not in changes:
        changes.update(LARGE_LENGTHS)
        if changes.get("block_size") == 1:
            changes["block_size"] = 3
    return BASE.replace(seed=seed, **changes)


def random_spec(seed: int, size: str = "small", dtypes=(torch.float16, torch.float32)) -> BatchSpec:
    """A random case for property sweeps: ragged lengths, block size, head size, GQA ratio, options."""
    rng = random.Random(seed)
    hkv = rng.choice([1, 2])
    group = rng.choice([1, 2, 3, 4, 8])
    scale = 8 if size == "large" else 1
    n = rng.randint(1, 4)
    kv_dtype = rng.choice(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])
    layout = rng.choice(["nhd", "split"])
    return BatchSpec(
        query_lens=tuple(rng.choice([0, 1, rng.randint(1, 40 * scale)]) for _ in range(n)),
        context_lens=tuple(rng.choice([0, rng.randint(1, 60 * scale)]) for _ in range(n)),
        num_heads=hkv * group, num_kv_heads=hkv,
        head_size=rng.choice([8, 16, 24, 40, 64, 72, 128]),
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


def assert_matches_reference(out: torch.Tensor, problem: PrefillProblem, atol: float, rtol: float,
                             label: str = "") -> None:
    """Every output element is finite and within tolerance of the reference (computed in float32)."""
    ref = reference_prefill(fresh_output(problem)).float()
    got = out.float()
    assert torch.isfinite(got).all(), f"{label}: output has {int((~torch.isfinite(got)).sum())} non-finite elements"
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
