"""The custom operators on a CUDA GPU with the selected Triton backend: equal to the Python API, compiled by
inductor with ``fullgraph=True`` (no graph break), captured in a CUDA graph by hand and through
``mode="reduce-overhead"``, and with dynamic shapes.

Skipped, with the reason, when no CUDA GPU is present or no Triton backend supports it.
Data is N(0, 1) from :func:`pagedprefill.testing.make_problem`; outputs start poisoned with NaN.
"""

from __future__ import annotations

from typing import Optional

import pagedprefill as pp
import pytest
import torch
from pagedprefill import ops
from pagedprefill.testing import DEFAULT_TOLERANCES, BatchSpec, make_problem
from pagedprefill.testing.models import AttentionBlock, block_inputs

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

DEVICE = torch.device("cuda")
OPS = torch.ops.pagedprefill

#: (atol, rtol) of a compiled model against its eager twin: inductor may pick other GEMM kernels.
MODEL_TOLERANCES = {torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (1e-3, 1e-3)}


@pytest.fixture(scope="module", autouse=True)
def triton_backend() -> pp.Backend:
    """The backend selected for the GPU; skip when it is the reference (no Triton backend fits)."""
    try:
        chosen = pp.select_backend(DEVICE)
    except pp.BackendUnavailableError as exc:
        pytest.skip(f"no pagedprefill backend supports {torch.cuda.get_device_name()}: {exc}")
    if chosen.name == "reference":
        rows = pp.get_registry().status(pp.DeviceInfo.detect(DEVICE))
        why = "; ".join(f"{r.name}: {', '.join(r.reasons) or 'supported'}" for r in rows)
        pytest.skip(f"needs a Triton backend for {torch.cuda.get_device_name()}, only the reference fits ({why})")
    print(f"selected backend: {chosen.name} on {torch.cuda.get_device_name()}")
    return chosen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def op_arguments(p: pp.PrefillProblem, backend: str = "") -> tuple[tuple, dict]:
    return ops.op_arguments(p, backend)


def api_result(p: pp.PrefillProblem, backend: Optional[str] = None) -> torch.Tensor:
    o = p.options
    return pp.prefill_attention(p.q, p.k, p.v, p.cache, p.batch, sm_scale=o.sm_scale, alibi_slopes=o.alibi_slopes,
                                sliding_window=o.sliding_window, softcap=o.softcap, sinks=o.sinks,
                                out=torch.full_like(p.q, float("nan")), backend=backend)


def assert_real_output(out: torch.Tensor, like: torch.Tensor) -> None:
    assert out.shape == like.shape and out.dtype == like.dtype and out.device == like.device
    assert not bool(torch.isnan(out).any()), f"{int(torch.isnan(out).sum())} output elements are NaN (unwritten)"
    assert float(out.float().std()) > 0.05, "output is (nearly) constant: the data did not reach the kernel"


