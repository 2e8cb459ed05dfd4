"""The ``torch.library`` operators ``torch.ops.pagedprefill.prefill_attention`` (functional) and
``prefill_attention_`` (writes ``out``) on the CPU with the reference backend.

* both operators compute exactly what :func:`pagedprefill.prefill_attention` computes from the same data, for
  both cache layouts, FP8 caches with float and tensor scales, ALiBi, sliding window, softcap and sinks;
* ``torch.library.opcheck`` accepts their registration (schema, fake implementation, AOT dispatch);
* a small module that projects hidden states to q/k/v and calls the operator compiles with
  ``fullgraph=True`` (no graph break, also per ``torch._dynamo.explain``) and matches its eager twin that
  calls the Python API;
* ``import pagedprefill`` registers the operators without importing Triton.

Data is N(0, 1) from :func:`pagedprefill.testing.make_problem`; outputs start poisoned with NaN.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Optional

import pagedprefill as pp
import pytest
import torch
from pagedprefill import ops
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.testing.models import AttentionBlock, block_inputs

OPS = torch.ops.pagedprefill

CASES = {
    "nhd": BatchSpec(),
    "split": BatchSpec(layout="split"),
    "split_head_24_float32": BatchSpec(layout="split", head_size=24, dtype=torch.float32),
    "gqa_bfloat16": BatchSpec(num_heads=8, num_kv_heads=2, dtype=torch.bfloat16),
    "fp8_e4m3_float_scales": BatchSpec(kv_cache_dtype="fp8_e4m3"),
    "fp8_e5m2_tensor_scales": BatchSpec(kv_cache_dtype="fp8_e5m2", scale_as_tensor=True),
    "fp8_split_float_scales": BatchSpec(kv_cache_dtype="fp8", layout="split"),
    "fp8_split_tensor_scales": BatchSpec(kv_cache_dtype="fp8", layout="split", scale_as_tensor=True),
    "alibi": BatchSpec(alibi=True),
    "window": BatchSpec(sliding_window=6),
    "softcap": BatchSpec(softcap=5.0),
    "sinks": BatchSpec(sinks=True),
    "all_features_split": BatchSpec(layout="split", alibi=True, sliding_window=13, softcap=8.0, sinks=True,
                                    sm_scale=0.2, kv_cache_dtype="fp8", scale_as_tensor=True, seed=3),
    "decode_rows_start_loc_b": BatchSpec(query_lens=(1, 1, 9, 1), context_lens=(30, 3, 5, 0),
                                         start_loc_entries="B", seed=5),
}


# -- helpers ---------------------------------------------------------------------------------------------------
def op_arguments(p: pp.PrefillProblem, backend: str = "reference") -> tuple[tuple, dict]:
    return ops.op_arguments(p, backend)


def inplace_arguments(p: pp.PrefillProblem, out: torch.Tensor, backend: str = "reference") -> tuple[tuple, dict]:
    tensors, kwargs = op_arguments(p, backend)
    return tensors[:3] + (out,) + tensors[3:], kwargs


def api_result(p: pp.PrefillProblem, backend: Optional[str] = "reference") -> torch.Tensor:
    """What the Python API computes for ``p`` (into a fresh NaN-poisoned output)."""
    o = p.options
    return pp.prefill_attention(p.q, p.k, p.v, p.cache, p.batch, sm_scale=o.sm_scale, alibi_slopes=o.alibi_slopes,
                                sliding_window=o.sliding_window, softcap=o.softcap, sinks=o.sinks,
                                out=torch.full_like(p.q, float("nan")), backend=backend)


def assert_real_output(out: torch.Tensor, like: torch.Tensor) -> None:
    assert out.shape == like.shape and out.dtype == like.dtype and out.device == like.device
    assert not bool(torch.isnan(out).any()), f"{int(torch.isnan(out).sum())} output elements are NaN (unwritten)"
    assert float(out.float().std()) > 0.05, "output is (nearly) constant: the data did not reach the kernel"


# -- the operators equal the Python API ------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_ops_equal_python_api(case):
    p = make_problem(CASES[case])
    expected = api_result(p)
    assert_real_output(expected, p.q)

    tensors, kwargs = op_arguments(p)
    got = OPS.prefill_attention(*tensors, **kwargs)
    assert_real_output(got, p.q)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"functional op, {case}: {m}")

    out = torch.full_like(p.q, float("nan"))
    args, kwargs = inplace_arguments(p, out)
    assert OPS.prefill_attention_(*args, **kwargs) is None
    assert_real_output(out, p.q)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=lambda m: f"in-place op, {case}: {m}")


def test_tensor_scales_equal_float_scales():
    """The same FP8 cache read with its scales as floats and as 1-element tensors gives the same output."""
    p = make_problem(BatchSpec(kv_cache_dtype="fp8_e4m3", layout="split", seed=7))
    k_scale, v_scale = float(p.cache.k_scale), float(p.cache.v_scale)
    assert k_scale != 1.0 and v_scale != 1.0
    tensors, kwargs = op_arguments(p)
    with_floats = OPS.prefill_attention(*tensors, **kwargs)
    kwargs.update(k_scale=1.0, v_scale=1.0, k_scale_tensor=torch.tensor([k_scale]),
                  v_scale_tensor=torch.tensor(v_scale))
    with_tensors = OPS.prefill_attention(*tensors, **kwargs)
    assert_real_output(with_tensors, p.q)
    torch.testing.assert_close(with_tensors, with_floats, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_floats, api_result(p), rtol=0, atol=0)


def test_layout_auto_and_automatic_backend():
    """``layout="auto"`` reads the layout from ``k_cache``'s rank; ``backend=""`` selects like the Python API."""
    for spec in (BatchSpec(layout="split", seed=1), BatchSpec(layout="nhd", seed=2)):
        p = make_problem(spec)
        tensors, kwargs = op_arguments(p, backend="")
        kwargs["layout"] = "auto"
        got = OPS.prefill_attention(*tensors, **kwargs)
        assert_real_output(got, p.q)
        torch.testing.assert_close(got, api_result(p, backend=None), rtol=2e-3, atol=2e-3)


