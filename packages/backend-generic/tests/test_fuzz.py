"""Fuzzing the generic backend against the reference in Triton's CPU interpreter (tiny random batches over the
full ranges: see :mod:`pagedprefill.testing.fuzz`). The GPU fuzz runs in ``packages/core/tests/gpu``."""

import dataclasses

import pytest
import torch
from pagedprefill import DeviceInfo, get_registry
from pagedprefill.backends.reference import ReferenceBackend
from pagedprefill.device import interpreter_enabled
from pagedprefill.testing.fuzz import (
    GPU_HEAD_SIZES,
    FuzzGenerator,
    FuzzResult,
    FuzzSizes,
    ProgressPrinter,
    first_case_of_each_key,
    kernel_variant_key,
    parse_shard,
    precompile,
    rerun_command,
    run_case,
    run_fuzz,
    shard_cases,
)
from pagedprefill.types import FEATURES

#: Cases of the CPU run: about 75 s on two cores (the interpreter's cost grows with heads times tokens).
CPU_CASES = 300


def test_fuzz_matches_reference_in_the_interpreter(pagedprefill_device, terminal_line):
    if pagedprefill_device.type != "cpu":
        pytest.skip("the CPU fuzz runs in Triton's interpreter; on GPUs: pytest packages/core/tests/gpu "
                    "(nox -s production) or python -m pagedprefill.testing.fuzz --backend generic --device cuda")
    reasons = get_registry().get("generic").supports(DeviceInfo.detect(pagedprefill_device))
    if reasons:
        pytest.skip(f"the generic backend cannot run on the CPU here: {'; '.join(reasons)}")
    result = run_fuzz("generic", pagedprefill_device, cases=CPU_CASES, seed=0, sizes=FuzzSizes.cpu(),
                      progress=ProgressPrinter(CPU_CASES, terminal_line, every_s=30))
    print(f"\n{result.details()}\n{result.summary()}")
    assert result.cases == CPU_CASES
    assert result.unsupported == 0
    assert result.kernel_variants > CPU_CASES // 2  # nearly every case is a new shape/feature combination
    assert not result.failures, "\n".join(f.one_line() for f in result.failures)


def _specs(sizes, n, seed=7, features=FEATURES):
    generator = FuzzGenerator(seed, sizes, features)
    return [generator.next_spec() for _ in range(n)]


