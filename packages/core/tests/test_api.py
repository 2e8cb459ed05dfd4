"""The two entry points on the reference backend: the drop-in ``context_attention_fwd`` and the native
``prefill_attention`` compute the same thing from the same data, write their output in place, and accept
every documented spelling of their arguments.

Outputs start poisoned with NaN (``make_problem``), so an element that is not written fails the checks.
"""

from __future__ import annotations

import dataclasses

import pagedprefill as pp
import pytest
import torch
from pagedprefill.testing import case_spec, fresh_output, make_problem
from pagedprefill.validation import expected_x


def drop_in(problem: pp.PrefillProblem, **changes) -> torch.Tensor:
    """Call ``context_attention_fwd`` with ``problem``'s data (positional, as the classic signature)."""
    c, b, o = problem.cache, problem.batch, problem.options
    args = dict(q=problem.q, k=problem.k, v=problem.v, o=problem.out, kv_cache_dtype=c.dtype.value,
                k_cache=c.key, v_cache=c.value, b_loc=b.block_table, b_start_loc=b.query_start,
                b_seq_len=b.seq_lens, b_ctx_len=b.context_lens, max_input_len=b.max_query_len, k_scale=c.k_scale,
                v_scale=c.v_scale, alibi_slopes=o.alibi_slopes, sliding_window=o.sliding_window)
    extras = dict(sm_scale=o.sm_scale, sinks=o.sinks, softcap=o.softcap, backend="reference", validate="full")
    for key, value in changes.items():
        (args if key in args else extras)[key] = value
    return pp.context_attention_fwd(*args.values(), **extras)


def native(problem: pp.PrefillProblem, **changes) -> torch.Tensor:
    o = problem.options
    kwargs = dict(sm_scale=o.sm_scale, alibi_slopes=o.alibi_slopes, sliding_window=o.sliding_window,
                  softcap=o.softcap, sinks=o.sinks, out=problem.out, backend="reference", validate="full")
    kwargs.update(changes)
    return pp.prefill_attention(problem.q, problem.k, problem.v, problem.cache, problem.batch, **kwargs)


def expected(problem: pp.PrefillProblem) -> torch.Tensor:
    return pp.reference_prefill(fresh_output(problem))


def assert_complete(out: torch.Tensor, problem: pp.PrefillProblem) -> None:
    assert out.shape == problem.q.shape and out.dtype == problem.q.dtype
    assert not bool(torch.isnan(out).any()), f"{int(torch.isnan(out).sum())} output elements left unwritten"
    assert bool(torch.isfinite(out.float()).all())


