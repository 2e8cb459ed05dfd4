"""Input validation: every check answers bad input with TypeError/ValueError naming the argument, what was
expected and what was given, through both public entry points, and never touches the output or the cache.

Each case builds a valid random problem, breaks exactly one thing, and calls
``context_attention_fwd(..., validate="full")`` (drop-in) and ``prefill_attention(..., validate="full")``
(native) on the reference backend.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import pagedprefill as pp
import pytest
import torch
from pagedprefill.testing import BatchSpec, make_problem

# The base batch: B = 5 sequences, T = 26 new tokens, H = 4, Hkv = 2, D = 32, block_size = 8.
# Blocks per sequence: 2, 5, 0, 1, 1 -> 9 used + 3 spare = 12 cache blocks; block table width 5.
NHD = BatchSpec(query_lens=(5, 1, 17, 0, 3), context_lens=(9, 40, 0, 6, 1), num_heads=4, num_kv_heads=2,
                head_size=32, block_size=8, dtype=torch.float16, layout="nhd")
SPLIT = NHD.replace(layout="split")
SPLIT_F32 = SPLIT.replace(dtype=torch.float32)
FP8 = NHD.replace(kv_cache_dtype="fp8_e4m3", layout="split")
FP8_NHD = NHD.replace(kv_cache_dtype="fp8_e4m3")
FP8_D24 = FP8.replace(head_size=24)
FEATURES = NHD.replace(alibi=True, sinks=True, softcap=5.0, sliding_window=7)
FP8_QUERY = NHD.replace(fp8_query=True)
B, T, H, HKV, D, BS, NB, WIDTH = 5, 26, 4, 2, 32, 8, 12, 5

_gen = torch.Generator().manual_seed(1234)


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, generator=_gen).to(dtype)


def meta(t: torch.Tensor) -> torch.Tensor:
    """The same tensor shape/dtype on another device (``meta``), to exercise device checks on a CPU."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def drop_in_args(problem: pp.PrefillProblem) -> dict:
    """The arguments of ``context_attention_fwd`` (by name) for ``problem``."""
    c, b, o = problem.cache, problem.batch, problem.options
    return dict(q=problem.q, k=problem.k, v=problem.v, o=problem.out, kv_cache_dtype=c.dtype.value,
                k_cache=c.key, v_cache=c.value, b_loc=b.block_table, b_start_loc=b.query_start,
                b_seq_len=b.seq_lens, b_ctx_len=b.context_lens, max_input_len=b.max_query_len,
                k_scale=c.k_scale, v_scale=c.v_scale, alibi_slopes=o.alibi_slopes,
                sliding_window=o.sliding_window, sm_scale=o.sm_scale, sinks=o.sinks, softcap=o.softcap,
                q_scale=o.q_scale)


def call_drop_in(a: dict, validate="full"):
    kwargs = {k: v for k, v in a.items() if not k.startswith("_")}
    return pp.context_attention_fwd(**kwargs, backend="reference", validate=validate)


def call_native(a: dict, validate="full"):
    k_cache = a["k_cache"]
    layout = a.get("_layout") or ("split" if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 5 else "nhd")
    cache = a.get("_cache") or pp.PagedKVCache(k_cache, a["v_cache"], layout, a["kv_cache_dtype"], a["k_scale"],
                                               a["v_scale"])
    batch = pp.BatchMetadata(query_start=a["b_start_loc"], seq_lens=a["b_seq_len"], context_lens=a["b_ctx_len"],
                             block_table=a["b_loc"], max_query_len=a["max_input_len"])
    return pp.prefill_attention(a["q"], a["k"], a["v"], cache, batch, sm_scale=a["sm_scale"],
                                alibi_slopes=a["alibi_slopes"], sliding_window=a["sliding_window"],
                                softcap=a["softcap"], sinks=a["sinks"], q_scale=a["q_scale"], out=a["o"],
                                backend="reference", validate=validate)


CALLS = {"drop_in": call_drop_in, "native": call_native}

#: The drop-in's argument names and the native API's names for the same arguments.
NATIVE_NAMES = {"o": "out", "b_loc": "block_table", "b_start_loc": "query_start", "b_seq_len": "seq_lens",
                "b_ctx_len": "context_lens", "max_input_len": "max_query_len"}


def as_written(text: str, api: str) -> str:
    """``text`` (written with the drop-in's names) with the argument names the caller of ``api`` wrote."""
    if api == "drop_in":
        return text
    return re.sub(r"\b(" + "|".join(NATIVE_NAMES) + r")\b", lambda m: NATIVE_NAMES[m.group(1)], text)


@dataclass(frozen=True)
class Bad:
    """One broken input: ``brk`` edits the argument dict; the call must raise ``exc`` whose message starts
    with ``arg + ":"`` and contains every string of ``parts`` (what was expected and what was given)."""

    id: str
    spec: BatchSpec
    brk: Callable[[dict], None]
    exc: type
    arg: str
    parts: tuple
    apis: tuple = ("drop_in", "native")


def put(name, make):
    def apply(a):
        a[name] = make(a)
    return apply


def puts(**makers):
    def apply(a):
        for name, make in makers.items():
            a[name] = make(a)
    return apply


def set_item(name, index, value):
    def apply(a):
        t = a[name].clone()
        t[index] = value
        a[name] = t
    return apply


def both_caches(make):
    return puts(k_cache=lambda a: make(a["k_cache"]), v_cache=lambda a: make(a["v_cache"]))


#: A dtype spelled the second way; messages spell dtypes one way, without ``torch.`` (see ``dtype_name``).
TORCH_DTYPE = re.compile(r"torch\.(u?int|float|bfloat|bool|complex)")
FLOATS = "float16 or bfloat16 or float32"
QUERY_DTYPES = "float16, bfloat16, float32 or float8_e4m3fn (an FP8 q, with q_scale)"
INTS = "int32 or int64"