def test_errors_name_the_argument():
    p = make_problem(BatchSpec())
    tensors, kwargs = op_arguments(p)
    with pytest.raises(ValueError, match="layout: expected 'nhd', 'split' or 'auto'"):
        OPS.prefill_attention(*tensors, **{**kwargs, "layout": "hnd"})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        OPS.prefill_attention(*tensors, **{**kwargs, "kv_cache_dtype": "int4"})
    with pytest.raises(pp.BackendUnavailableError, match="not installed"):
        OPS.prefill_attention(*tensors, **{**kwargs, "backend": "no-such-backend"})
    bad_k = torch.randn(p.k.shape[0], 3, p.k.shape[2], dtype=p.k.dtype)
    with pytest.raises(ValueError, match="num_kv_heads dividing"):
        OPS.prefill_attention(p.q, bad_k, bad_k, *tensors[3:], **kwargs)


def test_no_backward():
    """The operators are inference-only: the forward runs on tensors that require grad, a backward raises."""
    p = make_problem(BatchSpec(dtype=torch.float32))
    tensors, kwargs = op_arguments(p)
    q = p.q.clone().requires_grad_(True)
    out = OPS.prefill_attention(q, *tensors[1:], **kwargs)
    torch.testing.assert_close(out.detach(), api_result(p), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


# -- registration checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["nhd", "all_features_split"])
def test_opcheck(case):
    p = make_problem(CASES[case].replace(dtype=torch.float32))
    tensors, kwargs = op_arguments(p)
    torch.library.opcheck(OPS.prefill_attention.default, tensors, kwargs)
    args, kwargs = inplace_arguments(p, torch.full_like(p.q, float("nan")))
    torch.library.opcheck(OPS.prefill_attention_.default, args, kwargs)


def test_import_registers_ops_without_triton():
    code = (
        "import sys\n"
        "import torch\n"
        "import pagedprefill\n"
        "assert 'triton' not in sys.modules, 'import pagedprefill imported triton'\n"
        "assert 'pagedprefill.triton' not in sys.modules\n"
        "print(torch.ops.pagedprefill.prefill_attention.default._schema)\n"
        "print(torch.ops.pagedprefill.prefill_attention_.default._schema)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PAGEDPREFILL_LAZY_SELECT"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("pagedprefill::prefill_attention(Tensor q, Tensor? k, Tensor? v, Tensor k_cache")
    for option in ("bool causal=True", "bool skip_decode=False", "float fp8_out_scale=0.",
                   "Tensor? fp8_out_scale_tensor=None", 'str validate="basic"'):
        assert option in lines[0] and option in lines[1], f"{option} missing from the schemas"
    assert "Tensor(a3!) out" in lines[1] and lines[1].endswith("-> ()")


# -- torch.compile ---------------------------------------------------------------------------------------------
COMPILE_SPEC = BatchSpec(layout="split", kv_cache_dtype="fp8", scale_as_tensor=True, alibi=True, sliding_window=11,
                         softcap=6.0, sinks=True, dtype=torch.float32, seed=11)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["op", "op_"])
@pytest.mark.parametrize("layout", ["split", "nhd"])
def test_compiled_block_matches_eager(mode, layout):
    spec = COMPILE_SPEC.replace(layout=layout)
    block = AttentionBlock(spec, mode=mode, backend="reference")
    inputs = block_inputs(spec)
    with torch.no_grad():
        expected = block.eager_twin()(*inputs)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        got = compiled(*inputs)
    assert_real_output(got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_no_graph_break():
    block = AttentionBlock(COMPILE_SPEC, backend="reference")
    inputs = block_inputs(COMPILE_SPEC)
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [node.target for g in explained.graphs for node in g.graph.nodes]
    assert OPS.prefill_attention in targets or OPS.prefill_attention.default in targets, targets


def test_compiled_inplace_writes_graph_input():
    """``prefill_attention_`` on an ``out`` the caller owns: the compiled function writes the caller's tensor."""
    p = make_problem(BatchSpec(kv_cache_dtype="fp8_e4m3", scale_as_tensor=True, alibi=True, seed=13))
    args, kwargs = inplace_arguments(p, torch.full_like(p.q, float("nan")))
    out = args[3]

    def step(*tensors):
        OPS.prefill_attention_(*tensors, **kwargs)

    torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert_real_output(out, p.q)
    torch.testing.assert_close(out, api_result(p), rtol=0, atol=0)


def test_compiled_dynamic_shapes_one_graph():
    """With ``dynamic=True`` one graph serves batches of other token and sequence counts."""
    from torch._dynamo.testing import CompileCounterWithBackend

    spec_a = COMPILE_SPEC.replace(layout="nhd")
    spec_b = spec_a.replace(query_lens=(3, 20, 2, 7), context_lens=(0, 12, 41, 5), seed=12)
    block = AttentionBlock(spec_a, backend="reference")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter, dynamic=True)
    twin = block.eager_twin()
    compiles = []
    with torch.no_grad():
        for spec in (spec_a, spec_b):
            inputs = block_inputs(spec)
            got = compiled(*inputs)
            compiles.append(counter.frame_count)
            assert_real_output(got, inputs[0])
            torch.testing.assert_close(got, twin(*inputs), rtol=1e-5, atol=1e-5)
    assert compiles[1] == compiles[0], "the second batch recompiled"


def test_compile_reports_bad_shapes_at_trace_time():
    """The fake implementation validates shapes, so a wrong call fails while compiling, naming the argument."""
    p = make_problem(BatchSpec())
    tensors, kwargs = op_arguments(p)
    bad_k = torch.randn(p.k.shape[0], 3, p.k.shape[2], dtype=p.k.dtype)

    def step(q, k, v, *rest):
        return OPS.prefill_attention(q, k, v, *rest, **kwargs)

    with pytest.raises(Exception, match="num_kv_heads dividing"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(p.q, bad_k, bad_k, *tensors[3:])


def test_compiled_block_inductor_cpu():
    spec = dataclasses.replace(COMPILE_SPEC, layout="nhd", dtype=torch.float32)
    block = AttentionBlock(spec, backend="reference")
    inputs = block_inputs(spec)
    with torch.no_grad():
        expected = block.eager_twin()(*inputs)
        got = torch.compile(block, fullgraph=True, backend="inductor")(*inputs)
    assert_real_output(got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
