"""The optional features ``causal=False``, ``skip_decode``, ``fp8_out_scale`` and ``k = v = None`` (new tokens'
keys/values read from the cache), the one check that refuses them on backends that do not run them, and the
reference backend's metadata checks with ``validate="basic"``.

Each feature's output is compared with an independent construction on the same N(0, 1) data (ragged
lengths, shuffled block tables; outputs start NaN-poisoned), every element checked.
"""

from __future__ import annotations

import dataclasses

import pagedprefill as pp
import pytest
import torch
from pagedprefill import ops
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.features import FEATURE_DESCRIPTIONS, check_features, check_runnable
from pagedprefill.testing import BatchSpec, fresh_output, make_problem, with_output
from pagedprefill.testing.cases import FEATURE_CASES, written_rows
from pagedprefill.types import FEATURES

SPEC = BatchSpec(query_lens=(5, 1, 17, 0, 3, 1), context_lens=(9, 40, 0, 6, 1, 0), num_heads=4, num_kv_heads=2,
                 head_size=32, block_size=8, layout="split", seed=3)


def ref(problem: pp.PrefillProblem) -> torch.Tensor:
    return pp.reference_prefill(fresh_output(problem))


def without(problem: pp.PrefillProblem, **changes) -> pp.PrefillProblem:
    return dataclasses.replace(problem, options=dataclasses.replace(problem.options, **changes))


# -- semantics --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [SPEC, SPEC.replace(layout="nhd", dtype=torch.float32),
                                  SPEC.replace(x=2, sliding_window=5, alibi=True, sinks=True)],
                         ids=["split_fp16", "nhd_fp32", "split_x2_window_alibi_sinks"])
def test_kv_in_cache_equals_kv_given(spec):
    """With an unquantised cache, reading the new tokens' K/V from the cache gives exactly the output of
    passing the same K/V as ``k``/``v`` (gathered from the cache here, position by position)."""
    from_cache = make_problem(spec.replace(kv_in_cache=True))
    assert from_cache.k is None and from_cache.v is None and from_cache.features == {"kv_in_cache"}
    b = from_cache.batch
    ks, vs = [], []
    for i, (n, c) in enumerate(zip(spec.query_lens, spec.context_lens)):
        k_all, v_all = pp.gather_kv(from_cache.cache, b.block_table[i], c + n, spec.dtype)
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    given = dataclasses.replace(from_cache, k=torch.cat(ks), v=torch.cat(vs))
    assert float(given.k.float().std()) > 0.5, "the new tokens were not written to the cache"
    out = ref(from_cache)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, ref(given))
    # the context alone (the new tokens' positions overwritten with other data) gives another result
    other = dataclasses.replace(given, k=torch.randn_like(given.k), v=torch.randn_like(given.v))
    assert not torch.equal(out, ref(other))


