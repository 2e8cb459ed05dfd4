"""``pagedprefill.vllm.context_attention_fwd``: the current serving-engine signature, on the reference backend.

* on vLLM's own cache construction (split K cache with x = 8 for every dtype, FP8 caches as uint8 bytes or a
  float8 tensor viewed as uint8) with N(0, 1) data, against torch's float64 SDPA on the dense keys/values;
* context lengths derived from ``b_start_loc``/``b_seq_len`` give exactly the classic drop-in's output with
  explicit ``b_ctx_len``;
* each option (``skip_decode``, ``fp8_out_scale``, ``causal=False``, ``k = v = None``) gives exactly the
  native API's output with the same option;
* ``is_block_table_ptr=True`` and a ``b_start_loc`` without ``B + 1`` entries are refused, naming the argument;
* the call hands the kernels no context lengths (they derive them), and a repeated call launches its plan
  without running any PyTorch operation.
"""

from __future__ import annotations

import dataclasses
import inspect

import pagedprefill as pp
import pytest
import torch
from pagedprefill import plans, vllm
from pagedprefill.testing import BatchSpec, fresh_output, make_problem
from pagedprefill.testing.cases import FP8_OUT_TOLERANCE, written_rows
from pagedprefill.testing.vllm_batches import sdpa_reference, vllm_batch
from torch.utils._python_dispatch import TorchDispatchMode

QUERY_LENS = (19, 1, 33, 4, 1)
CTX_LENS = (40, 17, 0, 70, 5)
#: (atol, rtol) against float64 SDPA on the values the cache holds
TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}

VLLM_ARGS = ["q", "k", "v", "o", "kv_cache_dtype", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len",
             "max_seq_len", "max_input_len", "k_scale", "v_scale", "alibi_slopes", "sliding_window", "sm_scale",
             "skip_decode", "fp8_out_scale", "sinks", "is_block_table_ptr", "causal"]


def call(batch: dict, **options):
    args = {k: v for k, v in batch.items() if k not in ("key", "value")}
    args.update(options)
    args.setdefault("backend", "reference")
    assert vllm.context_attention_fwd(**args) is None
    return args["o"]


def test_signature_is_vllms():
    params = inspect.signature(vllm.context_attention_fwd).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == VLLM_ARGS
    defaults = {n: params[n].default for n in VLLM_ARGS[14:]}
    assert defaults == dict(alibi_slopes=None, sliding_window=None, sm_scale=None, skip_decode=False,
                            fp8_out_scale=None, sinks=None, is_block_table_ptr=False, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kv_cache_dtype, fp8_storage", [("auto", None), ("model", None), ("fp8", "uint8"),
                                                         ("fp8_e5m2", "uint8"), ("fp8", "float8_view"),
                                                         ("fp8_e5m2", "float8_view")])
@pytest.mark.parametrize("sliding_window", [0, 16])
def test_vllm_construction_matches_sdpa(dtype, kv_cache_dtype, fp8_storage, sliding_window):
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    kv = name if kv_cache_dtype == "model" else kv_cache_dtype
    batch = vllm_batch(QUERY_LENS, CTX_LENS, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype,
                       kv_cache_dtype=kv, fp8_storage=fp8_storage or "uint8", seed=7)
    x = batch["k_cache"].shape[4]
    assert x == 8 and batch["k_cache"].dtype == (torch.uint8 if "fp8" in kv else dtype)
    out = call(batch, sliding_window=sliding_window)
    assert torch.isfinite(out.float()).all()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), sdpa_reference(batch, sliding_window), atol=atol, rtol=rtol)


def test_context_lengths_from_start_loc():
    """b_ctx_len = b_seq_len - (b_start_loc[i + 1] - b_start_loc[i]): the classic drop-in with that
    b_ctx_len gives exactly the same output."""
    batch = vllm_batch(QUERY_LENS, CTX_LENS, seed=2)
    out = call(batch).clone()
    ctx = torch.tensor(CTX_LENS, dtype=torch.int32)
    o = torch.full_like(out, float("nan"))
    pp.context_attention_fwd(batch["q"], batch["k"], batch["v"], o, "auto", batch["k_cache"], batch["v_cache"],
                             batch["b_loc"], batch["b_start_loc"], batch["b_seq_len"], ctx, None,
                             backend="reference", validate="full")
    assert torch.equal(out, o)


