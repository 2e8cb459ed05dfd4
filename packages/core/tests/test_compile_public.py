"""``torch.compile(fullgraph=True)`` of code calling the public functions directly:
:func:`pagedprefill.context_attention_fwd`, :func:`pagedprefill.prefill_attention` and
:func:`pagedprefill.vllm.context_attention_fwd` (the last two with the new options), on the CPU with the
reference backend and with the default selection.

While tracing, the public functions call the custom operator ``prefill_attention_`` (one graph node), so the
reference's host reads never meet the tracer: 0 graph breaks (``torch._dynamo.explain``), exactly one graph,
the operator in it, and the compiled function's output equal to its eager run's, every element.
"""

from __future__ import annotations

import pagedprefill as pp
import pytest
import torch
from pagedprefill import vllm
from pagedprefill.testing import BatchSpec, fresh_output, make_problem
from pagedprefill.testing.cases import written_rows

# torch's inductor imports torch.utils.mkldnn, whose module classes still declare their methods with
# torch.jit.script_method, deprecated in torch itself: 14 warnings from torch's code, at the first inductor
# compile of the process, about nothing this package calls. Only that warning from that module is silenced.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script")

SPEC = BatchSpec(query_lens=(5, 1, 17, 0, 3), context_lens=(9, 40, 0, 6, 1), layout="split", alibi=True, sinks=True,
                 sliding_window=7, seed=1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _drop_in(backend):
    def f(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens, slopes, sinks):
        pp.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, table, start, seq_lens, ctx_lens, None,
                                 alibi_slopes=slopes, sliding_window=7, sinks=sinks, backend=backend)
        return o * 2
    return f


def _native(backend, **options):
    def f(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens, slopes, sinks):
        cache = pp.PagedKVCache(k_cache, v_cache, "split")
        batch = pp.BatchMetadata(start, seq_lens, ctx_lens, table)
        out = pp.prefill_attention(q, k, v, cache, batch, alibi_slopes=slopes, sliding_window=7, sinks=sinks,
                                   out=o, backend=backend, **options)
        return out.float() + 1
    return f


def _vllm(backend, **options):
    def f(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens, slopes, sinks):
        vllm.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, table, start, seq_lens, None, None, 1.0,
                                   1.0, sliding_window=7, sinks=sinks, backend=backend, **options)
        return o.float() - 1
    return f


FUNCTIONS = {
    "context_attention_fwd": (_drop_in, {}, {}),
    "prefill_attention": (_native, {}, {}),
    "prefill_attention_options": (_native, dict(causal=False, skip_decode=True, fp8_out_scale=0.05),
                                  dict(skip_decode=True, fp8_out_scale=0.05, causal=False)),
    "prefill_attention_kv_in_cache": (_native, {}, dict(kv_in_cache=True)),
    "vllm": (_vllm, {}, {}),
    "vllm_options": (_vllm, dict(skip_decode=True, fp8_out_scale=0.05, causal=False),
                     dict(skip_decode=True, fp8_out_scale=0.05, causal=False)),
}


def _inputs(spec_changes: dict):
    p = make_problem(SPEC.replace(**spec_changes))
    c, b, o = p.cache, p.batch, p.options
    return p, (p.q, p.k, p.v, fresh_output(p).out, c.key, c.value, b.block_table, b.query_start, b.seq_lens,
               b.context_lens, o.alibi_slopes, o.sinks)


@pytest.mark.parametrize("backend", ["reference", None], ids=["reference", "default"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_compiles_without_graph_breaks(name, backend):
    make, options, spec_changes = FUNCTIONS[name]
    fn = make(backend, **options)
    p, args = _inputs(spec_changes)
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    graph = explained.graphs[0]
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any("pagedprefill.prefill_attention_" in t for t in targets), targets
    torch._dynamo.reset()

    eager_args = _inputs(spec_changes)[1]
    expected = fn(*eager_args)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    rows = written_rows(p)
    assert torch.isfinite(expected[rows].float()).all()
    assert float(expected[rows].float().std()) > 0.05, "output is (nearly) constant"
    assert torch.equal(compiled[rows], expected[rows])
    assert torch.equal(torch.isnan(compiled[~rows]), torch.isnan(expected[~rows]))


def test_inductor_and_dynamic_shapes():
    """inductor compiles the public function too, and one compiled function serves other batch sizes."""
    fn = _native("reference", causal=False)
    compiled = torch.compile(fn, fullgraph=True, backend="inductor", dynamic=True)
    for changes in ({}, dict(query_lens=(3, 12, 1), context_lens=(0, 30, 8), seed=5)):
        p, args = _inputs(changes)
        eager = fn(*_inputs(changes)[1])
        assert torch.equal(compiled(*args), eager)


def test_validation_errors_while_tracing_name_the_argument():
    """Shape checks run while tracing and name the caller's arguments (``o`` in the drop-in)."""
    fn = _drop_in("reference")
    p, args = _inputs({})
    bad = list(args)
    bad[3] = bad[3][:, :2]
    with pytest.raises(Exception, match=r"o: expected shape \[26, 4, 32\] \(the shape of q\), got \[26, 2, 32\]"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*bad)


def test_full_validation_runs_inside_the_compiled_operator():
    """``validate="full"`` reaches the operator, which reads the metadata when it runs."""
    def f(q, k, v, o, k_cache, v_cache, table, start, seq_lens, ctx_lens, slopes, sinks):
        pp.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, table, start, seq_lens, ctx_lens, None,
                                 validate="full", backend="reference")
        return o

    p, args = _inputs({})
    bad = list(args)
    bad[9] = bad[9].clone()
    bad[9][3] = -1
    with pytest.raises(Exception, match=r"b_ctx_len: expected values >= 0, got b_ctx_len\[3\]=-1"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(*bad)


def test_public_functions_never_call_an_enum_class_with_a_member(monkeypatch):
    """torch 2.11's Dynamo breaks the graph on ``KVLayout(KVLayout.SPLIT)`` (an enum class called with one of its
    members) while 2.13's folds it, so the CI's torch cannot see that break: this eager check guards it on any
    torch. Every public function runs once; no enum class of pagedprefill may be called with a member."""
    import enum

    from pagedprefill.types import KVCacheDType, KVLayout

    calls = []
    original = type(KVLayout).__call__

    def recording(cls, value, *args, **kwargs):
        if cls in (KVLayout, KVCacheDType) and isinstance(value, cls):
            calls.append(f"{cls.__name__}({value!r})")
        return original(cls, value, *args, **kwargs)

    monkeypatch.setattr(enum.EnumMeta, "__call__", recording)
    for make, options, spec_changes in FUNCTIONS.values():
        _, args = _inputs(spec_changes)
        make("reference", **options)(*args)
    assert KVLayout("split") is KVLayout.SPLIT and calls == [], calls
