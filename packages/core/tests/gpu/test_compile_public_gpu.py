"""The public functions (:func:`pagedprefill.context_attention_fwd`, :func:`pagedprefill.prefill_attention`,
:func:`pagedprefill.vllm.context_attention_fwd`) compiled by inductor with ``fullgraph=True`` on the GPU with
the selected Triton backend: 0 graph breaks, output equal to the eager call, and the compiled function
captured in a CUDA graph whose replays on new data give the eager result.

The optional features run where the backend lists them in ``supported_features``; otherwise those cases skip,
printing the reason. Each test skips, with the reason, without a CUDA GPU or a Triton backend.

Every torch from 2.11 on takes the same path (no version-specific code): the graph breaks torch 2.11 showed
here ("Unexpected type in sourceless builder", from ``PagedKVCache`` calling an enum class with a member)
are gone, and ``test_compile_public.py`` checks the same functions on the CPU with torch 2.11 and 2.13.
"""

from __future__ import annotations

import pagedprefill as pp
import pytest
import torch
from pagedprefill import vllm
from pagedprefill.features import missing_features
from pagedprefill.testing import BatchSpec, fresh_output, make_problem
from pagedprefill.testing.cases import written_rows

SPEC = BatchSpec(query_lens=(37, 1, 130, 5), context_lens=(90, 300, 0, 17), num_heads=8, num_kv_heads=2,
                 head_size=64, block_size=16, layout="split", sliding_window=48, seed=31)

OPTIONS = {
    "plain": {},
    "skip_decode": dict(skip_decode=True),
    "non_causal": dict(causal=False),
    "fp8_out_scale": dict(fp8_out_scale=0.05),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _functions(backend: str, options: dict) -> dict:
    def drop_in(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens):
        pp.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, table, start, seq_lens, ctx_lens, None,
                                 sliding_window=48, backend=backend)
        return o.float() * 2

    def native(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens):
        cache = pp.PagedKVCache(k_cache, v_cache, "split")
        batch = pp.BatchMetadata(start, seq_lens, ctx_lens, table)
        pp.prefill_attention(q, k, v, cache, batch, sliding_window=48, out=o, backend=backend, **options)
        return o.float() + 1

    def engine(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens):
        vllm.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, table, start, seq_lens, None, None, 1.0,
                                   1.0, sliding_window=48, backend=backend, **options)
        return o.float() - 1

    functions = {"native": native, "vllm": engine}
    if not options:
        functions["context_attention_fwd"] = drop_in
    return functions


def _inputs(spec: BatchSpec, gpu) -> tuple:
    p = make_problem(spec, gpu)
    c, b = p.cache, p.batch
    return p, [p.q, p.k, p.v, fresh_output(p).out, c.key, c.value, b.block_table, b.query_start, b.seq_lens,
               b.context_lens]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_compiled_public_functions_and_cuda_graph(option, gpu, gpu_backend):
    options = OPTIONS[option]
    spec = SPEC.replace(**options)  # the options are BatchSpec fields of the same names
    p, _ = _inputs(spec, gpu)
    missing = missing_features(gpu_backend, p)
    if missing:
        pytest.skip(f"backend {gpu_backend.name!r} does not list {sorted(missing)} in supported_features")
    rows = written_rows(p)
    for name, fn in _functions(gpu_backend.name, options).items():
        _, args = _inputs(spec, gpu)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*_inputs(spec, gpu)[1])
        assert explained.graph_break_count == 0, (name, explained.break_reasons)
        torch._dynamo.reset()

        expected = fn(*_inputs(spec, gpu)[1])
        assert torch.isfinite(expected[rows]).all() and float(expected[rows].std()) > 0.05
        compiled = torch.compile(fn, fullgraph=True, backend="inductor")
        got = compiled(*args)
        torch.testing.assert_close(got[rows], expected[rows], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")

        # capture the compiled function in a CUDA graph; replay on new data written into the static inputs
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                compiled(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(*args)
        for seed in (1, 2):
            _, fresh = _inputs(spec.replace(seed=spec.seed + seed), gpu)
            for static, new in zip(args, fresh):
                if static is not None and static is not args[3]:
                    static.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            want = fn(*_inputs(spec.replace(seed=spec.seed + seed), gpu)[1])
            torch.testing.assert_close(static_out[rows], want[rows], rtol=0, atol=0,
                                       msg=lambda m, name=name, seed=seed: f"{name}, replay {seed}: {m}")