@pytest.mark.parametrize("options", [
    dict(skip_decode=True), dict(causal=False), dict(fp8_out_scale=0.01), dict(kv_in_cache=True),
    dict(skip_decode=True, causal=False, fp8_out_scale="tensor", kv_in_cache=True, sinks=True, sliding_window=7),
], ids=["skip_decode", "non_causal", "fp8_out_scale", "kv_in_cache", "all"])
def test_options_equal_the_native_api(options):
    options = dict(options)
    scale = options.pop("fp8_out_scale", None)
    spec = BatchSpec(query_lens=QUERY_LENS, context_lens=CTX_LENS, layout="split", x=8, num_heads=4,
                     num_kv_heads=2, head_size=32, block_size=16, seed=4,
                     fp8_out_scale=0.01 if scale is not None else None, **options)
    p = make_problem(spec)
    if scale == "tensor":
        p = dataclasses.replace(p, options=dataclasses.replace(p.options, fp8_out_scale=torch.tensor([0.01])))
    o = p.options
    native = pp.prefill_attention(p.q, p.k, p.v, p.cache, p.batch, sliding_window=o.sliding_window, sinks=o.sinks,
                                  causal=o.causal, skip_decode=o.skip_decode, fp8_out_scale=o.fp8_out_scale,
                                  out=fresh_output(p).out, backend="reference", validate="full")
    c, b = p.cache, p.batch
    out = fresh_output(p).out
    vllm.context_attention_fwd(p.q, p.k, p.v, out, "auto", c.key, c.value, b.block_table, b.query_start,
                               b.seq_lens, None, None, 1.0, 1.0, sliding_window=o.sliding_window, sinks=o.sinks,
                               skip_decode=o.skip_decode, fp8_out_scale=o.fp8_out_scale, causal=o.causal,
                               backend="reference", validate="full")
    rows = written_rows(p)
    assert torch.isnan(out[~rows].float()).all() and torch.isfinite(out[rows].float()).all()
    assert torch.equal(out[rows].float(), native[rows].float())
    if o.fp8_out_scale is not None:
        assert out.dtype == torch.float8_e4m3fn
        plain = pp.reference_prefill(dataclasses.replace(p, out=torch.empty(p.q.shape),
                                                         options=dataclasses.replace(p.options, fp8_out_scale=None)))
        torch.testing.assert_close(out[rows].float() * 0.01, plain[rows], atol=FP8_OUT_TOLERANCE[0] * 0.01,
                                   rtol=FP8_OUT_TOLERANCE[1])


def test_is_block_table_ptr_is_refused():
    batch = vllm_batch(QUERY_LENS, CTX_LENS)
    with pytest.raises(ValueError, match=r"^is_block_table_ptr: expected False, got True; .* pass b_loc as block "
                                         r"numbers$"):
        call(batch, is_block_table_ptr=True)
    assert torch.isnan(batch["o"]).all()


@pytest.mark.parametrize("validate", ["basic", "full"])
def test_start_loc_needs_b_plus_1_entries(validate):
    batch = vllm_batch(QUERY_LENS, CTX_LENS)
    starts = batch["b_start_loc"]
    for bad, error, message in (
            (starts[:5], ValueError, r"expected shape \[6\] \(num_seqs \+ 1 entries: query lengths are the differences "
                                     r"of consecutive starts\), got \[5\]"),
            (starts[None], ValueError, r"expected a 1-D tensor \[num_seqs \+ 1\], got shape \[1, 6\]"),
            (starts.float(), TypeError, r"expected dtype int32 or int64, got float32"),
            (torch.empty(6, dtype=starts.dtype, device="meta"), ValueError,
             r"expected a tensor on cpu \(the device of q\), got one on meta"),
            (starts.tolist(), TypeError, r"expected a torch.Tensor, got list")):
        with pytest.raises(error, match=rf"^b_start_loc: {message}$"):
            call(batch, b_start_loc=bad, validate=validate)
    assert torch.isnan(batch["o"]).all()


class AtenOperations(TorchDispatchMode):
    """The names of the PyTorch operations run while it is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """The generic backend on the CPU with its kernel launch stubbed: ``(problems bound, tensors launched)``. The
    dispatch, the plan and the launch's arguments (``call_tensors``) are the real ones."""
    from pagedprefill.triton import launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the generic backend takes CPU tensors in the interpreter
    bound, launched = [], []

    def bind_launch(problem, config, shape=None):  # a compiled kernel that computes nothing
        bound.append(problem)
        return lambda tensors: launched.append(tensors) or True

    monkeypatch.setattr(launch, "bind_launch", bind_launch)
    plans.forget()
    yield bound, launched
    plans.forget()


def test_a_repeated_call_launches_its_plan_without_any_pytorch_operation(launches):
    """The context lengths are left to the kernels (the batch has none), so the second call of a signature
    computes nothing on the way to its launch: no PyTorch operation at all, the plan of the first call."""
    bound, launched = launches
    call(vllm_batch(QUERY_LENS, CTX_LENS, seed=5), backend="generic")
    assert len(bound) == 1 and bound[0].batch.context_lens is None
    again = vllm_batch(QUERY_LENS, CTX_LENS, seed=6)  # new tensors, the same signature
    with AtenOperations() as seen:
        call(again, backend="generic")
    assert seen.names == []
    assert len(bound) == 1 and len(launched) == 1
    starts, seq_lens, context_slot = launched[0][2]  # the Batch group: the lengths' slot holds seq_lens, unread
    assert starts is again["b_start_loc"] and seq_lens is again["b_seq_len"] and context_slot is again["b_seq_len"]


