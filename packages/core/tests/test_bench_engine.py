"""``pagedprefill bench --suite engine`` on the CPU: tiny twins of the suite's workloads through the reference
backend (and the generic one under Triton's interpreter), timed by the host clock, with a stand-in for
FlashAttention-4's ``flash_attn.cute`` that computes attention from the arguments it receives, so that a page
table, ``cu_seqlens`` or ``seqused_k`` passed wrong gives a wrong output."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest
import torch
from pagedprefill import workloads
from pagedprefill.cli import bench, fa4, main
from pagedprefill.testing.interpreted import run_interpreted
from pagedprefill.workloads import BatchSpec, Workload, flops, kv_bytes, make_problem

CPU = torch.device("cpu")


def tiny(workload: Workload) -> Workload:
    """A twin of ``workload`` small enough for the CPU: at most 5 sequences of at most 3 new tokens, contexts
    divided by 4096, an eighth of the heads, head size and block (the engine suite's rows keep their kind:
    decode rows keep one new token, the long prefill keeps no context, memory-bound rows stay so)."""
    s = workload.spec
    groups = s.num_heads // s.num_kv_heads
    kv_heads = 2
    spec = s.replace(query_lens=tuple(min(q, 3) for q in s.query_lens)[:5],
                     context_lens=tuple(c // 4096 for c in s.context_lens)[:5], num_kv_heads=kv_heads,
                     num_heads=kv_heads * groups, head_size=max(8, s.head_size // 8),
                     block_size=max(2, s.block_size // 8))
    return Workload(workload.name, spec, workload.note, workload.memory_bound)


def tiny_suite() -> list[Workload]:
    return [tiny(w) for w in workloads.engine_suite()]


def host_ms(run, reps: int) -> float:
    """The host clock's milliseconds for one call (the CPU has no device events)."""
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Attention of ``q`` ``[n, H, D]`` over ``[L, Hkv, D]`` keys/values, bottom-right causal, in float32."""
    n, length = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class FakeFA4(types.ModuleType):
    """A stand-in for ``flash_attn.cute``: records each call's arguments and computes what FA4 would from
    them (pages through ``page_table`` and ``seqused_k``, or contiguous keys through ``cu_seqlens_k``).
    ``wrong``: return zeros instead; ``fail``: raise."""

    def __init__(self, wrong: bool = False, fail: bool = False):
        super().__init__("flash_attn.cute")
        self.calls: list[dict] = []
        self.wrong, self.fail = wrong, fail

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
                               softmax_scale=None, causal=False, num_splits=1, **rest):
        self.calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                               page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                               num_splits=num_splits, rest=rest))
        if self.fail:
            raise RuntimeError("no kernel for this shape\nsecond line")
        out = torch.zeros_like(q)
        if self.wrong:
            return out, None
        starts = cu_seqlens_q.tolist()
        for i in range(len(starts) - 1):
            if page_table is not None:
                length, block = int(seqused_k[i]), k.shape[1]
                pages = page_table[i, :-(-length // block)].long()
                keys, values = (t[pages].reshape(-1, *t.shape[2:])[:length] for t in (k, v))
            else:
                k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
                keys, values = k[k0:k1], v[k0:k1]
            out[starts[i]:starts[i + 1]] = attend(q[starts[i]:starts[i + 1]], keys, values, softmax_scale,
                                                  causal).to(q.dtype)
        return out, None


SPEC = BatchSpec(query_lens=(3, 1, 4), context_lens=(10, 21, 0), num_heads=4, num_kv_heads=2, head_size=16,
                 block_size=4, dtype=torch.bfloat16)
WORKLOADS = [Workload("prefill", SPEC), Workload("decode", SPEC.replace(query_lens=(1, 1, 1)), memory_bound=True)]


def run(fake=None, layouts=("split", "nhd"), workloads_=WORKLOADS, **kwargs) -> list[dict]:
    return bench.run_engine_suite(["reference"], workloads_, CPU, layouts=layouts, fa4=fake, time_ms=host_ms,
                                  **kwargs)


def by_impl(rows: list[dict], workload: str) -> dict:
    return {r["impl"]: r for r in rows if r["workload"] == workload}


def test_each_row_is_timed_the_engines_way_and_the_classic_way_on_each_layout():
    rows = run()
    prefill = by_impl(rows, "prefill")
    assert list(prefill) == ["engine", "nhd", "split", "reference"]
    assert {k: (prefill[k]["call"], prefill[k]["layout"]) for k in ("engine", "nhd", "split")} == {
        "engine": ("engine", "nhd"), "nhd": ("classic", "nhd"), "split": ("classic", "split")}
    f = flops(SPEC)
    for label in ("engine", "nhd", "split"):
        row = prefill[label]
        assert row["within_tolerance"] and 0 < row["max_abs_err"] < 3e-2 and row["rel_l2"] < 1e-2, row
        assert row["tflops"] == pytest.approx(f / row["ms"] / 1e9) and "gbps" not in row
        assert row["kernel"] == "reference" and row["backend"] == "reference" and row["first_call_s"] >= 0
    assert "max_abs_err" not in prefill["reference"]  # the reference is what the others are checked against
    decode = by_impl(rows, "decode")
    for label in ("engine", "nhd", "split"):
        row = decode[label]
        assert row["memory_bound"] and row["gbps"] == pytest.approx(kv_bytes(WORKLOADS[1].spec) / row["ms"] / 1e6)


def test_the_split_layout_alone_has_no_engine_column():
    rows = run(layouts=("split",), with_reference=False)
    assert list(by_impl(rows, "prefill")) == ["split"]


def test_every_column_computes_the_same_attention():
    """Each column's output against one float32 reference: the engine's, the classic twins' and FA4's."""
    fake = FakeFA4()
    rows = run(fake)
    for workload in ("prefill", "decode"):
        errors = {k: r["max_abs_err"] for k, r in by_impl(rows, workload).items() if k != "reference"}
        assert set(errors) == {"engine", "nhd", "split", "fa4", "fa4 contig"}
        assert all(0 <= e < 3e-2 for e in errors.values()), errors


def test_an_fp8_query_reaches_both_drop_ins_with_its_descale():
    """The FP8 query row: both calls pass ``q_scale`` (the query's descale, not 1), so every column is within
    tolerance of the reference."""
    spec = SPEC.replace(kv_cache_dtype="fp8_e4m3", fp8_query=True)
    assert make_problem(spec).options.q_scale != 1.0
    rows = by_impl(run(workloads_=[Workload("fp8 query", spec)]), "fp8 query")
    for label in ("engine", "nhd", "split"):
        assert rows[label]["within_tolerance"] and rows[label]["rel_l2"] < 3e-2, (label, rows[label])


def test_fa4_receives_the_page_table_cu_seqlens_and_seqused_k_of_the_engine_problem():
    fake = FakeFA4()
    rows = run(fake, workloads_=WORKLOADS[:1], with_reference=False)
    engine = make_problem(SPEC.replace(kv_in_cache=True))  # the same seed: the problem the suite built
    b, cache = engine.batch, engine.cache
    paged = next(c for c in fake.calls if c["page_table"] is not None)
    contig = next(c for c in fake.calls if c["page_table"] is None)
    assert paged["page_table"].dtype == torch.int32 and paged["page_table"].is_contiguous()
    assert torch.equal(paged["page_table"], b.block_table) and paged["page_table"].shape == (3, b.block_table.shape[1])
    assert paged["seqused_k"].dtype == torch.int32 and paged["seqused_k"].tolist() == [13, 22, 4]
    assert paged["k"].shape == cache.key.shape == (cache.num_blocks, 4, 2, 16) and torch.equal(paged["k"], cache.key)
    assert paged["cu_seqlens_k"] is None
    for call in (paged, contig):
        assert call["cu_seqlens_q"].dtype == torch.int32 and call["cu_seqlens_q"].tolist() == [0, 3, 4, 8]
        assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (4, 22)
        assert call["causal"] is True and call["num_splits"] == 0 and call["softmax_scale"] == 16 ** -0.5
        assert torch.equal(call["q"], engine.q) and call["rest"] == {}
    assert contig["cu_seqlens_k"].dtype == torch.int32 and contig["cu_seqlens_k"].tolist() == [0, 13, 35, 39]
    assert contig["k"].shape == (39, 2, 16) and contig["seqused_k"] is None
    assert {r["impl"] for r in rows if "tflops" in r} == {"engine", "nhd", "split", "fa4", "fa4 contig"}


def test_a_wrong_peer_is_reported_and_not_timed():
    rows = run(FakeFA4(wrong=True), workloads_=WORKLOADS[:1])
    row = by_impl(rows, "prefill")["fa4"]
    assert row["status"] == "wrong output" and not row["within_tolerance"] and "ms" not in row
    assert row["max_abs_err"] > 0.1 and "against the float32 reference" in row["reason"]
    assert bench.progress_line(row).split()[:3] == ["fa4", "wrong", "output:"]
    line = next(t for t in bench.format_table(rows, show_status=True).splitlines() if t.startswith("| prefill |"))
    assert line.endswith("| wrong output | wrong output |"), line  # FA4 is wrong on both: neither is a figure


def test_a_failing_peer_is_reported_on_one_line():
    rows = run(FakeFA4(fail=True), workloads_=WORKLOADS[:1])
    row = by_impl(rows, "prefill")["fa4 contig"]
    assert row["status"] == "failed" and row["reason"] == "RuntimeError: no kernel for this shape"
    assert "tflops" in by_impl(rows, "prefill")["engine"]  # ours are still timed


def test_fa4_refuses_what_it_cannot_run_like_for_like():
    problem = make_problem(SPEC.replace(kv_in_cache=True, dtype=torch.float32, kv_cache_dtype="fp8_e4m3"))
    reason = fa4.unsupported(problem)
    assert "fp16 and bf16 only" in reason and "no FP8 cache" in reason
    assert fa4.unsupported(make_problem(SPEC.replace(kv_in_cache=True))) is None
    assert "k = v = None" in fa4.unsupported(make_problem(SPEC))


def test_an_option_the_drop_ins_do_not_share_is_refused_naming_the_workload():
    with pytest.raises(ValueError, match=r"workload 'w': the engine suite times plain causal attention.*sets alibi"):
        run(workloads_=[Workload("w", SPEC.replace(alibi=True))])


def test_load_names_the_module_or_says_why_it_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # an import of it raises ImportError
    module, line = fa4.load()
    assert module is None and line.startswith("FA4 columns absent: flash_attn.cute does not import (")
    assert "pip install flash-attn-4" in line
    fake = FakeFA4()
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    module, line = fa4.load()
    assert module is fake and line.startswith("FA4 columns: flash_attn.cute from flash-attn-4 ")


def test_the_command_writes_the_tables_and_json_of_the_engine_suite(monkeypatch, tmp_path, capsys):
    """The whole command, in-process on the CPU: tiny twins of the suite, the host clock, the FA4 stand-in."""
    import pagedprefill.device as device_module

    fake = FakeFA4()
    monkeypatch.setattr(device_module, "current_accelerator_type", lambda: "cpu")
    monkeypatch.setitem(workloads.SUITES, "engine", tiny_suite)
    monkeypatch.setattr(bench, "_median_ms", host_ms)
    monkeypatch.setattr(fa4, "load", lambda: (fake, "FA4 columns: flash_attn.cute from flash-attn-4 (stand-in)"))
    out_json = tmp_path / "engine.json"
    args = ["bench", "--suite", "engine", "--device", "cpu", "--backend", "reference", "--no-host-overhead",
            "--json", str(out_json), "--png", "", "--only", "decode 4x", "--only", "prefix-cached"]
    assert main(args) == 0
    printed = capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["meta"]["suite"] == "engine" and data["meta"]["peers"]["fa4"].endswith("(stand-in)")
    names = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    assert names == ["prefix-cached 8x(1024+7168)", "prefix-cached 8x(1024+7168) block 128",
                     "D64 32/32 heads prefix-cached", "D256 16/8 heads prefix-cached", "FP8 e4m3 KV prefix-cached",
                     "FP8 query e4m3 KV prefix-cached", "decode 4x ctx 128k"]
    fp8_query = by_impl(data["rows"], "FP8 query e4m3 KV prefix-cached")
    assert {"engine", "nhd", "split"} <= set(fp8_query)
    assert fp8_query["fa4"]["status"] == "not run" and "FP8" in fp8_query["fa4"]["reason"]  # none on this path
    decode = by_impl(data["rows"], "decode 4x ctx 128k")
    assert set(decode) == {"engine", "nhd", "split", "reference", "fa4", "fa4 contig"}
    assert all("gbps" in decode[k] for k in ("engine", "nhd", "split", "fa4", "fa4 contig"))
    assert "gbps" not in by_impl(data["rows"], "prefix-cached 8x(1024+7168)")["engine"]
    for line in ("[7/7] decode 4x ctx 128k", "FA4 columns: flash_attn.cute from flash-attn-4 (stand-in)"):
        assert line in printed.err
    for heading in ("TFLOP/s (median):", "GB/s of the K/V bytes each call must read",
                    "The engine's call over FA4 on the paged cache", "Largest absolute error against the float32"):
        assert heading in printed.out
    assert "| workload | engine / fa4 |" in printed.out
    assert "| workload | engine | nhd | split | reference | fa4 | fa4 contig |" in printed.out


def test_the_chart_has_a_gbps_panel_for_memory_bound_rows(tmp_path):
    rows = run(FakeFA4())
    panels = bench.chart_panels(rows)
    assert [p["ylabel"] for p in panels] == ["TFLOP/s", "GB/s of K/V read"]
    assert panels[0]["workloads"] == ["prefill"] and panels[1]["workloads"] == ["decode"]
    assert panels[1]["impls"] == ["engine", "nhd", "split", "fa4", "fa4 contig"]  # no reference bar
    assert panels[1]["values"]["engine"] == [by_impl(rows, "decode")["engine"]["gbps"]]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the panels are checked, the drawing is not")
    path = tmp_path / "engine.png"
    assert bench.plot(rows, str(path), "engine") == str(path) and path.stat().st_size > 0


def test_the_default_suites_chart_is_one_tflops_panel():
    rows = [{"workload": "w", "impl": "sm80 nhd", "tflops": 1.0}, {"workload": "w", "impl": "reference", "tflops": 0.1}]
    panels = bench.chart_panels(rows)
    assert len(panels) == 1 and panels[0]["impls"] == ["sm80 nhd"] and panels[0]["values"] == {"sm80 nhd": [1.0]}


def test_the_suite_lists_without_allocating(monkeypatch, capsys):
    def no_problem(*args, **kwargs):
        raise AssertionError("--list built a problem")

    monkeypatch.setattr(workloads, "make_problem", no_problem)
    monkeypatch.setattr(bench, "make_problem", no_problem)
    assert main(["bench", "--suite", "engine", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(workloads.engine_suite())
    assert lines[-4] == "| decode 4x ctx 128k | 4 | 4 | 131072 | 32/8 | 128 | 16 | bfloat16 | 0.009 | 2148 | yes |"
    assert ("| prefix-cached 8x(1024+7168) block 128 | 8 | 8192 | 7168 | 32/8 | 128 | 128 | bfloat16 | 1.031 | 268 "
            "|  |") in lines


def test_an_only_that_matches_nothing_is_an_error_naming_the_argument(capsys):
    assert main(["bench", "--suite", "engine", "--only", "nothing", "--list"]) == 2
    assert "argument --only: no workload of the engine suite has a name containing 'nothing'" in capsys.readouterr().err


GENERIC_SCRIPT = """
import time, torch
from pagedprefill.cli.bench import run_engine_suite
from pagedprefill.workloads import BatchSpec, Workload
spec = BatchSpec(query_lens=(3, 1), context_lens=(5, 9), num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
                 dtype=torch.float16)
def host_ms(run, reps):
    started = time.perf_counter(); run(); return (time.perf_counter() - started) * 1e3
rows = run_engine_suite(["generic"], [Workload("w", spec)], torch.device("cpu"), with_reference=False,
                        time_ms=host_ms)
for r in rows:
    print(r["impl"], r["kernel"], r["within_tolerance"], r["max_abs_err"])
"""


def test_the_generic_backend_runs_both_calls_in_the_interpreter():
    proc = run_interpreted(GENERIC_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [r[:3] for r in rows] == [["engine", "portable", "True"], ["nhd", "portable", "True"],
                                     ["split", "portable", "True"]]
    assert all(float(r[3]) < 4e-3 for r in rows)


def test_a_form_a_backend_refuses_is_a_row_that_says_why(monkeypatch):
    from pagedprefill.errors import UnsupportedFeatureError

    real = bench.check_runnable

    def no_split(backend, problem, info):
        if problem.cache.layout.value == "split":
            raise UnsupportedFeatureError("the split layout is not built here")
        real(backend, problem, info)

    monkeypatch.setattr(bench, "check_runnable", no_split)
    rows = run(workloads_=WORKLOADS[:1], with_reference=False)
    split = by_impl(rows, "prefill")["split"]
    assert split["status"] == "not run" and "the split layout is not built here" in split["reason"]
    assert "ms" not in split and "tflops" in by_impl(rows, "prefill")["nhd"]


def test_a_backend_that_cannot_run_on_the_device_is_named_with_its_reasons():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the generic backend can run on the CPU here")
    pytest.importorskip("pagedprefill_generic", reason="pagedprefill-generic is not installed")
    said = []
    rows = bench.run_engine_suite(["generic", "reference"], WORKLOADS[:1], CPU, with_reference=False,
                                  progress=said.append, time_ms=host_ms)
    assert any(line.startswith("generic: not run on ") and "TRITON_INTERPRET=1" in line for line in said), said
    assert {r["backend"] for r in rows} == {"reference"}
    assert [r["impl"] for r in rows] == ["engine", "nhd", "split"]  # one backend runs: its name is not repeated


@pytest.mark.parametrize(("capability", "expected"), [((9, 0), 1), ((10, 0), 0), ((8, 0), 0)])
def test_fa4_splits_no_keys_on_sm90_and_lets_its_heuristic_choose_elsewhere(monkeypatch, capability, expected):
    # FA4's sm90 kernels raise on any split its heuristic picks: the peer is timed unsplit there.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fa4.num_splits(torch.device("cuda", 0)) == expected
    assert fa4.num_splits(torch.device("cpu")) == 0


def test_every_column_of_a_workload_is_timed_in_alternating_rounds():
    order = []

    def time_ms(run, reps):
        order.append(run)
        return float(len(order))

    rows = bench.run_engine_suite(["reference"], WORKLOADS[:1], CPU, layouts=("split", "nhd"), time_ms=time_ms,
                                  rounds=3)
    timed = [r for r in rows if "ms" in r]
    assert [r["impl"] for r in timed] == ["engine", "nhd", "split", "reference"]
    runs = len(timed)
    assert len(order) == 3 * runs
    assert order[:runs] == list(reversed(order[runs:2 * runs])) == order[2 * runs:]  # forwards, back, forwards
    for r in timed:
        assert len(r["rounds_ms"]) == 3 and r["ms"] == sorted(r["rounds_ms"])[1]


def test_the_models_suite_lists_each_shard_as_a_prefix_cached_a_chunked_and_a_decode_row(capsys):
    assert main(["bench", "--suite", "models", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    suite = workloads.models_suite()
    assert len(lines) == 2 + len(suite) == 2 + 3 * len(workloads.model_shards())
    assert len({w.name for w in suite}) == len(suite)
    assert any(line.startswith("| Llama-3-70B TP8 8/1 D128 prefix-cached") and "| 8/1 | 128 |" in line
               for line in lines)
    assert any(line.startswith("| Falcon-7B TP1 71/1 D64 decode 128x ctx 2k") and line.endswith("| yes |")
               for line in lines)
    groups = {w.spec.num_heads // w.spec.num_kv_heads for w in suite}
    assert set(range(1, 9)) <= groups and max(groups) == 71


def test_a_model_shards_its_kv_heads_until_each_gpu_holds_one():
    llama70 = workloads.ModelHeads("Llama-3-70B", 64, 8, 128)
    assert [llama70.per_gpu(tp) for tp in (1, 2, 4, 8)] == [(64, 8), (32, 4), (16, 2), (8, 1)]
    assert workloads.ModelHeads("Qwen2.5-7B", 28, 4, 128).per_gpu(4) == (7, 1)
    with pytest.raises(ValueError, match="tp: Falcon-7B's 71 query heads do not divide among 2 GPUs"):
        workloads.ModelHeads("Falcon-7B", 71, 1, 64).per_gpu(2)
