"""The reference implementation against an independent, deliberately naive float64 oracle.

The oracle below loops over sequences, heads and query tokens in Python, builds each sequence's key/value
list by reading the paged cache token by token through the block table (from the layout definitions, FP8
bytes decoded and scaled), and applies the documented semantics one query at a time: logits scaled, then
soft-capped, then ALiBi ``slope * (key_pos - query_pos)``; causal and window ``query_pos - key_pos < window``
masks; ``exp(sink)`` in the denominator; rows with no visible key are zeros. The options: ``causal=False``
(later new tokens visible too), ``k = v = None`` (new tokens' keys/values read from the cache like the
context), ``skip_decode`` (one-token sequences stay unwritten) and ``fp8_out_scale`` (``clamp(out / scale)``
rounded to FP8 e4m3).
"""

from __future__ import annotations

import math

import pagedprefill as pp
import pagedprefill.reference_impl as reference_module
import pytest
import torch
from pagedprefill.testing import (
    CASES,
    BatchSpec,
    case_spec,
    fresh_output,
    make_problem,
    random_spec,
    sdpa_float64,
    with_output,
)
from pagedprefill.testing.cases import FP8_OUT_TOLERANCE, written_rows

#: (atol, rtol) of the float32-compute reference against the float64 oracle, by output dtype: the output
#: rounding (half an ulp: 2^-11 fp16, 2^-8 bf16) dominates, plus float32 accumulation for float32 outputs.
TOLERANCES = {
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
    torch.float32: (1e-5, 1e-5),
}
#: float64 compute against the float64 oracle: only summation order differs.
TIGHT = (1e-10, 1e-9)


def _scalar(s) -> float:
    return float(s.reshape(())) if isinstance(s, torch.Tensor) else float(s)