def test_model_dtype_name_must_match_the_cache():
    batch = vllm_batch(QUERY_LENS, CTX_LENS, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^kv_cache_dtype: 'float16' names an unquantised float16 cache, "
                                        r"but k_cache has dtype bfloat16"):
        call(batch, kv_cache_dtype="float16")


def test_errors_name_o_and_b_loc():
    batch = vllm_batch(QUERY_LENS, CTX_LENS)
    with pytest.raises(TypeError, match=r"^o: expected dtype float8_e4m3fn or float8_e4m3fnuz \(FP8 output"):
        call(batch, fp8_out_scale=0.1)
    table = batch["b_loc"].clone()
    table[0, 1] = 10_000
    with pytest.raises(ValueError, match=r"^b_loc: expected block numbers in \[0, \d+\), got 10000 at \[0, 1\]"):
        call(batch, b_loc=table)


def test_errors_name_the_vllm_arguments():
    """Every metadata error names an argument of this signature; the context lengths it derives are named by
    the expression that derives them (there is no b_ctx_len to name)."""
    batch = vllm_batch(QUERY_LENS, CTX_LENS)
    with pytest.raises(TypeError, match=r"^b_seq_len: expected dtype int32 or int64, got float32$"):
        call(batch, b_seq_len=batch["b_seq_len"].float())
    with pytest.raises(ValueError, match=r"^max_input_len: expected >= the longest query \(33\), got 5$"):
        call(batch, max_input_len=5, validate="full")
    short = batch["b_seq_len"].clone()
    short[2] = 30  # sequence 2 has 33 new tokens
    with pytest.raises(ValueError, match=r"^b_seq_len: expected b_seq_len\[i\] >= b_start_loc\[i \+ 1\] - "
                                         r"b_start_loc\[i\] \(the new tokens of sequence i\), "
                                         r"got b_seq_len\[2\]=30 < 33$"):
        call(batch, b_seq_len=short, validate="full")
    for starts, message in (([0, 5, 3], r"expected non-decreasing offsets, got \[0, 5, 3\]"),
                            ([-1, 5, 7], r"expected offsets >= 0, got b_start_loc\[0\]=-1"),
                            ([0, 5, 9], r"expected the new tokens of all sequences to end within the 7 tokens of "
                                         r"q, got an end at 9")):
        two = vllm_batch((5, 2), (3, 4), seed=1)
        bad = torch.tensor(starts, dtype=two["b_start_loc"].dtype)
        with pytest.raises(ValueError, match=rf"^b_start_loc: {message}$"):
            call(two, b_start_loc=bad, validate="full")
    assert torch.isnan(batch["o"]).all()


@pytest.mark.parametrize("names, table, context", [
    ("native", "block_table", r"context_lens: expected values >= 0, got context_lens\[1\]=-1"),
    ("drop_in", "b_loc", r"b_ctx_len: expected values >= 0, got b_ctx_len\[1\]=-1"),
    # no b_ctx_len in that signature: the context length comes from b_seq_len, which the error names
    ("vllm", "b_loc", r"b_seq_len: expected b_seq_len\[i\] >= b_start_loc\[i \+ 1\] - b_start_loc\[i\] "
                      r"\(the new tokens of sequence i\), got b_seq_len\[1\]=14 < 15")])
def test_operators_name_the_arguments_of_the_calling_function(names, table, context):
    """``argument_names`` (passed by the public functions while torch.compile traces them) picks the names."""
    p = make_problem(BatchSpec(query_lens=(3, 5), context_lens=(4, 9)))
    c, b = p.cache, p.batch
    tensors = (p.q, p.k, p.v, c.key, c.value)
    with pytest.raises(TypeError, match=rf"^{table}: expected dtype int32 or int64, got float32$"):
        torch.ops.pagedprefill.prefill_attention(*tensors, b.block_table.float(), b.query_start, b.seq_lens,
                                                 b.context_lens, backend="reference", argument_names=names)
    ctx = b.context_lens.clone()
    ctx[1] = -1
    with pytest.raises(ValueError, match=rf"^{context}$"):
        torch.ops.pagedprefill.prefill_attention(*tensors, b.block_table, b.query_start, b.seq_lens, ctx,
                                                 backend="reference", validate="full", argument_names=names)
    with pytest.raises(ValueError, match=r"^argument_names: expected one of 'native', 'drop_in', 'vllm', got 'o'$"):
        torch.ops.pagedprefill.prefill_attention(*tensors, b.block_table, b.query_start, b.seq_lens,
                                                 b.context_lens, backend="reference", argument_names="o")