@pytest.mark.parametrize("sizes, n", [(FuzzSizes.cpu(), 1500), (FuzzSizes.gpu(), 3000)], ids=["cpu", "gpu"])
def test_fuzz_streams_cover_the_ranges_and_bound_gpu_specialisations(sizes, n):
    """The case streams themselves (no kernel runs): reproducible from the seed and from each case's index alone,
    reaching the ends of every range and every optional feature, and the GPU stream launching at most ``keys``
    kernel specialisations however long it runs."""
    specs = _specs(sizes, n)
    assert specs == _specs(sizes, n)
    assert [FuzzGenerator(7, sizes).spec(i) for i in (0, 1, n // 2, n - 1)] == [specs[i] for i in (0, 1, n // 2, n - 1)]
    qlens = {q for s in specs for q in s.query_lens}
    clens = {c for s in specs for c in s.context_lens}
    assert {0, 1} <= qlens and 0 in clens
    assert max(clens) > 64  # contexts span several key tiles
    assert any(not s.query_lens or not sum(s.query_lens) for s in specs)  # empty batches
    if sizes.keys is None:  # the GPU stream holds 24 keys: the ends of the ranges are among its first five
        assert {1, 544} <= {s.block_size for s in specs}
        assert {1, 256} <= {s.head_size for s in specs}
    assert {1, 64} <= {s.num_heads // s.num_kv_heads for s in specs}
    assert max(s.num_heads for s in specs) <= sizes.max_heads
    assert 1 in {s.sliding_window for s in specs}
    assert {"fp8_e4m3", "fp8_e5m2", "auto"} == {s.kv_cache_dtype for s in specs}
    assert {"nhd", "split"} == {s.layout for s in specs}
    assert any(s.x is not None for s in specs)
    assert set(sizes.dtypes) == {s.dtype for s in specs}
    for flag in ("alibi", "sinks", "scale_as_tensor", "causal", "skip_decode", "kv_in_cache", "fp8_query"):
        assert {True, False} == {getattr(s, flag) for s in specs}, flag
    assert any(s.fp8_out_scale for s in specs) and any(s.fp8_out_scale is None for s in specs)
    assert any(s.softcap for s in specs) and any(s.sm_scale for s in specs)
    assert {"B", "B+1"} == {s.start_loc_entries for s in specs}
    variants = {kernel_variant_key(s) for s in specs} - {None}
    if sizes.keys is None:
        assert len(variants) > n // 2
    else:
        assert len(variants) <= sizes.keys
        assert {s.head_size for s in specs} <= set(GPU_HEAD_SIZES)
        assert any(min(s.query_lens) > 256 for s in specs if s.query_lens)  # "long" workloads too
    print(f"{n} specs: {len(variants)} kernel variants, {len({s.head_size for s in specs})} head sizes, "
          f"{len({s.block_size for s in specs})} block sizes")


def test_fuzz_draws_only_the_features_a_backend_supports():
    without_fp8_out = FEATURES - {"fp8_out_scale"}
    for sizes in (FuzzSizes.cpu(), FuzzSizes.gpu()):
        specs = _specs(sizes, 600, features=without_fp8_out)
        assert all(s.fp8_out_scale is None for s in specs)
        assert any(s.kv_in_cache for s in specs)
        plain = _specs(sizes, 600, features=frozenset())
        assert not any(s.kv_in_cache or s.skip_decode or not s.causal or s.fp8_out_scale or s.fp8_query
                       for s in plain)
        # Without FP8 queries (sm80, bi100) a stream is what it would be had the feature never been drawn: the
        # same cases, all with 16-bit queries.
        without_fp8_query = _specs(sizes, 600, features=FEATURES - {"fp8_query"})
        drawn = _specs(sizes, 600)
        assert not any(s.fp8_query for s in without_fp8_query) and any(s.fp8_query for s in drawn)
        if sizes.keys is not None:  # a key's own draws come first: the keys differ only in the query's type
            assert [s.replace(fp8_query=False) for s in drawn] == without_fp8_query


class _OffByALittle(ReferenceBackend):
    """The reference with every written element moved by 0.05: the fuzz must report each case it wrote."""

    name = "off_by_a_little"

    def run(self, problem, device):
        super().run(problem, device)
        problem.out.copy_(problem.out.float() + 0.05)  # FP8 outputs too


def test_fuzz_reports_every_wrong_case_with_a_rerun_that_repeats_it():
    n = 40
    sizes = FuzzSizes.cpu()
    result = run_fuzz(_OffByALittle(), "cpu", cases=n, seed=3, sizes=sizes)
    generator = FuzzGenerator(3, sizes, _OffByALittle.supported_features)
    written = []
    for i in range(n):
        spec = generator.spec(i)
        rows = [q for q in spec.query_lens if q > 1 or (q == 1 and not spec.skip_decode)]
        if rows:
            written.append(i)
    assert result.cases == n
    assert [f.index for f in result.failures] == written
    for failure in result.failures:
        assert failure.rerun == rerun_command("off_by_a_little", torch.device("cpu"), sizes, 3, failure.index)
        assert failure.rerun.endswith(f"--mode cpu --seed 3 --case {failure.index}")
        assert "\n" not in failure.one_line() and failure.rerun in failure.one_line()
    assert result.summary() == f"fuzz: {n} cases, {len(written)} failures"
    again = run_fuzz(_OffByALittle(), "cpu", seed=3, sizes=sizes, only=[written[-1]])
    assert [f.index for f in again.failures] == [written[-1]] and again.failures[0].spec == result.failures[-1].spec


def test_shards_share_a_run_and_report_its_failures_with_its_reproducers():
    n, shards = 40, 3
    sizes = FuzzSizes.cpu()
    whole = run_fuzz(_OffByALittle(), "cpu", cases=n, seed=3, sizes=sizes)
    parts = [shard_cases(n, parse_shard(f"{k}/{shards}")) for k in range(shards)]
    assert sorted(i for part in parts for i in part) == list(range(n))
    results = [run_fuzz(_OffByALittle(), "cpu", cases=n, seed=3, sizes=sizes, only=part) for part in parts]
    assert sum(r.cases for r in results) == n
    assert sorted((f.index, f.rerun) for r in results for f in r.failures) == \
        [(f.index, f.rerun) for f in whole.failures]
    assert whole.failures


@pytest.mark.parametrize("bad", ["4/4", "-1/2", "1", "a/b", "0/0"])
def test_a_malformed_shard_is_refused_with_what_was_given(bad):
    with pytest.raises(ValueError, match=f"K/N with 0 <= K < N.*{bad!r}"):
        parse_shard(bad)


def test_progress_lines_come_at_least_every_interval():
    lines = []
    printer = ProgressPrinter(5, lines.append, every_s=0.0)
    run_fuzz(_OffByALittle(), "cpu", cases=5, seed=3, sizes=FuzzSizes.cpu(), progress=printer)
    progress = [line for line in lines if line.startswith("fuzz: ")]
    assert len(progress) == 5 and progress[-1].startswith("fuzz: 5/5 cases")
    assert any(line.startswith("FAIL case ") and "--case" in line for line in lines)


def test_progress_lines_keep_coming_while_a_case_runs_long():
    """A case longer than the interval (a kernel compiling on a GPU) still gets progress lines, from the
    printer's background thread."""
    import time as clock

    lines = []
    with ProgressPrinter(2, lines.append, every_s=0.2) as printer:
        clock.sleep(0.7)  # the first case, running long
        printer(1, FuzzResult(backend="x", device="cpu", seed=0, cases=1))
    running = [line for line in lines if "still running" in line]
    assert len(running) >= 2 and running[0].startswith("fuzz: 0/2 cases, case 0 still running")


def test_heartbeat_says_still_running_only_when_no_case_finished():
    """Between two cases that each finish quickly the heartbeat gives the progress line, not "still running"."""
    import time as clock

    lines = []
    with ProgressPrinter(100, lines.append, every_s=1.0) as printer:
        for done in range(1, 91):  # a case every 0.04 s for 3.6 s: only a 1 s stall would be "still running"
            clock.sleep(0.04)
            printer(done, FuzzResult(backend="x", device="cpu", seed=0, cases=done))
    assert not any("still running" in line for line in lines), lines
    assert len([line for line in lines if "/100 cases, 0 failures" in line]) >= 3, lines


def test_heartbeat_names_the_activity_before_the_first_case():
    """While the kernels compile before the run (:func:`precompile`), the heartbeat says so, not "case 0"."""
    import time as clock

    lines = []
    with ProgressPrinter(2, lines.append, every_s=0.2) as printer:
        printer.activity = "compiling the compile keys' kernels in 3 processes"
        clock.sleep(0.7)
        printer.activity = ""
    assert any(line.startswith("fuzz: compiling the compile keys' kernels in 3 processes, ") for line in lines)
    assert not any("still running" in line for line in lines[:2])


def test_first_case_of_each_key_covers_the_menu_with_cases_that_launch():
    sizes = FuzzSizes.gpu()
    generator = FuzzGenerator(0, sizes, FEATURES)
    first = first_case_of_each_key(0, sizes, 2000)
    assert len(first) == sizes.keys
    assert sorted(index % sizes.keys for index in first) == list(range(sizes.keys))
    for index in first:
        assert kernel_variant_key(generator.spec(index)) is not None
        earlier = range(index % sizes.keys, index, sizes.keys)  # the key's cases before it launch nothing
        assert all(kernel_variant_key(generator.spec(i)) is None for i in earlier)
    assert first_case_of_each_key(0, FuzzSizes.cpu(), 100) == []  # a new key per case: nothing to warm


def test_precompile_runs_each_key_once_in_worker_processes(pagedprefill_device):
    """The processes run the fuzz's own command line on their share of the keys; none fails on valid cases.
    (On a GPU they fill Triton's on-disk cache; here, in the interpreter, they only run the cases.)"""
    if pagedprefill_device.type != "cpu" or not interpreter_enabled():
        pytest.skip("runs the worker processes in the interpreter; the GPU fuzz runs them on the GPU")
    sizes = dataclasses.replace(FuzzSizes.cpu(), keys=3, max_heads=4)
    result = precompile("generic", "cpu", sizes, seed=5, cases=30, workers=2, timeout_s=300,
                        features=get_registry().get("generic").supported_features)
    assert (result.keys, result.workers, result.failed) == (3, 2, []), result.summary()
    assert result.seconds > 0 and "3 compile keys in 2 processes" in result.summary()
    broken = precompile("no-such-backend", "cpu", sizes, seed=5, cases=30, workers=1, timeout_s=300)
    assert len(broken.failed) == 1 and "exit status" in broken.failed[0], broken.summary()


def test_gpu_fuzz_case_840_small_fp8_output_scale(pagedprefill_device):
    """Case 840 of the GPU fuzz (seed 0: fp16, head size 256, an FP8 cache and an FP8 output with scale 0.0083)
    once failed on the H200 by 3 of 1.4 million elements: the output is ``attention / scale``, so the
    attention's own fp16 rounding, magnified 120 times, exceeded a tolerance that did not scale with it. The
    same case on the interpreter showed the same 3 elements; it passes with the tolerance scaled."""
    if pagedprefill_device.type != "cpu" or not interpreter_enabled():
        pytest.skip("the interpreter's copy of a GPU fuzz case (the GPU fuzz runs the case itself)")
    backend = get_registry().get("generic")
    # The GPU preset's head sizes of that run (96 joined them since): the same stream, so the same case 840.
    sizes = dataclasses.replace(FuzzSizes.preset("gpu"), head_sizes=(1, 24, 64, 80, 128, 256))
    spec = FuzzGenerator(0, sizes, backend.supported_features).spec(840)
    assert spec.fp8_out_scale is not None and spec.fp8_out_scale < 0.01 and spec.head_size == 256
    info = DeviceInfo.detect(pagedprefill_device)
    assert run_case(backend, info, pagedprefill_device, spec, label="gpu-fuzz/840")


@pytest.mark.parametrize("base", [FuzzSizes.cpu(), FuzzSizes.gpu()], ids=["cpu", "gpu"])
def test_engine_fuzz_draws_the_engines_call_on_pages_of_16_and_up_with_mixed_rows(base):
    sizes = base.engine_mode()
    specs = _specs(sizes, 1500)
    batches = [s for s in specs if any(s.query_lens)]
    assert all(s.kv_in_cache for s in specs)
    assert all(16 <= s.block_size <= 544 for s in specs)
    assert {16, 128, 544} <= {s.block_size for s in specs} and {"nhd", "split"} <= {s.layout for s in specs}
    assert {"auto", "fp8_e4m3", "fp8_e5m2"} <= {str(s.kv_cache_dtype) for s in specs}
    lens = [q for s in batches for q in s.query_lens]
    assert 1 in lens and any(2 <= q <= 8 for q in lens) and any(q > 8 for q in lens)
    mixed = [s for s in batches if 1 in s.query_lens and any(q > 1 for q in s.query_lens)]
    assert len(mixed) > len(batches) // 10  # decode rows beside longer ones in one batch
    assert "--engine" in sizes.cli_args() and "--engine" not in base.cli_args()
    # A reproducer rebuilds the same stream.
    assert rerun_command("generic", torch.device("cpu"), sizes, 0, 3).count("--engine") == 1
