"""The conformance suite's own behaviour, as a third-party backend meets it: declared exclusions of cache
dtypes skip every case with such a cache, and skip reasons name the backend, not this repository's tools."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from pagedprefill.testing import CASES, ConformanceSuite, case_spec, random_spec

CPU = torch.device("cpu")
FP8_CASES = {name for name, changes in CASES.items() if changes.get("kv_cache_dtype", "auto") != "auto"}


class NoFp8(ConformanceSuite):
    backend = "reference"
    excluded_kv_cache_dtypes = {"fp8": "no FP8 here (e4m3)", "fp8_e5m2": "no FP8 here (e5m2)"}


def test_fp8_cases_are_the_ones_a_by_name_exclusion_would_miss():
    """More cases than `fp8_e4m3` use an FP8 cache: excluding by name alone is not enough."""
    assert FP8_CASES >= {"fp8_e4m3", "fp8_e5m2", "fp8_split_tensor_scales", "block_size_32_split_fp8"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_excluded_cache_dtypes_skip_exactly_the_cases_with_that_cache(case):
    spec = case_spec(case)
    reason = NoFp8()._skip_reason(spec, CPU, case)
    if case in FP8_CASES:
        assert reason is not None and reason.startswith("excluded for backend 'reference' (kv_cache_dtype="), reason
        assert "no FP8 here" in reason
    else:
        assert reason is None, reason


def test_excluded_cache_dtypes_apply_to_the_random_sweep():
    specs = [random_spec(1000 + seed) for seed in range(60)]
    assert any(s.kv_cache_dtype != "auto" for s in specs) and any(s.kv_cache_dtype == "auto" for s in specs)
    for spec in specs:
        skipped = NoFp8()._skip_reason(spec, CPU) is not None
        assert skipped == (spec.kv_cache_dtype != "auto"), spec.describe()


SWEEP_DTYPES = (torch.float16, torch.float32)


def test_the_sweep_draws_no_excluded_cache_dtype():
    """A backend without FP8 caches has every sweep case computed, none skipped for its cache."""
    specs = [NoFp8().sweep_spec(1000 + seed, "small", SWEEP_DTYPES) for seed in range(60)]
    assert all(spec.kv_cache_dtype == "auto" for spec in specs)
    assert all(NoFp8()._skip_reason(spec, CPU) is None for spec in specs)
    assert len({spec.describe() for spec in specs}) == len(specs)


def test_the_sweep_draws_only_the_features_the_backend_runs(monkeypatch):
    from pagedprefill import get_registry
    from pagedprefill.features import missing_features
    from pagedprefill.testing import make_problem

    monkeypatch.setattr(get_registry().get("reference"), "supported_features", frozenset({"skip_decode"}))
    specs = [ConformanceSuite().sweep_spec(1000 + seed, "small", SWEEP_DTYPES) for seed in range(80)]
    assert any(spec.skip_decode for spec in specs)
    for spec in specs:
        assert spec.causal and not spec.kv_in_cache and spec.fp8_out_scale is None, spec.describe()
        assert not missing_features(get_registry().get("reference"), make_problem(spec, CPU))


def test_a_backend_that_runs_everything_sweeps_the_shared_cases():
    assert [ConformanceSuite().sweep_spec(1000 + seed, "small", SWEEP_DTYPES) for seed in range(40)] == \
        [random_spec(1000 + seed, "small", SWEEP_DTYPES) for seed in range(40)]


def test_the_model_heads_sweep_draws_the_heads_models_run_beside_every_option():
    """Its cases take head sizes and groups from what models run, every one of them drawn within 200 seeds, with
    the options of the default draw (the default sweep's own cases are unchanged: the test above)."""
    from pagedprefill.testing.cases import MODEL_GROUPS, MODEL_HEAD_SIZES

    specs = [ConformanceSuite().model_heads_spec(5000 + seed, "small", SWEEP_DTYPES) for seed in range(200)]
    assert {spec.head_size for spec in specs} == set(MODEL_HEAD_SIZES)
    assert {spec.num_heads // spec.num_kv_heads for spec in specs} == set(MODEL_GROUPS)
    for option in ("alibi", "sinks", "kv_in_cache"):
        assert {getattr(spec, option) for spec in specs if spec.head_size in (80, 96, 256)} == {True, False}, option
    assert {spec.layout for spec in specs if spec.head_size in (80, 96, 256)} == {"nhd", "split"}
    assert {spec.kv_cache_dtype for spec in specs if spec.head_size == 256} >= {"auto", "fp8_e4m3"}


def test_a_sweep_case_beyond_a_backends_limits_is_skipped_with_its_refusal(monkeypatch):
    """A random case the backend's ``check_problem`` refuses (a float32 head too wide for the device's shared
    memory) is counted as skipped with the backend's words, not failed; one it takes is not."""
    from pagedprefill import get_registry
    from pagedprefill.errors import UnsupportedFeatureError
    from pagedprefill.testing import make_problem

    def check_problem(problem, device):
        if problem.head_size > 128:
            raise UnsupportedFeatureError("head_size 256 needs more shared memory than this device has")

    monkeypatch.setattr(get_registry().get("reference"), "check_problem", check_problem)
    suite = ConformanceSuite()
    wide = make_problem(case_spec("head_size_256", "small", 0), CPU)
    assert suite._beyond_limits(wide, CPU) == \
        "beyond the backend's limits: head_size 256 needs more shared memory than this device has"
    assert suite._beyond_limits(make_problem(case_spec("head_size_96", "small", 0), CPU), CPU) is None


def test_a_sweep_part_runs_every_case_and_names_each_one_that_fails():
    """A wrong answer on some cases of a part does not stop the part: each failing case is said on the terminal
    as it fails (a run cut by its time limit keeps it), the others are still checked, and the part fails naming
    every failing seed."""
    wrong_seeds = {1000 + 3, 1000 + 11}

    class WrongOnSome(ConformanceSuite):
        backend = "reference"

        def _check(self, spec, device, label):
            self.seed = spec.seed
            super()._check(spec, device, label)

        def run_backend(self, problem, device):
            out = super().run_backend(problem, device)
            return out + 1.0 if self.seed in wrong_seeds else out

    lines, suite = [], WrongOnSome()
    with pytest.raises(pytest.fail.Exception) as failed:
        suite._sweep("sweep", 1000, suite.sweep_spec, 3, 16, CPU, "small", lines.append)
    said = [line for line in lines if line.startswith("FAILED ")]
    assert [re.search(r"seed=(\d+)", line).group(1) for line in said] == ["1003", "1011"]
    assert "2 of 2 cases of part 3 of the sweep failed" in str(failed.value)
    assert all(f"seed={seed}" in str(failed.value) for seed in wrong_seeds)
    assert lines[-1].startswith("reference sweep part 3: 2 of 2 random cases checked against the reference, 2 failed")


def test_only_the_declared_cache_dtype_is_excluded():
    class NoE5m2(ConformanceSuite):
        backend = "reference"
        excluded_kv_cache_dtypes = {"fp8_e5m2": "no e5m2"}

    skipped = {case for case in CASES if NoE5m2()._skip_reason(case_spec(case), CPU, case)}
    assert skipped == {"fp8_e5m2", "split_x_2_fp8_e5m2", "fp8_query_fp8_e5m2_alibi_sinks"}


def test_a_misspelt_cache_dtype_is_an_error():
    class Misspelt(ConformanceSuite):
        backend = "reference"
        excluded_kv_cache_dtypes = {"fp8_e3m4": "typo"}

    with pytest.raises(ValueError, match=r"^kv_cache_dtype: expected one of .*, got 'fp8_e3m4'$"):
        Misspelt()._skip_reason(case_spec("basic"), CPU, "basic")


THIRD_PARTY_TESTS = '''
from pagedprefill.testing import ConformanceSuite


class TestThirdParty(ConformanceSuite):
    backend = "reference"
    excluded_kv_cache_dtypes = {"fp8_e4m3": "no FP8 on this hardware", "fp8_e5m2": "no FP8 on this hardware"}
'''


def test_skip_reasons_seen_by_a_third_party_backend(tmp_path):
    """Run the suite as another package would (its own directory, pytest -rs): FP8 cases are skipped with the
    declared reason, and the GPU-only test names the backend, not sessions of this repository."""
    (tmp_path / "test_third_party.py").write_text(textwrap.dedent(THIRD_PARTY_TESTS))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--pagedprefill-device=cpu",
         "-k", "(test_case_matches_reference and fp8) or offsets", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(rf"\b{len(FP8_CASES) + 1} skipped\b", out), out
    excluded = re.findall(r"SKIPPED \[(\d+)\] .*: excluded for backend 'reference' \(kv_cache_dtype='fp8\w*'\): "
                          r"no FP8 on this hardware", out)
    assert sum(int(n) for n in excluded) == len(FP8_CASES), out
    assert "needs a ~9 GB cache: run the conformance tests of backend 'reference' on a GPU" in out, out
    assert "''s" not in out, out
    assert "nox" not in out, out


def test_seeds_option_checks_only_the_named_sweep_cases(tmp_path):
    """``--pagedprefill-seeds`` (the seed a failing case names) checks those cases of the sweeps and skips the
    parts without one; a malformed list is a usage error naming the option."""
    (tmp_path / "test_third_party.py").write_text(textwrap.dedent(THIRD_PARTY_TESTS))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TRITON_INTERPRET")}

    def pytest_run(*args):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", "--pagedprefill-device=cpu",
             "-k", "random_sweep", *args, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env,
            timeout=300)

    proc = pytest_run("--pagedprefill-seeds=1003,1005")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b2 passed, 6 skipped\b", out), out
    assert len(re.findall(r"reference sweep part [35]: 1 of 1 random cases checked", out)) == 2, out
    assert "--pagedprefill-seeds names no case of part 0 of the sweep" in out, out
    proc = pytest_run("--pagedprefill-seeds=seed=1003")
    assert proc.returncode != 0
    assert "--pagedprefill-seeds: expected seeds separated by commas (e.g. 5027,1003), got 'seed=1003'" in \
        proc.stdout + proc.stderr


FAILING_TESTS = '''
def test_passes():
    pass


def test_fails():
    assert 1 + 1 == 3, "the failure's own words"
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_failures_now_prints_each_failure_when_it_happens(tmp_path, workers):
    """``--pagedprefill-failures-now``: a failing test's report comes on the terminal as the test fails (with
    pytest-xdist, from the controller, to which the workers send their reports), before pytest's summary at the
    end, which a run cut by a time limit never reaches."""
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    (tmp_path / "test_failing.py").write_text(FAILING_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *workers, "--pagedprefill-failures-now",
         str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out
    now = out.index("FAILED test_failing.py::test_fails (call):")
    assert "the failure's own words" in out[now:out.index("= FAILURES =")], out
    assert out.count("FAILED test_failing.py::test_passes") == 0, out


def test_a_refused_feature_is_skipped_with_the_refusal_said_once(monkeypatch):
    """A backend that leaves a feature out of supported_features: the case is skipped with the refusal's
    own words, which name the backend and the feature once each."""
    from types import SimpleNamespace

    from pagedprefill.backends.reference import ReferenceBackend
    from pagedprefill.testing import conformance

    class NoFp8Out(ReferenceBackend):
        name = "nofp8out"
        supported_features = ReferenceBackend.supported_features - {"fp8_out_scale"}

    monkeypatch.setattr(conformance, "get_registry", lambda: SimpleNamespace(get=lambda name: NoFp8Out()))
    suite = type("Suite", (ConformanceSuite,), {"backend": "nofp8out"})()
    spec = case_spec("fp8_out", "small", 0)
    with pytest.raises(pytest.skip.Exception) as skipped:
        suite._check(spec, torch.device("cpu"), "nofp8out/case")
    reason = str(skipped.value)
    assert reason.startswith("refused, as its supported_features declare: backend 'nofp8out' does not support ")
    assert reason.count("nofp8out") == 1 and reason.count("fp8_out_scale") == 1, reason