def test_non_causal_equals_sdpa_without_mask():
    """causal=False: each new token sees the whole context and every new token of its sequence (float64
    SDPA on the gathered keys, no mask); causal=True differs."""
    spec = SPEC.replace(dtype=torch.float32, causal=False)
    p = make_problem(spec)
    got = pp.reference_prefill(with_output(p, torch.full(p.q.shape, float("nan"), dtype=torch.float64)),
                               torch.float64)
    starts = p.batch.query_start.tolist()
    for i, (n, ctx) in enumerate(zip(spec.query_lens, spec.context_lens)):
        if n == 0:
            continue
        s0 = starts[i]
        k_ctx, v_ctx = pp.gather_kv(p.cache, p.batch.block_table[i], ctx, torch.float64)
        k = torch.cat([k_ctx, p.k[s0:s0 + n].double()]).repeat_interleave(2, dim=1)
        v = torch.cat([v_ctx, p.v[s0:s0 + n].double()]).repeat_interleave(2, dim=1)
        want = torch.nn.functional.scaled_dot_product_attention(
            p.q[s0:s0 + n].double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
        torch.testing.assert_close(got[s0:s0 + n], want, atol=1e-12, rtol=1e-10)
    causal = ref(without(p, causal=True))
    assert not torch.allclose(got.float(), causal, atol=1e-3), "causal=False changed nothing"
    # the last new token of each sequence sees the same keys either way
    last = [starts[i] + n - 1 for i, n in enumerate(spec.query_lens) if n]
    torch.testing.assert_close(got[last].float(), causal[last], atol=1e-5, rtol=1e-5)


def test_skip_decode_leaves_single_token_rows_untouched():
    p = make_problem(SPEC.replace(skip_decode=True))
    sentinel = torch.randn(p.q.shape, generator=torch.Generator().manual_seed(1)).to(p.q.dtype)
    out = pp.reference_prefill(with_output(p, sentinel.clone()))
    rows = written_rows(p)
    decode_rows = [int(p.batch.query_start[i]) for i, n in enumerate(SPEC.query_lens) if n == 1]
    assert decode_rows and not rows[decode_rows].any() and int(rows.sum()) == sum(SPEC.query_lens) - 2
    assert torch.equal(out[~rows], sentinel[~rows]), "rows of one-token sequences were written"
    full = ref(without(p, skip_decode=False))
    assert torch.equal(out[rows], full[rows])
    assert not torch.equal(out[~rows], full[~rows])


@pytest.mark.parametrize("scale", [0.02, 0.002, "tensor"])
def test_fp8_out_scale_divides_and_clamps(scale):
    """fp8_out_scale: the output is clamp(attention / scale) rounded to FP8 e4m3 (the small scale clamps)."""
    value = 0.01 if scale == "tensor" else scale
    p = make_problem(SPEC.replace(fp8_out_scale=value))
    if scale == "tensor":
        p = without(p, fp8_out_scale=torch.tensor([value]))
    got = ref(p)
    assert got.dtype == torch.float8_e4m3fn
    plain = pp.reference_prefill(with_output(without(p, fp8_out_scale=None),
                                             torch.full(p.q.shape, float("nan"), dtype=torch.float32)))
    limit = torch.finfo(torch.float8_e4m3fn).max
    want = (plain / value).clamp(-limit, limit).to(torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    clamped = int(((plain / value).abs() > limit).sum())
    assert (clamped > 0) == (value == 0.002), clamped


def test_native_api_allocates_the_right_output():
    p = make_problem(SPEC)
    args = (p.q, p.k, p.v, p.cache, p.batch)
    fp8 = pp.prefill_attention(*args, fp8_out_scale=0.05, backend="reference")
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == p.q.shape
    skipped = pp.prefill_attention(*args, skip_decode=True, backend="reference")
    rows = written_rows(without(p, skip_decode=True))
    assert torch.equal(skipped[~rows], torch.zeros_like(skipped[~rows]))
    assert torch.equal(skipped[rows], ref(p)[rows])
    cache_spec = SPEC.replace(kv_in_cache=True, causal=False)
    c = make_problem(cache_spec)
    out = pp.prefill_attention(c.q, None, None, c.cache, c.batch, causal=False, validate="full")
    assert torch.equal(out, ref(c))


@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
def test_ops_carry_the_options(case):
    """The custom operators compute exactly what the Python API computes with each option."""
    from pagedprefill.testing import case_spec

    p = make_problem(case_spec(case, seed=2))
    want = ref(p)
    tensors, kwargs = ops.op_arguments(p, "reference")
    got = torch.ops.pagedprefill.prefill_attention(*tensors, **kwargs)
    out = fresh_output(p).out
    torch.ops.pagedprefill.prefill_attention_(*tensors[:3], out, *tensors[3:], **kwargs)
    rows = written_rows(p)
    want_got = want
    if got.dtype != want.dtype:
        # An FP8 q beside an FP8 cache and no new keys: nothing 16-bit tells the functional operator the model's
        # type, and it computes in bfloat16, which holds every FP8 value.
        assert p.q.dtype == torch.float8_e4m3fn and p.k is None and p.cache.dtype.is_fp8 and got.dtype == torch.bfloat16
        want_got = pp.reference_prefill(dataclasses.replace(p, out=torch.empty_like(want, dtype=torch.bfloat16)))
    for result, expected in ((got, want_got), (out, want)):
        assert result.dtype == expected.dtype
        assert torch.equal(result[rows].float(), expected[rows].float())
    assert torch.isnan(out[~rows].float()).all()
    if not rows.all():  # the functional op's new output is zero-filled where rows are skipped
        assert torch.equal(got[~rows].float(), torch.zeros_like(got[~rows].float()))
    # The schema check compares every input before and after with torch.allclose, which PyTorch has no CPU
    # kernel for on float8_e4m3fn: an FP8 q's call is checked for its fake implementation only.
    checks = ("test_faketensor",) if p.q.dtype == torch.float8_e4m3fn else ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.pagedprefill.prefill_attention.default, tensors, kwargs, test_utils=checks)


# -- validation ------------------------------------------------------------------------------------------------
def _drop_in(p: pp.PrefillProblem, **changes):
    c, b = p.cache, p.batch
    args = dict(q=p.q, k=p.k, v=p.v, o=p.out, kv_cache_dtype=c.dtype.value, k_cache=c.key, v_cache=c.value,
                b_loc=b.block_table, b_start_loc=b.query_start, b_seq_len=b.seq_lens, b_ctx_len=b.context_lens,
                max_input_len=None)
    args.update(changes)
    return pp.context_attention_fwd(**args, backend="reference", validate="full")


def _native(p: pp.PrefillProblem, **options):
    o = p.options
    kwargs = dict(causal=o.causal, skip_decode=o.skip_decode, fp8_out_scale=o.fp8_out_scale, out=p.out)
    kwargs.update(options)
    return pp.prefill_attention(p.q, p.k, p.v, p.cache, p.batch, backend="reference", validate="full", **kwargs)


@pytest.mark.parametrize("options, exc, message", [
    (dict(fp8_out_scale=0.1), TypeError,
     "out: expected dtype float8_e4m3fn or float8_e4m3fnuz (FP8 output, fp8_out_scale is set), got float16"),
    (dict(fp8_out_scale=0.0, out=torch.empty(26, 4, 32, dtype=torch.float8_e4m3fn)), ValueError,
     "fp8_out_scale: expected a finite positive scale, got 0.0"),
    (dict(fp8_out_scale=float("nan"), out=torch.empty(26, 4, 32, dtype=torch.float8_e4m3fn)), ValueError,
     "fp8_out_scale: expected a finite positive scale, got nan"),
    (dict(fp8_out_scale=torch.tensor([0.1, 0.2]), out=torch.empty(26, 4, 32, dtype=torch.float8_e4m3fn)),
     ValueError, "fp8_out_scale: expected None, a float or a 1-element tensor, got shape [2]"),
    (dict(fp8_out_scale="0.1", out=torch.empty(26, 4, 32, dtype=torch.float8_e4m3fn)), TypeError,
     "fp8_out_scale: expected None, a float or a 1-element tensor, got str"),
    (dict(out=torch.empty(26, 4, 32, dtype=torch.float8_e4m3fn)), TypeError,
     "out: expected dtype float16 (the dtype of q), got float8_e4m3fn"),
    (dict(causal=0), TypeError, "causal: expected a bool, got int"),
    (dict(skip_decode="yes"), TypeError, "skip_decode: expected a bool, got str"),
])
def test_option_errors_name_the_argument(options, exc, message):
    p = make_problem(SPEC.replace(query_lens=(5, 1, 17, 0, 3), context_lens=(9, 40, 0, 6, 1)))
    with pytest.raises(exc) as info:
        _native(p, **options)
    assert str(info.value) == message


def test_k_or_v_alone_none_is_refused():
    p = make_problem(SPEC)
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor, got NoneType \(k may be None only together "
                                        r"with v: then the new tokens' keys and values are read from the paged"):
        _drop_in(p, k=None)
    with pytest.raises(TypeError, match=r"^v: expected a torch.Tensor, got NoneType \(v may be None only"):
        _drop_in(p, v=None)


def test_kv_in_cache_needs_blocks_for_every_token():
    """With k = v = None the block table must cover seq_len tokens, not only the context (full validation)."""
    p = make_problem(SPEC.replace(kv_in_cache=True))
    narrow = p.batch.block_table[:, :2]  # sequence 1 has 41 tokens in the cache: 6 blocks of 8
    with pytest.raises(ValueError, match=r"^b_loc: expected at least 6 columns \(sequence 1 has 41 tokens in the "
                                         r"cache, needing 6 blocks of 8\), got 2 columns"):
        _drop_in(p, b_loc=narrow)
    assert _drop_in(p) is p.out and torch.isfinite(p.out.float()).all()


# -- the reference backend checks block numbers even with validate="basic" ----------------------------------------
@pytest.mark.parametrize("api", ["drop_in", "native", "op"])
def test_reference_basic_names_the_block_table(api):
    p = make_problem(SPEC)
    table = p.batch.block_table.clone()
    table[1, 2] = 999
    bad = dataclasses.replace(p, batch=dataclasses.replace(p.batch, block_table=table))
    nb = p.cache.num_blocks
    name = {"drop_in": "b_loc", "native": "block_table", "op": "block_table"}[api]
    with pytest.raises(ValueError) as info:
        if api == "drop_in":
            c, b = bad.cache, bad.batch
            pp.context_attention_fwd(bad.q, bad.k, bad.v, bad.out, "auto", c.key, c.value, b.block_table,
                                     b.query_start, b.seq_lens, b.context_lens, None, backend="reference")
        elif api == "native":
            pp.prefill_attention(bad.q, bad.k, bad.v, bad.cache, bad.batch, out=bad.out, backend="reference")
        else:
            tensors, kwargs = ops.op_arguments(bad, "reference")
            torch.ops.pagedprefill.prefill_attention(*tensors, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{name}: expected block numbers in [0, {nb}), got 999 at [1, 2]"), message
    assert "validate='full'" in message
    assert torch.isnan(bad.out.float()).all(), "the output was written before the error"


# -- which backend runs which feature --------------------------------------------------------------------------
class _Kernel(TritonBackend):
    """A Triton backend for hardware that computes none of the optional features."""

    name = "kernel-under-test"
    runs_in_interpreter = True
    supported_features = frozenset()


def test_core_kernel_computes_every_feature():
    assert TritonBackend.supported_features == FEATURES


def test_every_feature_has_a_description():
    assert set(FEATURE_DESCRIPTIONS) == FEATURES == {"kv_in_cache", "non_causal", "skip_decode", "fp8_out_scale",
                                                     "fp8_query"}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_triton_backends_refuse_each_feature_by_name(feature):
    spec = {"kv_in_cache": SPEC.replace(kv_in_cache=True), "non_causal": SPEC.replace(causal=False),
            "skip_decode": SPEC.replace(skip_decode=True), "fp8_out_scale": SPEC.replace(fp8_out_scale=0.1),
            "fp8_query": SPEC.replace(fp8_query=True)}[feature]
    p = make_problem(spec)
    assert p.features == {feature}
    cpu = pp.DeviceInfo.detect("cpu")
    _Kernel().check_problem(p, cpu)  # the backend's own check leaves the features to core's, which runs once
    with pytest.raises(pp.UnsupportedFeatureError) as info:
        check_runnable(_Kernel(), p, cpu)
    message = str(info.value)
    assert message.startswith("backend 'kernel-under-test' does not support ")
    assert FEATURE_DESCRIPTIONS[feature] in message
    assert message.count(feature) == 1, f"the feature is named once: {message}"
    assert "backend='reference'" in message
    # enabling a feature is one line: list it in supported_features
    enabled = type("Enabled", (_Kernel,), {"supported_features": frozenset({feature})})()
    check_runnable(enabled, p, cpu)
    # the reference runs every feature; a backend keeping Backend's default runs none
    check_features(pp.get_registry().get("reference"), p)
    with pytest.raises(pp.UnsupportedFeatureError, match=feature):
        check_features(type("Plain", (pp.Backend,), {"name": "plain"})(), p)


def test_plain_problems_pass_the_check():
    p = make_problem(SPEC)
    assert p.features == frozenset()
    check_features(_Kernel(), p)
    check_features(type("Plain", (pp.Backend,), {"name": "plain"})(), p)