CASES = [
    # -- the mode itself -------------------------------------------------------------------------------
    # (validate= is passed by the test; see test_unknown_validate_mode)
    # -- q / k / v / out: types, ranks, dtypes, devices, shapes, GQA, strides --------------------------
    Bad("q_not_tensor", NHD, put("q", lambda a: a["q"].tolist()), TypeError, "q",
        ("expected a torch.Tensor", "got list")),
    Bad("k_not_tensor", NHD, put("k", lambda a: None), TypeError, "k", ("expected a torch.Tensor", "got NoneType")),
    Bad("v_not_tensor", NHD, put("v", lambda a: 1.0), TypeError, "v", ("expected a torch.Tensor", "got float")),
    Bad("out_not_tensor", NHD, put("o", lambda a: "out"), TypeError, "out", ("expected a torch.Tensor", "got str")),
    Bad("q_2d", NHD, put("q", lambda a: a["q"].reshape(T, H * D)), ValueError, "q",
        ("expected a 3-D tensor [tokens, num_heads, head_size]", f"got shape [{T}, {H * D}]")),
    Bad("k_4d", NHD, put("k", lambda a: a["k"][None]), ValueError, "k",
        ("expected a 3-D tensor [tokens, num_kv_heads, head_size]", f"got shape [1, {T}, {HKV}, {D}]")),
    Bad("v_2d", NHD, put("v", lambda a: a["v"][0]), ValueError, "v",
        ("expected a 3-D tensor [tokens, num_kv_heads, head_size]", f"got shape [{HKV}, {D}]")),
    Bad("out_4d", NHD, put("o", lambda a: a["o"][None]), ValueError, "out",
        ("expected a 3-D tensor [tokens, num_heads, head_size]", f"got shape [1, {T}, {H}, {D}]")),
    Bad("q_float64", NHD, puts(**{n: (lambda a, n=n: a[n].double()) for n in ("q", "k", "v", "o")}), TypeError,
        "q", (f"expected dtype {QUERY_DTYPES}", "got float64")),
    Bad("q_int", NHD, puts(**{n: (lambda a, n=n: a[n].to(torch.int32)) for n in ("q", "k", "v", "o")}),
        TypeError, "q", (f"expected dtype {QUERY_DTYPES}", "got int32")),
    Bad("k_dtype", NHD, put("k", lambda a: a["k"].float()), TypeError, "k",
        ("expected dtype float16 (the dtype of q)", "got float32")),
    # -- an FP8 q: its descale, and the 16-bit type of the call's other tensors ------------------------------
    Bad("q_fp8_e5m2", NHD, put("q", lambda a: a["q"].to(torch.float8_e5m2)), TypeError, "q",
        (f"expected dtype {QUERY_DTYPES}", "got float8_e5m2")),
    Bad("q_scale_without_fp8_q", NHD, put("q_scale", lambda a: 0.5), ValueError, "q_scale",
        ("descales an FP8 q (dtype float8_e4m3fn) only", "q has dtype float16")),
    Bad("q_scale_tensor_without_fp8_q", NHD, put("q_scale", lambda a: torch.ones(1)), ValueError, "q_scale",
        ("descales an FP8 q (dtype float8_e4m3fn) only",)),
    Bad("q_scale_zero", FP8_QUERY, put("q_scale", lambda a: 0.0), ValueError, "q_scale",
        ("expected a finite positive scale", "got 0.0")),
    Bad("q_scale_nan", FP8_QUERY, put("q_scale", lambda a: float("nan")), ValueError, "q_scale",
        ("expected a finite positive scale", "got nan")),
    Bad("q_scale_two_elements", FP8_QUERY, put("q_scale", lambda a: torch.ones(2)), ValueError, "q_scale",
        ("expected a float or a 1-element tensor", "got shape [2]")),
    Bad("q_scale_int_tensor", FP8_QUERY, put("q_scale", lambda a: torch.ones(1, dtype=torch.int32)), TypeError,
        "q_scale", (f"expected dtype {FLOATS}", "got int32")),
    Bad("q_scale_string", FP8_QUERY, put("q_scale", lambda a: "1"), TypeError, "q_scale",
        ("expected a float or a 1-element tensor", "got str")),
    Bad("q_fp8_out_float32", FP8_QUERY, put("o", lambda a: a["o"].float()), TypeError, "out",
        ("expected dtype float16 or bfloat16 (the output of an FP8 q", "got float32")),
    Bad("q_fp8_k_float32", FP8_QUERY, puts(k=lambda a: a["k"].float(), v=lambda a: a["v"].float()), TypeError,
        "k", ("expected dtype float16 or bfloat16 (the new tokens' keys and values beside an FP8 q)",
              "got float32")),
    Bad("q_fp8_v_bfloat16", FP8_QUERY, put("v", lambda a: a["v"].bfloat16()), TypeError, "v",
        ("expected dtype float16 (the 16-bit dtype of the call, whose q is FP8)", "got bfloat16")),
    Bad("q_fp8_cache_bfloat16", FP8_QUERY, both_caches(lambda t: t.bfloat16()), TypeError, "k_cache",
        ("expected dtype float16 (the 16-bit dtype of the call, whose q is FP8; kv_cache_dtype='auto')",
         "got bfloat16")),
    Bad("v_dtype", NHD, put("v", lambda a: a["v"].bfloat16()), TypeError, "v",
        ("expected dtype float16 (the dtype of q)", "got bfloat16")),
    Bad("out_dtype", NHD, put("o", lambda a: a["o"].float()), TypeError, "out",
        ("expected dtype float16 (the dtype of q)", "got float32")),
    Bad("k_device", NHD, put("k", lambda a: meta(a["k"])), ValueError, "k",
        ("expected a tensor on cpu (the device of q)", "got one on meta")),
    Bad("v_device", NHD, put("v", lambda a: meta(a["v"])), ValueError, "v",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("out_device", NHD, put("o", lambda a: meta(a["o"])), ValueError, "out",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("head_size_0", NHD, put("q", lambda a: randn(T, H, 0)), ValueError, "q",
        ("expected head_size (dim 2) in 1..256", "got 0")),
    Bad("head_size_257", NHD, put("q", lambda a: randn(T, H, 257)), ValueError, "q",
        ("expected head_size (dim 2) in 1..256", "got 257")),
    Bad("out_shape", NHD, put("o", lambda a: a["o"][:-1]), ValueError, "out",
        (f"expected shape [{T}, {H}, {D}] (the shape of q)", f"got [{T - 1}, {H}, {D}]")),
    Bad("k_tokens", NHD, put("k", lambda a: a["k"][:-1]), ValueError, "k",
        (f"expected shape [{T}, num_kv_heads, {D}] (tokens and head_size of q)", f"got [{T - 1}, {HKV}, {D}]")),
    Bad("k_head_size", NHD, put("k", lambda a: a["k"][..., :16]), ValueError, "k",
        (f"expected shape [{T}, num_kv_heads, {D}]", f"got [{T}, {HKV}, 16]")),
    Bad("v_tokens", NHD, put("v", lambda a: a["v"][1:]), ValueError, "v",
        (f"expected shape [{T}, num_kv_heads, {D}]", f"got [{T - 1}, {HKV}, {D}]")),
    Bad("v_heads_differ_from_k", NHD, put("v", lambda a: a["v"][:, :1]), ValueError, "v",
        (f"expected shape [{T}, {HKV}, {D}] (the shape of k)", f"got [{T}, 1, {D}]")),
    Bad("heads_not_multiple", NHD, puts(k=lambda a: randn(T, 3, D), v=lambda a: randn(T, 3, D)), ValueError, "k",
        (f"expected num_kv_heads dividing num_heads={H}", "got num_kv_heads=3")),
    Bad("zero_kv_heads", NHD, puts(k=lambda a: randn(T, 0, D), v=lambda a: randn(T, 0, D)), ValueError, "k",
        (f"expected num_kv_heads dividing num_heads={H}", "got num_kv_heads=0")),
    Bad("q_strided_head_dim", NHD, put("q", lambda a: randn(T, H, 2 * D)[..., ::2]), ValueError, "q",
        ("expected the head_size dimension to be contiguous (stride 1)", f"got strides ({H * 2 * D}, {2 * D}, 2)")),
    Bad("k_strided_head_dim", NHD, put("k", lambda a: randn(T, HKV, 2 * D)[..., ::2]), ValueError, "k",
        ("expected the head_size dimension to be contiguous (stride 1)", "got strides")),
    Bad("out_strided_head_dim", NHD, put("o", lambda a: randn(T, H, 3 * D)[..., ::3]), ValueError, "out",
        ("expected the head_size dimension to be contiguous (stride 1)", "got strides")),
    # -- the cache -------------------------------------------------------------------------------------
    Bad("cache_not_descriptor", NHD, put("_cache", lambda a: "cache"), TypeError, "cache",
        ("expected a pagedprefill.PagedKVCache", "got str"), apis=("native",)),
    Bad("k_cache_not_tensor", NHD, put("k_cache", lambda a: a["k_cache"].tolist()), TypeError, "k_cache",
        ("expected a torch.Tensor", "got list")),
    Bad("v_cache_not_tensor", NHD, put("v_cache", lambda a: None), TypeError, "v_cache",
        ("expected a torch.Tensor", "got NoneType")),
    Bad("k_cache_device", NHD, put("k_cache", lambda a: meta(a["k_cache"])), ValueError, "k_cache",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("v_cache_device", SPLIT, put("v_cache", lambda a: meta(a["v_cache"])), ValueError, "v_cache",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("fp8_declared_fp16_cache", NHD, put("kv_cache_dtype", lambda a: "fp8"), TypeError, "k_cache",
        ("expected dtype uint8 (or float8_e4m3fn) for kv_cache_dtype='fp8_e4m3'", "got float16")),
    Bad("e5m2_declared_e4m3_cache", FP8,
        puts(kv_cache_dtype=lambda a: "fp8_e5m2", k_cache=lambda a: a["k_cache"].view(torch.float8_e4m3fn),
             v_cache=lambda a: a["v_cache"].view(torch.float8_e4m3fn)),
        TypeError, "k_cache", ("expected dtype uint8 (or float8_e5m2) for kv_cache_dtype='fp8_e5m2'",
                               "got float8_e4m3fn")),
    Bad("auto_with_uint8_cache", FP8, put("kv_cache_dtype", lambda a: "auto"), TypeError, "k_cache",
        ("uint8 holds FP8 bytes", "kv_cache_dtype='auto' expects the model dtype float16")),
    Bad("auto_with_uint8_cache_nhd", FP8_NHD, put("kv_cache_dtype", lambda a: "auto"), TypeError, "k_cache",
        ("uint8 holds FP8 bytes", "kv_cache_dtype='auto' expects the model dtype float16")),
    Bad("auto_with_float8_cache", FP8,
        puts(kv_cache_dtype=lambda a: "auto", k_cache=lambda a: a["k_cache"].view(torch.float8_e4m3fn),
             v_cache=lambda a: a["v_cache"].view(torch.float8_e4m3fn)),
        TypeError, "k_cache", ("float8_e4m3fn holds FP8 bytes", "expects the model dtype float16")),
    Bad("auto_cache_dtype_differs_from_q", NHD, both_caches(lambda t: t.float()), TypeError, "k_cache",
        ("expected dtype float16 (the dtype of q, kv_cache_dtype='auto')", "got float32")),
    Bad("v_cache_dtype_differs", NHD, put("v_cache", lambda a: a["v_cache"].float()), TypeError, "v_cache",
        ("expected dtype float16 (the dtype of k_cache)", "got float32")),
    Bad("fp8_v_cache_dtype_differs", FP8, put("v_cache", lambda a: a["v_cache"].view(torch.float8_e4m3fn)),
        TypeError, "v_cache", ("expected dtype uint8 (the dtype of k_cache)", "got float8_e4m3fn")),
    Bad("split_forced_on_4d_key", NHD, put("_layout", lambda a: "split"), ValueError, "k_cache",
        ("expected a 5-D tensor [num_blocks, num_kv_heads, head_size // x, block_size, x] (split layout)",
         f"got shape [{NB}, {BS}, {HKV}, {D}]"), apis=("native",)),
    Bad("split_v_cache_5d", SPLIT, put("v_cache", lambda a: a["v_cache"][..., None]), ValueError, "v_cache",
        ("expected a 4-D tensor [num_blocks, num_kv_heads, head_size, block_size] (split layout)",
         f"got shape [{NB}, {HKV}, {D}, {BS}, 1]")),
    Bad("split_x_not_dividing_head_size", SPLIT, put("k_cache", lambda a: randn(NB, HKV, 10, BS, 3)), ValueError,
        "k_cache", (f"expected x (dim 4) >= 1 dividing head_size {D} (e.g. 8)",
                    f"got x=3 in shape [{NB}, {HKV}, 10, {BS}, 3]")),
    Bad("split_x_zero", SPLIT, put("k_cache", lambda a: randn(NB, HKV, D, BS, 0)), ValueError, "k_cache",
        (f"expected x (dim 4) >= 1 dividing head_size {D}", "got x=0")),
    Bad("split_x_fp8_head_24_x_16", FP8_D24, put("k_cache", lambda a: randn(NB, HKV, 1, BS, 16).to(torch.uint8)),
        ValueError, "k_cache", ("expected x (dim 4) >= 1 dividing head_size 24 (e.g. 8)", "got x=16")),
    Bad("split_x_4_too_few_chunks", SPLIT, put("k_cache", lambda a: a["k_cache"].reshape(NB, HKV, D // 8, BS, 8)
                                                [..., :4]), ValueError, "k_cache",
        (f"expected shape [num_blocks, {HKV}, {D // 4}, block_size, 4]", f"got [{NB}, {HKV}, {D // 8}, {BS}, 4]")),
    Bad("split_k_cache_heads", SPLIT, put("k_cache", lambda a: a["k_cache"][:, :1]), ValueError, "k_cache",
        (f"expected shape [num_blocks, {HKV}, {D // 8}, block_size, 8]", f"got [{NB}, 1, {D // 8}, {BS}, 8]")),
    Bad("split_k_cache_head_size", SPLIT, put("k_cache", lambda a: a["k_cache"][:, :, :3]), ValueError, "k_cache",
        (f"expected shape [num_blocks, {HKV}, {D // 8}, block_size, 8]", f"got [{NB}, {HKV}, 3, {BS}, 8]")),
    Bad("split_v_cache_block_size", SPLIT, put("v_cache", lambda a: a["v_cache"][..., :4]), ValueError, "v_cache",
        (f"expected shape [{NB}, {HKV}, {D}, {BS}]", f"got [{NB}, {HKV}, {D}, 4]")),
    Bad("split_v_cache_num_blocks", SPLIT, put("v_cache", lambda a: a["v_cache"][:-1]), ValueError, "v_cache",
        (f"expected shape [{NB}, {HKV}, {D}, {BS}]", f"got [{NB - 1}, {HKV}, {D}, {BS}]")),
    Bad("nhd_forced_on_5d_key", SPLIT, put("_layout", lambda a: "nhd"), ValueError, "k_cache",
        ("expected a 4-D tensor [num_blocks, block_size, num_kv_heads, head_size] (NHD layout)",
         f"got shape [{NB}, {HKV}, {D // 8}, {BS}, 8]"), apis=("native",)),
    Bad("nhd_k_cache_heads", NHD, put("k_cache", lambda a: a["k_cache"][:, :, :1]), ValueError, "k_cache",
        (f"expected shape [num_blocks, block_size, {HKV}, {D}]", f"got [{NB}, {BS}, 1, {D}]")),
    Bad("new_tokens_heads_differ_from_cache", NHD, puts(k=lambda a: randn(T, 1, D), v=lambda a: randn(T, 1, D)),
        ValueError, "k_cache", (f"expected shape [num_blocks, block_size, 1, {D}] (the 1 KV heads of k and v, "
                                f"shape [{T}, 1, {D}]: if the cache's {HKV} are right, k and v are the tensors to fix)",
                                f"got [{NB}, {BS}, {HKV}, {D}]")),
    Bad("nhd_k_cache_head_size", NHD, put("k_cache", lambda a: a["k_cache"][..., :16]), ValueError, "k_cache",
        (f"expected shape [num_blocks, block_size, {HKV}, {D}]", f"got [{NB}, {BS}, {HKV}, 16]")),
    Bad("nhd_v_cache_shape", NHD, put("v_cache", lambda a: a["v_cache"][:, :4]), ValueError, "v_cache",
        (f"expected shape [{NB}, {BS}, {HKV}, {D}] (the shape of k_cache)", f"got [{NB}, 4, {HKV}, {D}]")),
    Bad("block_size_0", NHD, both_caches(lambda t: t[:, :0]), ValueError, "k_cache",
        ("expected block_size >= 1", "got 0")),
    Bad("k_scale_two_elements", FP8, put("k_scale", lambda a: torch.tensor([0.5, 0.5])), ValueError, "k_scale",
        ("expected a float or a 1-element tensor", "got shape [2]")),
    Bad("v_scale_int_tensor", FP8, put("v_scale", lambda a: torch.tensor(1)), TypeError, "v_scale",
        (f"expected dtype {FLOATS}", "got int64")),
    Bad("k_scale_device", FP8, put("k_scale", lambda a: torch.empty((), device="meta")), ValueError, "k_scale",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("k_scale_str", FP8, put("k_scale", lambda a: "0.1"), TypeError, "k_scale",
        ("expected a float or a 1-element tensor", "got str")),
    Bad("k_scale_zero", FP8, put("k_scale", lambda a: 0.0), ValueError, "k_scale",
        ("expected a finite positive scale", "got 0.0")),
    Bad("v_scale_negative", FP8, put("v_scale", lambda a: -0.5), ValueError, "v_scale",
        ("expected a finite positive scale", "got -0.5")),
    Bad("v_scale_nan", FP8, put("v_scale", lambda a: float("nan")), ValueError, "v_scale",
        ("expected a finite positive scale", "got nan")),
    Bad("k_scale_inf", FP8, put("k_scale", lambda a: float("inf")), ValueError, "k_scale",
        ("expected a finite positive scale", "got inf")),
    Bad("kv_dtype_unknown", NHD, put("kv_cache_dtype", lambda a: "fp16"), ValueError, "kv_cache_dtype",
        ("expected one of ['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2']", "got 'fp16'")),
    Bad("kv_dtype_unknown_fp8_variant", FP8, put("kv_cache_dtype", lambda a: "fp8_e3m4"), ValueError,
        "kv_cache_dtype", ("expected one of", "got 'fp8_e3m4'")),
    Bad("kv_dtype_not_str", NHD, put("kv_cache_dtype", lambda a: None), TypeError, "kv_cache_dtype",
        ("expected a str such as 'auto'", "got NoneType")),
    Bad("kv_dtype_torch_dtype", NHD, put("kv_cache_dtype", lambda a: torch.float16), TypeError, "kv_cache_dtype",
        ("expected a str", "got dtype")),
    # -- batch metadata --------------------------------------------------------------------------------
    Bad("b_loc_not_tensor", NHD, put("b_loc", lambda a: a["b_loc"].tolist()), TypeError, "b_loc",
        ("expected a torch.Tensor", "got list")),
    Bad("b_start_loc_not_tensor", NHD, put("b_start_loc", lambda a: None), TypeError, "b_start_loc",
        ("expected a torch.Tensor", "got NoneType")),
    Bad("b_seq_len_float", NHD, put("b_seq_len", lambda a: a["b_seq_len"].float()), TypeError, "b_seq_len",
        (f"expected dtype {INTS}", "got float32")),
    Bad("b_ctx_len_int16", NHD, put("b_ctx_len", lambda a: a["b_ctx_len"].to(torch.int16)), TypeError,
        "b_ctx_len", (f"expected dtype {INTS}", "got int16")),
    Bad("b_loc_float", NHD, put("b_loc", lambda a: a["b_loc"].double()), TypeError, "b_loc",
        (f"expected dtype {INTS}", "got float64")),
    Bad("b_start_loc_uint8", NHD, put("b_start_loc", lambda a: a["b_start_loc"].to(torch.uint8)), TypeError,
        "b_start_loc", (f"expected dtype {INTS}", "got uint8")),
    Bad("b_start_loc_device", NHD, put("b_start_loc", lambda a: meta(a["b_start_loc"])), ValueError,
        "b_start_loc", ("expected a tensor on cpu", "got one on meta")),
    Bad("b_loc_device", NHD, put("b_loc", lambda a: meta(a["b_loc"])), ValueError, "b_loc",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("b_seq_len_2d", NHD, put("b_seq_len", lambda a: a["b_seq_len"][None]), ValueError, "b_seq_len",
        ("expected a 1-D tensor [num_seqs]", f"got shape [1, {B}]")),
    Bad("b_ctx_len_2d", NHD, put("b_ctx_len", lambda a: a["b_ctx_len"][:, None]), ValueError, "b_ctx_len",
        ("expected a 1-D tensor [num_seqs]", f"got shape [{B}, 1]")),
    Bad("b_ctx_len_length", NHD, put("b_ctx_len", lambda a: a["b_ctx_len"][:-1]), ValueError, "b_ctx_len",
        (f"expected shape [{B}] (as b_seq_len)", f"got [{B - 1}]")),
    Bad("b_seq_len_length", NHD, put("b_seq_len", lambda a: a["b_seq_len"][:-1]), ValueError, "b_ctx_len",
        (f"expected shape [{B - 1}] (as b_seq_len)", f"got [{B}]")),
    Bad("b_start_loc_2d", NHD, put("b_start_loc", lambda a: a["b_start_loc"][None]), ValueError, "b_start_loc",
        ("expected a 1-D tensor [num_seqs] or [num_seqs + 1]", f"got shape [1, {B + 1}]")),
    Bad("b_start_loc_short", NHD, put("b_start_loc", lambda a: a["b_start_loc"][:B - 1]), ValueError,
        "b_start_loc", (f"expected shape [{B}] or [{B + 1}]", f"got [{B - 1}]")),
    Bad("b_start_loc_long", NHD, put("b_start_loc", lambda a: torch.cat([a["b_start_loc"], a["b_start_loc"][-1:]])),
        ValueError, "b_start_loc", (f"expected shape [{B}] or [{B + 1}]", f"got [{B + 2}]")),
    Bad("b_loc_1d", NHD, put("b_loc", lambda a: a["b_loc"][0]), ValueError, "b_loc",
        ("expected a 2-D tensor [num_seqs, max_blocks_per_seq]", f"got shape [{WIDTH}]")),
    Bad("b_loc_rows", NHD, put("b_loc", lambda a: a["b_loc"][:-1]), ValueError, "b_loc",
        (f"expected {B} rows (one per sequence)", f"got shape [{B - 1}, {WIDTH}]")),
    Bad("max_input_len_negative", NHD, put("max_input_len", lambda a: -1), ValueError, "max_input_len",
        ("expected a non-negative int", "got -1")),
    Bad("max_input_len_float", NHD, put("max_input_len", lambda a: 17.0), ValueError, "max_input_len",
        ("expected a non-negative int", "got 17.0")),
    Bad("max_input_len_bool", NHD, put("max_input_len", lambda a: True), ValueError, "max_input_len",
        ("expected a non-negative int", "got True")),
    Bad("max_input_len_str", NHD, put("max_input_len", lambda a: "17"), ValueError, "max_input_len",
        ("expected a non-negative int", "got '17'")),
    # -- options ---------------------------------------------------------------------------------------
    Bad("sm_scale_zero", NHD, put("sm_scale", lambda a: 0.0), ValueError, "sm_scale",
        ("expected a finite positive float or None", "got 0.0")),
    Bad("sm_scale_negative", NHD, put("sm_scale", lambda a: -0.1), ValueError, "sm_scale",
        ("expected a finite positive float or None", "got -0.1")),
    Bad("sm_scale_nan", NHD, put("sm_scale", lambda a: float("nan")), ValueError, "sm_scale",
        ("expected a finite positive float or None", "got nan")),
    Bad("sm_scale_inf", NHD, put("sm_scale", lambda a: float("inf")), ValueError, "sm_scale",
        ("expected a finite positive float or None", "got inf")),
    Bad("sm_scale_str", NHD, put("sm_scale", lambda a: "0.1"), ValueError, "sm_scale",
        ("expected a finite positive float or None", "got '0.1'")),
    Bad("alibi_not_tensor", FEATURES, put("alibi_slopes", lambda a: a["alibi_slopes"].tolist()), TypeError,
        "alibi_slopes", ("expected a torch.Tensor", "got list")),
    Bad("alibi_shape", FEATURES, put("alibi_slopes", lambda a: a["alibi_slopes"][:HKV]), ValueError,
        "alibi_slopes", (f"expected shape [{H}] (one per query head)", f"got [{HKV}]")),
    Bad("alibi_2d", FEATURES, put("alibi_slopes", lambda a: a["alibi_slopes"][None]), ValueError, "alibi_slopes",
        (f"expected shape [{H}] (one per query head)", f"got [1, {H}]")),
    Bad("alibi_int", FEATURES, put("alibi_slopes", lambda a: torch.arange(H)), TypeError, "alibi_slopes",
        (f"expected dtype {FLOATS}", "got int64")),
    Bad("alibi_device", FEATURES, put("alibi_slopes", lambda a: meta(a["alibi_slopes"])), ValueError,
        "alibi_slopes", ("expected a tensor on cpu", "got one on meta")),
    Bad("sinks_not_tensor", FEATURES, put("sinks", lambda a: 0.5), TypeError, "sinks",
        ("expected a torch.Tensor", "got float")),
    Bad("sinks_shape", FEATURES, put("sinks", lambda a: torch.cat([a["sinks"], a["sinks"]])), ValueError, "sinks",
        (f"expected shape [{H}] (one per query head)", f"got [{2 * H}]")),
    Bad("sinks_float64", FEATURES, put("sinks", lambda a: a["sinks"].double()), TypeError, "sinks",
        (f"expected dtype {FLOATS}", "got float64")),
    Bad("sinks_device", FEATURES, put("sinks", lambda a: meta(a["sinks"])), ValueError, "sinks",
        ("expected a tensor on cpu", "got one on meta")),
    Bad("sliding_window_negative", FEATURES, put("sliding_window", lambda a: -1), ValueError, "sliding_window",
        ("expected None or an int >= 0 (0 = no window)", "got -1"), apis=("native",)),
    Bad("sliding_window_float", FEATURES, put("sliding_window", lambda a: 2.5), ValueError, "sliding_window",
        ("expected None or an int >= 0 (0 = no window)", "got 2.5")),
    Bad("sliding_window_bool", FEATURES, put("sliding_window", lambda a: True), ValueError, "sliding_window",
        ("expected None or an int >= 0 (0 = no window)", "got True")),
    Bad("sliding_window_str", FEATURES, put("sliding_window", lambda a: "8"), ValueError, "sliding_window",
        ("expected None or an int >= 0 (0 = no window)", "got '8'")),
    Bad("softcap_negative", FEATURES, put("softcap", lambda a: -1.0), ValueError, "softcap",
        ("expected a finite float >= 0 (0 = off)", "got -1.0")),
    Bad("softcap_nan", FEATURES, put("softcap", lambda a: float("nan")), ValueError, "softcap",
        ("expected a finite float >= 0 (0 = off)", "got nan")),
    Bad("softcap_none", FEATURES, put("softcap", lambda a: None), ValueError, "softcap",
        ("expected a finite float >= 0 (0 = off)", "got None")),
    # -- the "full" checks: metadata values ------------------------------------------------------------
    Bad("ctx_negative", NHD, set_item("b_ctx_len", 1, -3), ValueError, "b_ctx_len",
        ("expected values >= 0", "got b_ctx_len[1]=-3")),
    Bad("seq_len_below_ctx_len", NHD, set_item("b_seq_len", 1, 30), ValueError, "b_seq_len",
        ("expected b_seq_len[i] >= b_ctx_len[i]", "got b_seq_len[1]=30 < b_ctx_len[1]=40")),
    Bad("start_negative", NHD, put("b_start_loc", lambda a: a["b_start_loc"] - 1), ValueError, "b_start_loc",
        ("expected offsets >= 0", "got b_start_loc[0]=-1")),
    Bad("start_decreasing", NHD, set_item("b_start_loc", 2, 3), ValueError, "b_start_loc",
        ("expected non-decreasing offsets", "got [0, 5, 3, 23, 23, 26]")),
    Bad("start_inconsistent", NHD, set_item("b_start_loc", 2, 7), ValueError, "b_start_loc",
        ("expected packed sequences (b_start_loc[i + 1] = b_start_loc[i] + b_seq_len[i] - b_ctx_len[i])",
         "got b_start_loc[2]=7, expected 6")),
    Bad("start_last_entry_inconsistent", NHD, set_item("b_start_loc", B, T - 1), ValueError, "b_start_loc",
        ("expected packed sequences", f"got b_start_loc[{B}]={T - 1}, expected {T}")),
    Bad("seq_len_disagrees_with_starts", NHD, set_item("b_seq_len", 0, 9 + 6), ValueError, "b_start_loc",
        ("expected packed sequences", "got b_start_loc[1]=5, expected 6")),
    Bad("ctx_len_disagrees_with_starts", NHD, set_item("b_ctx_len", 2, 1), ValueError, "b_start_loc",
        ("expected packed sequences", "got b_start_loc[3]=23, expected 22")),
    Bad("lengths_past_tokens_b_entries", NHD.replace(start_loc_entries="B"), set_item("b_seq_len", 4, 1 + 3 + 1),
        ValueError, "b_seq_len/b_ctx_len", (f"to end within the {T} tokens of q", f"got an end at {T + 1}")),
    Bad("starts_shifted_past_tokens", NHD.replace(start_loc_entries="B"),
        put("b_start_loc", lambda a: a["b_start_loc"] + 2), ValueError, "b_seq_len/b_ctx_len",
        (f"to end within the {T} tokens of q", f"got an end at {T + 2}")),
    Bad("max_input_len_too_small", NHD, put("max_input_len", lambda a: 16), ValueError, "max_input_len",
        ("expected >= the longest query (17)", "got 16")),
    Bad("max_input_len_zero", NHD, put("max_input_len", lambda a: 0), ValueError, "max_input_len",
        ("expected >= the longest query (17)", "got 0")),
    Bad("block_table_too_narrow", NHD, put("b_loc", lambda a: a["b_loc"][:, :4]), ValueError, "b_loc",
        ("expected at least 5 columns (sequence 1 has 40 cached tokens, needing 5 blocks of 8)", "got 4 columns")),
    Bad("block_table_no_columns", NHD, put("b_loc", lambda a: a["b_loc"][:, :0]), ValueError, "b_loc",
        ("expected at least 5 columns (sequence 1 has 40 cached tokens, needing 5 blocks of 8)", "got 0 columns")),
    Bad("block_entry_too_large", NHD, set_item("b_loc", (1, 4), NB), ValueError, "b_loc",
        (f"expected block numbers in [0, {NB})", f"got {NB} at [1, 4] (sequence 1 uses 5 blocks)")),
    Bad("block_entry_negative", SPLIT, set_item("b_loc", (0, 0), -1), ValueError, "b_loc",
        (f"expected block numbers in [0, {NB})", "got -1 at [0, 0] (sequence 0 uses 2 blocks)")),
    Bad("block_entry_huge_fp8", FP8, set_item("b_loc", (4, 0), 2**31 - 1), ValueError, "b_loc",
        (f"expected block numbers in [0, {NB})", f"got {2**31 - 1} at [4, 0]")),
]


def _params():
    for case in CASES:
        for api in case.apis:
            yield pytest.param(case, api, id=f"{case.id}-{api}")


def _snapshot(a: dict) -> dict:
    return {name: t.clone() for name, t in a.items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"}


def _assert_untouched(a: dict, before: dict) -> None:
    for name, old in before.items():
        new = a[name]
        assert new.dtype == old.dtype and new.shape == old.shape, name
        if new.is_floating_point() and new.dtype.itemsize > 1:
            assert torch.equal(torch.isnan(new), torch.isnan(old)), f"{name} was modified by a rejected call"
            assert torch.equal(torch.nan_to_num(new), torch.nan_to_num(old)), f"{name} was modified"
        else:
            assert torch.equal(new.view(torch.uint8) if new.dtype.itemsize == 1 else new,
                               old.view(torch.uint8) if old.dtype.itemsize == 1 else old), f"{name} was modified"


def test_base_geometry():
    """The constants used in the expected messages describe the base batch."""
    p = make_problem(NHD)
    assert (p.batch.num_seqs, p.num_tokens, p.num_heads, p.num_kv_heads, p.head_size) == (B, T, H, HKV, D)
    assert (p.cache.block_size, p.cache.num_blocks, p.batch.block_table.shape[1]) == (BS, NB, WIDTH)
    assert p.batch.max_query_len == 17
    assert make_problem(SPLIT).cache.key.shape == (NB, HKV, D // 8, BS, 8)
    assert make_problem(FP8).cache.key.shape == (NB, HKV, D // 16, BS, 16)


@pytest.mark.parametrize("spec", [NHD, SPLIT, SPLIT_F32, FP8, FP8_NHD, FP8_D24, FEATURES,
                                  NHD.replace(start_loc_entries="B"), FP8_QUERY,
                                  FP8_QUERY.replace(kv_cache_dtype="fp8_e4m3", kv_in_cache=True,
                                                    scale_as_tensor=True)], ids=lambda s: s.describe())
@pytest.mark.parametrize("api", sorted(CALLS))
def test_valid_base_problems_pass(spec, api):
    """Every unbroken base problem passes full validation and gets a finite output, so each failure below
    is caused by the one thing its case breaks."""
    a = drop_in_args(make_problem(spec))
    out = CALLS[api](a)
    assert out is a["o"]
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("case, api", list(_params()))
def test_bad_input_is_rejected(case: Bad, api: str):
    a = drop_in_args(make_problem(case.spec))
    case.brk(a)
    before = _snapshot(a)
    with pytest.raises(case.exc) as info:
        CALLS[api](a)
    assert type(info.value) is case.exc
    message = str(info.value)
    arg = "o" if case.arg == "out" and api == "drop_in" else as_written(case.arg, api)  # as each caller wrote it
    assert message.startswith(f"{arg}:"), message
    for part in case.parts:
        part = as_written(part, api)
        assert part in message, f"{part!r} not in {message!r}"
    assert not TORCH_DTYPE.search(message), f"dtypes are spelled without 'torch.': {message!r}"
    _assert_untouched(a, before)


@pytest.mark.parametrize("api", sorted(CALLS))
@pytest.mark.parametrize("mode", ["fast", "", None, "FULL"])
def test_unknown_validate_mode(api, mode):
    a = drop_in_args(make_problem(NHD))
    before = _snapshot(a)
    with pytest.raises(ValueError, match=r"^validate: expected 'basic' or 'full', got "):
        CALLS[api](a, validate=mode)
    _assert_untouched(a, before)


def test_validate_problem_direct():
    """``validate_problem`` itself: the basic level reads no metadata values, the full level does."""
    p = make_problem(NHD)
    bad_ctx = p.batch.context_lens.clone()
    bad_ctx[3] = -1
    broken = pp.PrefillProblem(p.q, p.k, p.v, p.out, p.cache,
                               pp.BatchMetadata(p.batch.query_start, p.batch.seq_lens, bad_ctx,
                                                p.batch.block_table, p.batch.max_query_len))
    pp.validate_problem(broken, "basic")
    pp.validate_problem(broken)  # "basic" is the default
    with pytest.raises(ValueError, match=r"^context_lens: expected values >= 0, got context_lens\[3\]=-1$"):
        pp.validate_problem(broken, "full")
    pp.validate_problem(p, "full")


@pytest.mark.parametrize("api", sorted(CALLS))
def test_unused_block_table_columns_are_not_checked(api):
    """Columns past a sequence's blocks may hold anything (engines pad with junk); results are unchanged."""
    p = make_problem(NHD)
    a = drop_in_args(p)
    expected = call_drop_in(dict(a, o=torch.full_like(p.q, float("nan"))))
    table = a["b_loc"].clone()
    # sequence 2 has no context, so its whole row is unused; sequence 0 uses 2 of 5 columns
    table[2] = -7
    table[0, 2:] = torch.tensor([NB, 10 * NB, -1], dtype=table.dtype)
    a["b_loc"] = table
    out = CALLS[api](a)
    assert torch.equal(out, expected)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("api", sorted(CALLS))
def test_max_input_len_none_and_exact_are_accepted(api):
    a = drop_in_args(make_problem(NHD))
    ref = CALLS[api](dict(a, o=torch.full_like(a["q"], float("nan"))))
    for value in (None, 17, 1000):
        out = CALLS[api](dict(a, o=torch.full_like(a["q"], float("nan")), max_input_len=value))
        assert torch.equal(out, ref)


def test_kv_cache_dtype_parse():
    parse = pp.KVCacheDType.parse
    assert parse("auto") is pp.KVCacheDType.AUTO
    assert parse("fp8") is pp.KVCacheDType.FP8_E4M3
    assert parse("FP8_E5M2") is pp.KVCacheDType.FP8_E5M2
    assert parse(pp.KVCacheDType.FP8_E4M3) is pp.KVCacheDType.FP8_E4M3
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: expected one of .*, got 'int8'$"):
        parse("int8")
    with pytest.raises(TypeError, match=r"^kv_cache_dtype: expected a str .*, got int$"):
        parse(8)


def _native_parts(spec: BatchSpec = NHD):
    """q, k, v, cache and the per-sequence lengths and table of a valid native call."""
    p = make_problem(spec)
    b = p.batch
    query_lens = (b.seq_lens - b.context_lens).tolist()
    return p, query_lens, b.context_lens.tolist(), b.block_table


def test_from_lengths_refuses_lengths_of_different_counts():
    _, _, _, table = _native_parts()
    with pytest.raises(ValueError, match=r"^context_lens: expected one length per sequence, as many as query_lens "
                                         r"\(2\), got 3$"):
        pp.BatchMetadata.from_lengths([5, 1], [40, 17, 0], table[:2])
    with pytest.raises(ValueError, match=r"^context_lens: .* as many as query_lens \(3\), got 2$"):
        pp.BatchMetadata.from_lengths([5, 1, 4], [40, 17], table[:3])


def test_from_lengths_refuses_a_block_table_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"^block_table: expected a torch.Tensor, got list$"):
        pp.BatchMetadata.from_lengths([5, 1], [40, 17], [[0, 1], [2, 3]])


@pytest.mark.parametrize("query_lens, context_lens, error, pattern", [
    ([5, -1, 4], [40, 17, 0], ValueError, r"^query_lens\[1\]: expected a length in \[0, 2\*\*31\), got -1$"),
    ([5, 1, 4], [40, 17, -3], ValueError, r"^context_lens\[2\]: expected a length in \[0, 2\*\*31\), got -3$"),
    ([5, 1.0, 4], [40, 17, 0], TypeError, r"^query_lens\[1\]: expected an int >= 0, got 1\.0$"),
    ([5, True, 4], [40, 17, 0], TypeError, r"^query_lens\[1\]: expected an int >= 0, got True$"),
    ([5, 1, 4], [40, 2**31, 0], ValueError,
     r"^context_lens\[1\]: expected a length in \[0, 2\*\*31\), got 2147483648$"),
    ([5, 1, 4], [40, 2**31 - 1, 0], ValueError,
     r"^context_lens\[1\]: expected query_lens\[1\] \+ context_lens\[1\] < 2\*\*31, got 1 \+ 2147483647$"),
    (7, [40, 17, 0], TypeError, r"^query_lens: expected a list of ints \(one length per sequence\), got int$"),
    ([5, 1, 4], "40,17,0", TypeError, r"^context_lens: expected a list of ints \(one length per sequence\), got str$"),
    (torch.tensor([5.0, 1.0, 4.0]), [40, 17, 0], TypeError,
     r"^query_lens: expected a list of ints or a 1-D integer tensor .*, got a 1-D tensor of dtype float32$"),
])
def test_from_lengths_names_the_length_the_caller_wrote(query_lens, context_lens, error, pattern):
    """A bad length is refused at construction, by its index in the list the caller wrote (not later, at the
    call, through the query_start offsets derived from it)."""
    table = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(error, match=pattern):
        pp.BatchMetadata.from_lengths(query_lens, context_lens, table)


@pytest.mark.parametrize("table, error, pattern", [
    (torch.zeros(12, dtype=torch.int32), ValueError,
     r"^block_table: expected a 2-D tensor \[num_seqs, max_blocks_per_seq\], got shape \[12\]$"),
    (torch.zeros(3, 4), TypeError, r"^block_table: expected dtype int32 or int64, got float32$"),
    (torch.zeros(2, 4, dtype=torch.int64), ValueError,
     r"^block_table: expected 3 rows \(one per sequence, as many as query_lens\), got shape \[2, 4\]$"),
])
def test_from_lengths_refuses_a_bad_block_table_at_construction(table, error, pattern):
    with pytest.raises(error, match=pattern):
        pp.BatchMetadata.from_lengths([5, 1, 4], [40, 17, 0], table)


def test_from_lengths_takes_tuples_and_integer_tensors():
    table = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    from_lists = pp.BatchMetadata.from_lengths([5, 1, 4], [9, 0, 3], table)
    from_tensors = pp.BatchMetadata.from_lengths(torch.tensor([5, 1, 4]), (9, 0, 3), table)
    for a, b in ((from_lists.query_start, from_tensors.query_start), (from_lists.seq_lens, from_tensors.seq_lens)):
        assert torch.equal(a, b)
    assert from_lists.query_start.tolist() == [0, 5, 6, 10] and from_lists.max_query_len == 5


def test_native_errors_name_the_native_arguments():
    """A native caller wrote block_table, query_start, max_query_len...: errors use those names, not the
    drop-in's b_loc, b_start_loc, max_input_len."""
    p, query_lens, context_lens, table = _native_parts()
    good = pp.BatchMetadata.from_lengths(query_lens, context_lens, table)
    batch = dataclasses.replace(good, block_table=table.float())
    with pytest.raises(TypeError, match=r"^block_table: expected dtype int32 or int64, got float32$"):
        pp.prefill_attention(p.q, p.k, p.v, p.cache, batch, backend="reference")
    checks = [
        (dataclasses.replace(good, max_query_len=1), ValueError, r"^max_query_len: expected >= the longest query"),
        (dataclasses.replace(good, query_start=good.query_start[:2]), ValueError, r"^query_start: expected shape"),
        (dataclasses.replace(good, context_lens=good.context_lens.float()), TypeError, r"^context_lens: expected"),
        (dataclasses.replace(good, seq_lens=good.seq_lens - 100), ValueError,
         r"^seq_lens: expected seq_lens\[i\] >= context_lens\[i\], got seq_lens\[3\]=-94 < context_lens\[3\]=6$"),
        (dataclasses.replace(good, query_start=good.query_start.flip(0)), ValueError,
         r"^query_start: expected non-decreasing offsets, got \[26, 23, 23, 6, 5, 0\]$"),
    ]
    for batch, exc, pattern in checks:
        with pytest.raises(exc, match=pattern):
            pp.prefill_attention(p.q, p.k, p.v, p.cache, batch, backend="reference", validate="full")


def test_context_lengths_are_the_given_tensor_or_derived_from_the_starts():
    p, query_lens, context_lens, table = _native_parts()
    given = pp.BatchMetadata.from_lengths(query_lens, context_lens, table)
    assert given.context_lengths() is given.context_lens
    derived = dataclasses.replace(given, context_lens=None, query_start=given.query_start.long())
    lengths = derived.context_lengths()
    assert lengths.dtype == given.seq_lens.dtype and lengths.tolist() == list(context_lens)
    short = dataclasses.replace(derived, query_start=derived.query_start[:-1])
    with pytest.raises(ValueError, match=r"^query_start: expected shape \[6\] \(num_seqs \+ 1 entries: context lengths "
                                         r"are derived from consecutive starts\), got \[5\]$"):
        short.context_lengths()


def test_a_batch_without_context_lengths_is_checked_on_its_starts():
    """``context_lens=None`` (derived from the starts) needs ``B + 1`` starts; the values checks read the derived
    lengths, and a negative one is reported on ``seq_lens``, the argument that implies it."""
    p, query_lens, context_lens, table = _native_parts()
    given = pp.BatchMetadata.from_lengths(query_lens, context_lens, table)
    derived = dataclasses.replace(given, context_lens=None)
    expected = pp.prefill_attention(p.q, p.k, p.v, p.cache, given, backend="reference", validate="full")
    got = pp.prefill_attention(p.q, p.k, p.v, p.cache, derived, backend="reference", validate="full")
    assert torch.equal(got, expected)
    short = dataclasses.replace(derived, seq_lens=derived.seq_lens.clone())
    short.seq_lens[2] = 16  # sequence 2 has 17 new tokens
    checks = [
        (dataclasses.replace(derived, query_start=derived.query_start[:5]), "basic",
         r"^query_start: expected shape \[6\] \(num_seqs \+ 1 entries: query lengths are the differences of "
         r"consecutive starts\), got \[5\]$"),
        (dataclasses.replace(derived, query_start=derived.query_start[None]), "basic",
         r"^query_start: expected a 1-D tensor \[num_seqs \+ 1\], got shape \[1, 6\]$"),
        (short, "full", r"^seq_lens: expected seq_lens\[i\] >= query_start\[i \+ 1\] - query_start\[i\] \(the new "
                        r"tokens of sequence i\), got seq_lens\[2\]=16 < 17$"),
    ]
    for batch, validate, pattern in checks:
        with pytest.raises(ValueError, match=pattern):
            pp.prefill_attention(p.q, p.k, p.v, p.cache, batch, backend="reference", validate=validate)


def test_custom_operator_errors_name_its_arguments():
    """The operators' arguments are called block_table, query_start...: errors say so too."""
    p = make_problem(NHD)
    b = p.batch
    with pytest.raises(TypeError, match=r"^block_table: expected dtype int32 or int64, got float32$"):
        torch.ops.pagedprefill.prefill_attention(p.q, p.k, p.v, p.cache.key, p.cache.value, b.block_table.float(),
                                                 b.query_start, b.seq_lens, b.context_lens, backend="reference")


def test_drop_in_errors_keep_the_drop_in_names():
    a = drop_in_args(make_problem(NHD))
    a["b_loc"] = a["b_loc"].float()
    with pytest.raises(TypeError, match=r"^b_loc: expected dtype int32 or int64, got float32$"):
        call_drop_in(a)


def test_dtype_name_is_the_one_spelling_of_dtypes_in_messages():
    from pagedprefill.validation import dtype_name

    assert [dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.int32, torch.uint8, torch.float8_e4m3fn)] \
        == ["float16", "bfloat16", "int32", "uint8", "float8_e4m3fn"]