def nhd_to_split(cache: pp.PagedKVCache) -> pp.PagedKVCache:
    """The same cache contents in the split layout: K ``[nb, Hkv, D // x, bs, x]``, V ``[nb, Hkv, D, bs]``."""
    nb, bs, hkv, d = cache.key.shape
    x = expected_x(d, cache.key.element_size())
    key = cache.key.reshape(nb, bs, hkv, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value = cache.value.permute(0, 2, 3, 1).contiguous()
    return dataclasses.replace(cache, key=key, value=value, layout=pp.KVLayout.SPLIT)


API_CASES = ["basic", "split_layout", "split_layout_head_24", "start_loc_b_entries", "fp8_e4m3", "fp8_e5m2",
             "fp8_split_tensor_scales", "all_features", "alibi", "window_6", "window_alibi", "sinks", "softcap",
             "sm_scale", "mqa_8", "gqa_3", "bfloat16", "float32", "block_size_7", "no_context", "decode_rows"]


@pytest.mark.parametrize("case", API_CASES)
def test_both_entry_points_match_reference(case):
    problem = make_problem(case_spec(case, seed=1))
    want = expected(problem)
    assert_complete(want, problem)

    o = torch.full_like(problem.q, float("nan"))
    got_drop_in = drop_in(problem, o=o)
    assert got_drop_in is o
    assert torch.equal(got_drop_in, want)

    out = torch.full_like(problem.q, float("nan"))
    got_native = native(problem, out=out)
    assert got_native is out
    assert torch.equal(got_native, want)

    allocated = native(problem, out=None)
    assert allocated.shape == problem.q.shape and allocated.dtype == problem.q.dtype
    assert torch.equal(allocated, want)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_size", [32, 24])
def test_split_and_nhd_layouts_agree(kv, dtype, head_size):
    """The same cache contents in the split 5-D/4-D layout and the NHD 4-D layout give identical outputs."""
    problem = make_problem(case_spec("basic", seed=2).replace(kv_cache_dtype=kv, dtype=dtype, layout="nhd",
                                                              head_size=head_size, block_size=5))
    split_cache = nhd_to_split(problem.cache)
    assert split_cache.key.dim() == 5 and split_cache.value.dim() == 4
    row = problem.batch.block_table[1]
    for a, b in zip(pp.gather_kv(problem.cache, row, 40), pp.gather_kv(split_cache, row, 40)):
        assert torch.equal(a, b)
    split_problem = dataclasses.replace(problem, cache=split_cache)

    from_nhd = drop_in(problem, o=torch.full_like(problem.q, float("nan")))
    from_split = drop_in(split_problem, o=torch.full_like(problem.q, float("nan")))
    assert_complete(from_nhd, problem)
    assert torch.equal(from_nhd, from_split)
    assert torch.equal(native(split_problem, out=None), from_nhd)
    assert torch.equal(native(problem, out=None), from_nhd)


@pytest.mark.parametrize("case", ["basic", "split_layout", "fp8_e4m3", "all_features"])
def test_start_loc_with_b_and_b_plus_1_entries(case):
    problem = make_problem(case_spec(case, seed=3))
    B = problem.batch.num_seqs
    assert problem.batch.query_start.shape == (B + 1,)
    short = dataclasses.replace(problem, batch=dataclasses.replace(problem.batch,
                                                                  query_start=problem.batch.query_start[:B]))
    want = expected(problem)
    assert_complete(want, problem)
    for p in (problem, short):
        assert torch.equal(drop_in(p, o=torch.full_like(p.q, float("nan"))), want)
        assert torch.equal(native(p, out=None), want)


@pytest.mark.parametrize("layout", ["nhd", "split"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_scales_as_float_0d_and_1_element_tensor(layout, kv):
    problem = make_problem(case_spec("basic", seed=4).replace(kv_cache_dtype=kv, layout=layout))
    # scales representable in float32, so that every spelling denotes exactly the same value
    ks = float(torch.tensor(float(problem.cache.k_scale), dtype=torch.float32))
    vs = float(torch.tensor(float(problem.cache.v_scale), dtype=torch.float32))
    spellings = [(ks, vs), (torch.tensor(ks), torch.tensor(vs)), (torch.tensor([ks]), torch.tensor([vs])),
                 (torch.tensor(ks), torch.tensor([vs]))]
    results = []
    for k_scale, v_scale in spellings:
        results.append(drop_in(problem, o=torch.full_like(problem.q, float("nan")), k_scale=k_scale,
                               v_scale=v_scale))
        cache = dataclasses.replace(problem.cache, k_scale=k_scale, v_scale=v_scale)
        results.append(native(dataclasses.replace(problem, cache=cache), out=None))
    assert_complete(results[0], problem)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    # the scales are really applied: another k_scale or v_scale changes the output
    assert not torch.equal(drop_in(problem, o=torch.empty_like(problem.q), k_scale=2 * ks), results[0])
    assert not torch.equal(drop_in(problem, o=torch.empty_like(problem.q), v_scale=2 * vs), results[0])


def test_scales_are_ignored_for_auto_caches():
    problem = make_problem(case_spec("split_layout", seed=5))
    want = expected(problem)
    for k_scale, v_scale in ((2.0, 0.5), (torch.tensor(3.0), torch.tensor([0.25]))):
        assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), k_scale=k_scale,
                                   v_scale=v_scale), want)


@pytest.mark.parametrize("case", ["basic", "alibi", "split_layout"])
def test_sliding_window_off_spellings(case):
    """None, 0 and negative values all mean no window for the drop-in; None and 0 for the native API."""
    problem = make_problem(case_spec(case, seed=6))
    assert problem.options.sliding_window is None
    want = expected(problem)
    assert_complete(want, problem)
    for window in (None, 0, -1, -4096):
        assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), sliding_window=window), want)
    for window in (None, 0):
        assert torch.equal(native(problem, out=None, sliding_window=window), want)
    # and a real window is applied (the comparison above is not vacuous)
    windowed = drop_in(problem, o=torch.full_like(problem.q, float("nan")), sliding_window=3)
    assert not torch.equal(windowed, want)
    assert torch.equal(windowed, native(problem, out=None, sliding_window=3))
    # a window wider than every sequence changes nothing
    assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), sliding_window=10**6), want)


def test_out_is_written_in_place_and_returned():
    problem = make_problem(case_spec("all_features", seed=7))
    want = expected(problem)
    buf = torch.full_like(problem.q, float("nan"))
    ptr = buf.data_ptr()
    assert native(problem, out=buf) is buf and buf.data_ptr() == ptr
    assert torch.equal(buf, want)
    o = torch.full_like(problem.q, float("nan"))
    assert drop_in(problem, o=o) is o
    assert torch.equal(o, want)
    # the problem's own (NaN-poisoned) output tensor is the default of the helpers: written in place too
    assert native(problem) is problem.out
    assert torch.equal(problem.out, want)
    # a non-contiguous output view (head_size stride 1) is written through the view
    big = torch.full((problem.num_tokens, problem.num_heads, 2 * problem.head_size), float("nan"),
                     dtype=problem.q.dtype)
    view = big[..., :problem.head_size]
    assert drop_in(problem, o=view) is view
    assert torch.equal(big[..., :problem.head_size], want)
    assert bool(torch.isnan(big[..., problem.head_size:]).all())