def _decoded_cache(cache: pp.PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache tensors as float64 values (FP8 bytes reinterpreted in their format and scaled)."""
    if cache.dtype.is_fp8:
        fmt = cache.dtype.torch_dtype
        return (cache.key.view(fmt).double() * _scalar(cache.k_scale),
                cache.value.view(fmt).double() * _scalar(cache.v_scale))
    return cache.key.double(), cache.value.double()


def _read_cached_token(cache: pp.PagedKVCache, kc, vc, block: int, offset: int):
    """K and V ``[Hkv, D]`` of the cached token at (physical ``block``, ``offset``)."""
    hkv, d = cache.num_kv_heads, cache.head_size
    if cache.layout is pp.KVLayout.SPLIT:
        x = cache.x
        dims = torch.arange(d)
        k = torch.stack([kc[block, h][dims // x, offset, dims % x] for h in range(hkv)])
        v = torch.stack([vc[block, h, :, offset] for h in range(hkv)])
    else:
        k, v = kc[block, offset], vc[block, offset]
    assert k.shape == v.shape == (hkv, d)
    return k, v


def oracle(problem: pp.PrefillProblem) -> torch.Tensor:
    """Float64 output ``[T, H, D]`` of ``problem`` before any FP8 output rounding (see :func:`_as_output`);
    rows of tokens outside every sequence, or skipped by ``skip_decode``, are NaN."""
    p = problem
    T, H, D = p.q.shape
    hkv = p.num_kv_heads
    group = H // hkv
    out = torch.full((T, H, D), float("nan"), dtype=torch.float64)
    q = p.q.double() * _scalar(p.options.q_scale)  # an FP8 q holds q / q_scale
    from_cache = p.k is None
    if not from_cache:
        k_new, v_new = p.k.double(), p.v.double()
    kc, vc = _decoded_cache(p.cache)
    bs = p.cache.block_size
    table = p.batch.block_table.tolist()
    seq_lens, ctx_lens, starts = (p.batch.seq_lens.tolist(), p.batch.context_lengths().tolist(),
                                  p.batch.query_start.tolist())
    opts = p.options
    sm_scale = opts.sm_scale if opts.sm_scale is not None else 1.0 / math.sqrt(D)
    window = opts.sliding_window or 0
    slopes = opts.alibi_slopes.double().tolist() if opts.alibi_slopes is not None else None
    sinks = opts.sinks.double().tolist() if opts.sinks is not None else None
    for i in range(len(seq_lens)):
        ctx, n, s0 = ctx_lens[i], seq_lens[i] - ctx_lens[i], starts[i]
        if opts.skip_decode and n == 1:
            continue
        keys, values = [], []
        for pos in range(ctx + n if from_cache else ctx):
            k, v = _read_cached_token(p.cache, kc, vc, table[i][pos // bs], pos % bs)
            keys.append(k)
            values.append(v)
        for t in range(0 if from_cache else n):
            keys.append(k_new[s0 + t])
            values.append(v_new[s0 + t])
        if not keys:
            continue
        keys, values = torch.stack(keys), torch.stack(values)  # [ctx + n, Hkv, D], position order
        for h in range(H):
            kv_head = h // group
            for t in range(n):
                query_pos = ctx + t
                # visible: key_pos <= query_pos (causal; any new token without) and query_pos - key_pos < window
                first = max(0, query_pos - window + 1) if window > 0 else 0
                visible = torch.arange(first, query_pos + 1 if opts.causal else ctx + n)
                if visible.numel() == 0:
                    out[s0 + t, h] = 0.0
                    continue
                kmat, vmat = keys[visible, kv_head], values[visible, kv_head]
                s = (kmat @ q[s0 + t, h]) * sm_scale
                if opts.softcap > 0:
                    s = opts.softcap * torch.tanh(s / opts.softcap)
                if slopes is not None:
                    s = s + slopes[h] * (visible.double() - query_pos)
                m = float(s.max())
                if sinks is not None:
                    m = max(m, sinks[h])
                w = torch.exp(s - m)
                denom = float(w.sum())
                if sinks is not None:
                    denom += math.exp(sinks[h] - m)
                out[s0 + t, h] = (w @ vmat) / denom
    return out


def _as_output(want: torch.Tensor, problem: pp.PrefillProblem, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's float64 values as written into an output of ``dtype`` (FP8: divided, clamped, rounded)."""
    scale = problem.options.fp8_out_scale
    if scale is None:
        return want.to(dtype)
    limit = torch.finfo(dtype).max
    return (want / _scalar(scale)).clamp(-limit, limit).to(dtype)


def _check(problem: pp.PrefillProblem, label: str) -> None:
    want = oracle(problem)
    rows = ~torch.isnan(want[:, 0, 0])
    assert torch.equal(rows, written_rows(problem)), f"{label}: the batch leaves tokens outside every sequence"

    got = pp.reference_prefill(fresh_output(problem))
    assert got.dtype == problem.out.dtype
    assert bool(torch.isnan(got[~rows].float()).all()), f"{label}: rows skipped by skip_decode were written"
    got, out_rows = got[rows], want[rows]
    assert bool(torch.isfinite(got.float()).all()), f"{label}: non-finite output"
    atol, rtol = TOLERANCES[problem.dtype] if problem.options.fp8_out_scale is None else FP8_OUT_TOLERANCE
    torch.testing.assert_close(got.double(), _as_output(out_rows, problem, problem.out.dtype).double(), atol=atol,
                               rtol=rtol, msg=lambda m: f"{label} (float32): {m}")

    out64 = torch.full(problem.q.shape, float("nan"), dtype=torch.float64)
    got64 = pp.reference_prefill(with_output(problem, out64), compute_dtype=torch.float64)
    assert got64 is out64
    torch.testing.assert_close(got64[rows], _as_output(out_rows, problem, torch.float64), atol=TIGHT[0],
                               rtol=TIGHT[1], msg=lambda m: f"{label} (float64): {m}")

    # float64 compute rounded into the output dtype: exactly the oracle rounded the same way
    rounded = pp.reference_prefill(fresh_output(problem), compute_dtype=torch.float64)[rows]
    expected = _as_output(out_rows, problem, problem.out.dtype)
    assert torch.equal(rounded.view(torch.uint8) if rounded.dtype.itemsize == 1 else rounded,
                       expected.view(torch.uint8) if expected.dtype.itemsize == 1 else expected), \
        f"{label}: float64 compute, rounded output differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_oracle(case):
    spec = case_spec(case, "small", seed=0)
    _check(make_problem(spec), f"{case} [{spec.describe()}]")


def test_feature_matrix_covers_every_dtype_and_option():
    """The case list used above spans what the oracle must exercise."""
    specs = [case_spec(name) for name in CASES]
    assert {s.dtype for s in specs} == {torch.float16, torch.bfloat16, torch.float32}
    assert {s.kv_cache_dtype for s in specs} >= {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    assert {s.layout for s in specs} == {"nhd", "split"}
    assert any(s.alibi for s in specs) and any(s.sinks for s in specs) and any(s.softcap for s in specs)
    assert any(s.sliding_window for s in specs) and any(s.sm_scale for s in specs)
    assert any(s.scale_as_tensor for s in specs) and any(s.start_loc_entries == "B" for s in specs)
    assert {s.x for s in specs if s.layout == "split"} >= {None, 1, 2, 4, 8, 16}
    assert any(s.kv_in_cache for s in specs) and any(not s.causal for s in specs)
    assert any(s.skip_decode for s in specs) and any(s.fp8_out_scale for s in specs)
    assert any(s.context_from_starts for s in specs)


@pytest.mark.parametrize("seed", [3, 11, 41, 47, 64, 80, 84, 110])
def test_random_spec_matches_oracle(seed):
    spec = random_spec(seed, "small", dtypes=(torch.float16, torch.float32, torch.bfloat16))
    _check(make_problem(spec), f"random seed={seed} [{spec.describe()}]")


@pytest.mark.parametrize("case", ["all_features", "gqa_3", "fp8_e5m2"])
def test_second_seed_matches_oracle(case):
    spec = case_spec(case, "small", seed=5)
    _check(make_problem(spec), f"{case} seed=5 [{spec.describe()}]")


@pytest.mark.parametrize("limit", [1, 100, 4 * 41 * 3])
def test_query_chunking_gives_the_same_result(monkeypatch, limit):
    """The reference processes queries in chunks bounded by MAX_SCORE_ELEMENTS; chunk size changes nothing."""
    problem = make_problem(case_spec("all_features", seed=2))
    full = pp.reference_prefill(fresh_output(problem)).clone()
    monkeypatch.setattr(reference_module, "MAX_SCORE_ELEMENTS", limit)
    chunked = pp.reference_prefill(fresh_output(problem))
    assert torch.equal(chunked, full)
    torch.testing.assert_close(chunked.double(), oracle(problem), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_window_1_returns_each_tokens_own_value(layout):
    """With a window of 1 a query sees only itself: the output is its own value row, exactly."""
    spec = BatchSpec(query_lens=(6, 1, 9), context_lens=(11, 3, 0), num_heads=6, num_kv_heads=2, head_size=16,
                     block_size=4, dtype=torch.float16, layout=layout, sliding_window=1, softcap=3.0, alibi=True)
    problem = make_problem(spec)
    got = pp.reference_prefill(problem)
    assert torch.equal(got, problem.v.repeat_interleave(3, dim=1))


def test_matches_sdpa_with_bottom_right_causal_mask():
    """A second independent check: torch's SDPA on gathered float64 tensors with an explicit mask."""
    spec = BatchSpec(query_lens=(7, 12), context_lens=(10, 0), num_heads=4, num_kv_heads=2, head_size=24,
                     block_size=3, dtype=torch.float32, layout="split")
    p = make_problem(spec)
    got = pp.reference_prefill(with_output(p, torch.empty(p.q.shape, dtype=torch.float64)), torch.float64)
    starts = p.batch.query_start.tolist()
    for i, (n, ctx) in enumerate(zip(spec.query_lens, spec.context_lens)):
        s0 = starts[i]
        k_ctx, v_ctx = pp.gather_kv(p.cache, p.batch.block_table[i], ctx, torch.float64)
        k = torch.cat([k_ctx, p.k[s0:s0 + n].double()]).repeat_interleave(2, dim=1)
        v = torch.cat([v_ctx, p.v[s0:s0 + n].double()]).repeat_interleave(2, dim=1)
        q = p.q[s0:s0 + n].double()
        mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(got[s0:s0 + n], want, atol=1e-12, rtol=1e-10)


#: Cases whose options scaled_dot_product_attention can express (no softcap, no sinks).
SDPA_CASES = sorted(name for name in CASES if not case_spec(name).softcap and not case_spec(name).sinks)


@pytest.mark.parametrize("case", SDPA_CASES)
def test_demo_check_sdpa_float64_matches_oracle(case):
    """The demo's independent float64 computation agrees with the naive oracle (ALiBi, windows, FP8, GQA,
    and the optional features: causal=False, k = v = None, skip_decode, FP8 output before its rounding)."""
    problem = make_problem(case_spec(case, "small", seed=1))
    got = sdpa_float64(problem)
    assert got.dtype == torch.float64 and got.shape == problem.q.shape
    want = oracle(problem)
    rows = written_rows(problem)  # all rows, but those skip_decode skips (NaN in the oracle, zeros here)
    assert torch.equal(rows, ~torch.isnan(want[:, 0, 0]))
    assert bool((got[~rows] == 0).all()), f"{case}: rows skipped by skip_decode are not zeros"
    torch.testing.assert_close(got[rows], want[rows], atol=TIGHT[0], rtol=TIGHT[1], msg=lambda m: f"{case}: {m}")


@pytest.mark.parametrize("option", [{"softcap": 5.0}, {"sinks": True}])
def test_demo_check_sdpa_float64_refuses_what_it_cannot_express(option):
    with pytest.raises(ValueError, match=r"^sdpa_float64: softcap and sinks have no counterpart"):
        sdpa_float64(make_problem(case_spec("basic").replace(**option)))


def test_sinks_take_probability_mass():
    """A very negative sink changes nothing; a very large sink takes (almost) all the probability."""
    base = make_problem(case_spec("basic", seed=4))
    plain = pp.reference_prefill(fresh_output(base), compute_dtype=torch.float64)
    checks = ((-1e4, lambda out: torch.equal(out, plain)), (80.0, lambda out: float(out.abs().max()) < 1e-20))
    for sink, check in checks:
        options = pp.AttentionOptions(sinks=torch.full((base.num_heads,), sink))
        problem = pp.PrefillProblem(base.q, base.k, base.v, torch.full_like(base.q, float("nan")), base.cache,
                                    base.batch, options)
        out = pp.reference_prefill(problem, compute_dtype=torch.float64)
        assert check(out), sink
        torch.testing.assert_close(out.double(), oracle(problem), atol=1e-3, rtol=1e-3)


def test_rows_with_no_visible_key_are_zero():
    """Defined even though the public API cannot produce it: queries placed before every key."""
    g = torch.Generator().manual_seed(9)
    query = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    keys = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    values = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    query_pos = torch.tensor([0, 1, 7])
    key_pos = torch.arange(2, 7)  # queries 0 and 1 precede every key; query 7 sees keys 2..6
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    slopes = torch.tensor([0.25, 0.5], dtype=torch.float64)
    for sk, sl, softcap, window in ((None, None, 0.0, None), (sinks, None, 0.0, None), (sinks, slopes, 4.0, None),
                                    (None, slopes, 0.0, 3)):
        out = reference_module._attend(query, keys, values, query_pos, key_pos, 0.3, softcap, sl, sk, window)
        assert torch.equal(out[:2], torch.zeros(2, 2, 8, dtype=torch.float64))
        assert bool((out[2] != 0).all()) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("change", [dict(), dict(kv_in_cache=True), dict(layout="split", x=2),
                                    dict(kv_cache_dtype="fp8_e4m3", kv_in_cache=True)],
                         ids=["nhd", "kv_in_cache", "split", "fp8_e4m3"])
def test_nan_unused_slots_poison_exactly_the_slots_no_sequence_holds(change):
    """``BatchSpec.nan_unused_slots`` writes NaN into every slot past each sequence's keys and every block no
    sequence's table names, and nowhere else: the reference's output is the one of the unpoisoned batch."""
    spec = pp.testing.case_spec("basic").replace(block_size=8, spare_blocks=2, extra_columns=2, **change)
    clean, poisoned = make_problem(spec), make_problem(spec.replace(nan_unused_slots=True))
    cache, table = clean.cache, clean.batch.block_table
    held = (clean.batch.seq_lens if spec.kv_in_cache else clean.batch.context_lengths()).tolist()
    used = torch.zeros(cache.key.shape[0], cache.block_size, dtype=torch.bool)
    for i, n in enumerate(held):
        for pos in range(n):
            used[table[i, pos // cache.block_size], pos % cache.block_size] = True
    assert 0 < int(used.sum()) < used.numel()
    for clean_t, poisoned_t in ((cache.key, poisoned.cache.key), (cache.value, poisoned.cache.value)):
        a = pp.cache.as_stored_type(clean_t, cache.dtype).float()
        b = pp.cache.as_stored_type(poisoned_t, cache.dtype).float()
        if cache.layout is pp.KVLayout.SPLIT:  # [blocks, slots, ...] first
            dims = (0, 3, 1, 2, 4) if a.dim() == 5 else (0, 3, 1, 2)
            a, b = a.permute(*dims), b.permute(*dims)
        assert torch.isnan(b[~used]).all() and torch.equal(a[used], b[used])
    expect = pp.reference_prefill(clean)
    torch.testing.assert_close(pp.reference_prefill(poisoned), expect, atol=0, rtol=0, equal_nan=True)