CASES = {
    "nhd_fp16": BatchSpec(query_lens=(37, 1, 130, 5), context_lens=(90, 300, 0, 17), block_size=16, head_size=64),
    "split_bf16": BatchSpec(layout="split", dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_size=128,
                            query_lens=(64, 3, 200), context_lens=(500, 33, 0), block_size=16),
    "fp8_tensor_scales": BatchSpec(kv_cache_dtype="fp8_e4m3", scale_as_tensor=True, query_lens=(40, 9),
                                   context_lens=(257, 64), block_size=16, head_size=128),
    "all_features_split": BatchSpec(layout="split", alibi=True, sliding_window=33, softcap=20.0, sinks=True,
                                    sm_scale=0.1, kv_cache_dtype="fp8", query_lens=(70, 2, 15),
                                    context_lens=(120, 49, 0), head_size=64, block_size=32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ops_equal_python_api(case, triton_backend):
    p = make_problem(CASES[case], DEVICE)
    expected = api_result(p)
    oracle = api_result(p, backend="reference")
    atol, rtol = DEFAULT_TOLERANCES[p.q.dtype]
    torch.testing.assert_close(expected, oracle, atol=atol, rtol=rtol)

    tensors, kwargs = op_arguments(p)
    got = OPS.prefill_attention(*tensors, **kwargs)
    assert_real_output(got, p.q)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    out = torch.full_like(p.q, float("nan"))
    OPS.prefill_attention_(*tensors[:3], out, *tensors[3:], **kwargs)
    assert_real_output(out, p.q)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


#: The model's width on the GPU (the CPU's tests keep the block's default of 48).
HIDDEN = 256


def model(spec: BatchSpec, mode: str = "op") -> AttentionBlock:
    """The attention block on the GPU, with the backend selected for it."""
    return AttentionBlock(spec, HIDDEN, mode=mode, device=DEVICE)


def model_inputs(spec: BatchSpec, seed: int = 0) -> tuple:
    """The block's inputs on the GPU (``seed``: other hidden states for the same batch)."""
    return block_inputs(spec, HIDDEN, DEVICE, seed)


MODEL_SPEC = BatchSpec(layout="split", kv_cache_dtype="fp8", scale_as_tensor=True, alibi=True, sliding_window=48,
                       softcap=30.0, sinks=True, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       query_lens=(50, 1, 97, 4), context_lens=(200, 77, 0, 31), seed=21)


@pytest.mark.parametrize("mode", ["op", "op_"])
def test_compiled_block_inductor(mode):
    block = model(MODEL_SPEC, mode=mode)
    inputs = model_inputs(MODEL_SPEC)
    atol, rtol = MODEL_TOLERANCES[MODEL_SPEC.dtype]
    with torch.no_grad():
        expected = block.eager_twin()(*inputs)
        got = torch.compile(block, fullgraph=True, backend="inductor")(*inputs)
    assert_real_output(got, expected)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def test_no_graph_break():
    block = model(MODEL_SPEC)
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(*model_inputs(MODEL_SPEC))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_compiled_dynamic_shapes():
    """One compiled model on batches of other token and sequence counts (``dynamic=True``)."""
    spec_b = MODEL_SPEC.replace(query_lens=(3, 120, 9), context_lens=(64, 0, 333), seed=22)
    block = model(MODEL_SPEC)
    compiled = torch.compile(block, fullgraph=True, backend="inductor", dynamic=True)
    twin = block.eager_twin()
    atol, rtol = MODEL_TOLERANCES[MODEL_SPEC.dtype]
    with torch.no_grad():
        for spec in (MODEL_SPEC, spec_b):
            inputs = model_inputs(spec)
            got = compiled(*inputs)
            assert_real_output(got, inputs[0])
            torch.testing.assert_close(got, twin(*inputs), atol=atol, rtol=rtol)


def test_cuda_graph_capture_and_replay():
    """The operator (Triton backend) is captured in a CUDA graph; replays on new data give the eager result."""
    spec = CASES["all_features_split"].replace(scale_as_tensor=True)
    p = make_problem(spec, DEVICE)
    tensors, kwargs = op_arguments(p)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            OPS.prefill_attention(*tensors, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = OPS.prefill_attention(*tensors, **kwargs)
    for seed in (1, 2):
        fresh = make_problem(spec.replace(seed=spec.seed + seed), DEVICE)
        pairs = [(p.q, fresh.q), (p.k, fresh.k), (p.v, fresh.v), (p.cache.key, fresh.cache.key),
                 (p.cache.value, fresh.cache.value), (p.cache.k_scale, fresh.cache.k_scale),
                 (p.cache.v_scale, fresh.cache.v_scale), (p.batch.block_table, fresh.batch.block_table),
                 (p.options.alibi_slopes, fresh.options.alibi_slopes), (p.options.sinks, fresh.options.sinks)]
        for static, new in pairs:
            assert static.shape == new.shape and not torch.equal(static, new)
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert_real_output(static_out, p.q)
        torch.testing.assert_close(static_out, api_result(fresh), rtol=0, atol=0)


def test_reduce_overhead_mode():
    """``mode="reduce-overhead"`` (CUDA graphs through inductor): nothing is skipped and replays are right."""
    from torch._dynamo.utils import counters

    counters.clear()
    block = model(MODEL_SPEC)
    twin = block.eager_twin()
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    atol, rtol = MODEL_TOLERANCES[MODEL_SPEC.dtype]
    with torch.no_grad():
        for step in range(4):
            inputs = model_inputs(MODEL_SPEC, seed=step)
            got = compiled(*inputs).clone()
            assert_real_output(got, inputs[0])
            torch.testing.assert_close(got, twin(*inputs), atol=atol, rtol=rtol)
    stats = dict(counters["inductor"])
    assert not stats.get("cudagraph_skips"), f"CUDA graphs were skipped: {stats}"
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    recorded = sum(len(nodes) for nodes in getattr(manager, "roots", {}).values()) if manager is not None else 0
    assert recorded >= 1, "no CUDA graph was recorded"