def test_tokens_outside_every_sequence_are_left_untouched():
    """Trailing rows of q/k/v/o that no sequence covers (padding) are not written."""
    problem = make_problem(case_spec("basic", seed=8))
    want = expected(problem)
    g = torch.Generator().manual_seed(8)
    pad = 3

    def extend(t):
        return torch.cat([t, torch.randn(pad, *t.shape[1:], generator=g).to(t.dtype)])

    padded = dataclasses.replace(problem, q=extend(problem.q), k=extend(problem.k), v=extend(problem.v),
                                 out=torch.full((problem.num_tokens + pad, problem.num_heads, problem.head_size),
                                                float("nan"), dtype=problem.q.dtype))
    for call in (drop_in, native):
        out = call(padded, **({"o": padded.out.clone()} if call is drop_in else {"out": padded.out.clone()}))
        assert torch.equal(out[:problem.num_tokens], want)
        assert bool(torch.isnan(out[problem.num_tokens:]).all())


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_metadata_index_dtypes(index_dtype):
    problem = make_problem(case_spec("decode_rows", seed=9))
    b = problem.batch
    batch = pp.BatchMetadata(*(t.to(index_dtype) for t in (b.query_start, b.seq_lens, b.context_lens,
                                                           b.block_table)), max_query_len=b.max_query_len)
    converted = dataclasses.replace(problem, batch=batch)
    want = expected(problem)
    assert torch.equal(drop_in(converted, o=torch.full_like(problem.q, float("nan"))), want)
    assert torch.equal(native(converted, out=None), want)


def test_kv_cache_dtype_spellings():
    problem = make_problem(case_spec("fp8_e4m3", seed=10))
    want = expected(problem)
    assert_complete(want, problem)
    for spelling in ("fp8", "fp8_e4m3", "FP8", "Fp8_E4m3", pp.KVCacheDType.FP8_E4M3):
        assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), kv_cache_dtype=spelling),
                           want)
    # the other format reads the same bytes differently
    assert not torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), kv_cache_dtype="fp8_e5m2"),
                           want)


def test_validate_levels_and_defaults_agree():
    problem = make_problem(case_spec("all_features", seed=11))
    want = expected(problem)
    for validate in ("basic", "full"):
        assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), validate=validate), want)
        assert torch.equal(native(problem, out=None, validate=validate), want)
    # backend given as an instance, and max_input_len omitted
    instance = pp.get_registry().get("reference")
    assert torch.equal(native(problem, out=None, backend=instance), want)
    assert torch.equal(drop_in(problem, o=torch.full_like(problem.q, float("nan")), max_input_len=None), want)


def test_default_sm_scale_is_inverse_sqrt_head_size():
    problem = make_problem(case_spec("head_size_80", seed=12))
    assert problem.options.sm_scale is None
    want = expected(problem)
    explicit = drop_in(problem, o=torch.full_like(problem.q, float("nan")), sm_scale=80 ** -0.5)
    assert torch.equal(explicit, want)
    other = native(problem, out=None, sm_scale=0.5)
    assert not torch.equal(other, want)
    assert_complete(other, problem)


def test_keyword_extras_reach_the_computation():
    """sinks/softcap/sm_scale of the drop-in behave as the native options."""
    problem = make_problem(case_spec("basic", seed=13))
    g = torch.Generator().manual_seed(13)
    sinks = torch.randn(problem.num_heads, generator=g)
    extras = dict(sinks=sinks, softcap=4.0, sm_scale=0.15)
    a = drop_in(problem, o=torch.full_like(problem.q, float("nan")), **extras)
    b = native(problem, out=None, **extras)
    assert_complete(a, problem)
    assert torch.equal(a, b)
    assert not torch.equal(a, expected(problem))
    options = pp.AttentionOptions(sm_scale=0.15, sinks=sinks, softcap=4.0)
    assert torch.equal(a, pp.reference_prefill(dataclasses.replace(fresh_output(problem), options=options)))


@pytest.mark.parametrize("query_lens, context_lens", [((), ()), ((0, 0), (5, 0)), ((0,), (0,))])
@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_batches_without_new_tokens(query_lens, context_lens, layout):
    """No sequences, or sequences without new tokens: valid, and nothing to write."""
    problem = make_problem(case_spec("basic", seed=14).replace(query_lens=query_lens, context_lens=context_lens,
                                                               layout=layout))
    assert problem.num_tokens == 0
    for out in (drop_in(problem, o=torch.empty_like(problem.q)), native(problem, out=None)):
        assert out.shape == (0, problem.num_heads, problem.head_size)
