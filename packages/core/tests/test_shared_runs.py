"""The runs the backends' conformance suites share in Triton's interpreter (pagedprefill.testing.shared_runs): a
case two backends run with the same kernel and tile is run by one suite only, the first of SHARED_SUITES; a case
whose tiles differ runs in each; the smoke cases run everywhere; on a GPU, or without the interpreter, nothing
is shared; and the (case, kernel, tile) combinations run are the same as without sharing. Nothing here runs a
kernel: the suites decide from the policies' tiles."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from pagedprefill import get_registry
from pagedprefill.testing.cases import CASES, MULTI_TILE_CASES, SPLIT_KEY_CASES, SPLIT_KEY_COUNTS
from pagedprefill.testing.conformance import (
    CASE_TEST,
    MULTI_TILE_TEST,
    SPLIT_KEYS_TEST,
    ConformanceSuite,
    shared_suite,
)
from pagedprefill.testing.shared_runs import (
    INTERPRETED_TILE_FIELDS,
    SHARED_SUITES,
    SMOKE_CASES,
    interpreted_tile,
    interpreter_device,
)
from pagedprefill.tiling import TileConfig

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "ci" / "interpreter_runs.py"

for _name in SHARED_SUITES:
    pytest.importorskip(f"pagedprefill_{_name}", reason=f"the {_name} backend is not installed")

#: Every case of the shared tests: (test, case, splits).
ITEMS = ([(CASE_TEST, case, None) for case in sorted(CASES)]
         + [(MULTI_TILE_TEST, case, None) for case in sorted(MULTI_TILE_CASES)]
         + [(SPLIT_KEYS_TEST, case, splits) for case in sorted(SPLIT_KEY_CASES) for splits in SPLIT_KEY_COUNTS])


@pytest.fixture
def interpreter(monkeypatch):
    """The suites decide as under ``TRITON_INTERPRET=1`` (they only compute tiles here: no kernel runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def owners(name: str, items=ITEMS) -> dict:
    """``{(test, case, splits): owner or None}`` of the suite of backend ``name`` as the others see it."""
    suite = shared_suite(name)
    out = {}
    for test, case, splits in items:
        shared = suite.shared_owner(test, case, CPU, "small", splits)
        out[(test, case, splits)] = None if shared is None else shared[0]
    return out


def suite_classes(path: Path, backend: str) -> list[str]:
    """The test classes of ``path`` that set ``backend = "<backend>"`` and whose device the interpreter runs (not
    sm80's Hopper class), read from the source."""
    tree = ast.parse(path.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test")
            and "Hopper" not in node.name
            and any(isinstance(stmt, ast.Assign) and ast.unparse(stmt) == f"backend = {backend!r}"
                    for stmt in node.body)]


@pytest.fixture(scope="module")
def shared_pair() -> tuple[tuple, str, str]:
    """A case and two backends whose suites run it alike: (item, the earlier backend, the later one)."""
    names = list(SHARED_SUITES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        for i, later in enumerate(names):
            for item, owner in owners(later).items():
                if owner is not None:
                    assert names.index(owner) < i
                    return item, owner, later
    pytest.skip("no two suites run a case alike: nothing is shared")


def test_the_fields_compared_are_a_tiles_but_warps_and_stages():
    """Warps and stages are the compiler's launch options, which Triton's interpreter does not pass on."""
    assert set(INTERPRETED_TILE_FIELDS) == set(TileConfig().to_dict()) - {"num_warps", "num_stages", "kernel"}
    assert interpreted_tile(TileConfig(num_warps=8, num_stages=3)) == interpreted_tile(TileConfig())
    assert interpreted_tile(TileConfig(block_m=32)) != interpreted_tile(TileConfig())


def test_a_case_two_suites_run_alike_is_run_by_the_earlier_one_only(shared_pair, interpreter):
    (test, case, splits), owner, later = shared_pair
    first, second = shared_suite(owner), shared_suite(later)
    assert first.launches(test, case, CPU, "small", splits) == second.launches(test, case, CPU, "small", splits)
    assert first.shared_owner(test, case, CPU, "small", splits) is None
    assert second.shared_owner(test, case, CPU, "small", splits)[0] == owner


def test_each_combination_is_run_by_exactly_one_suite_and_none_is_lost(interpreter):
    """Over every case of every suite: the (test, launches) combinations run with sharing are those run without
    it, each by one suite but the smoke cases."""
    before, after, smoke, runs_before = set(), Counter(), set(), 0
    for name in SHARED_SUITES:
        suite = shared_suite(name)
        for (test, case, splits), owner in owners(name).items():
            launches = suite.launches(test, case, CPU, "small", splits)
            if launches is None:
                assert owner is None, (name, test, case, splits)
                continue
            before.add((test, launches))
            runs_before += 1
            if owner is None:
                after[(test, launches)] += 1
                if test == CASE_TEST and case in SMOKE_CASES:
                    smoke.add((test, launches))
            else:  # the owner runs it itself, as this suite would
                assert owners(owner, [(test, case, splits)])[(test, case, splits)] is None
                assert shared_suite(owner).launches(test, case, CPU, "small", splits) == launches
    assert before == set(after)
    assert sum(after.values()) < runs_before, "no run is shared: the check shows nothing"
    assert all(n == 1 for combination, n in after.items() if combination not in smoke), after


def test_a_case_whose_tiles_differ_runs_in_every_suite(interpreter):
    """The named cases' tiles differ between the three policies (rows per tile): each suite runs them."""
    launches = {name: shared_suite(name).launches(CASE_TEST, "alibi", CPU, "small") for name in SHARED_SUITES}
    assert len(set(launches.values())) == len(SHARED_SUITES), launches
    assert all(shared_suite(name).shared_owner(CASE_TEST, "alibi", CPU, "small") is None for name in SHARED_SUITES)


def test_nothing_is_shared_outside_the_interpreter(shared_pair, monkeypatch):
    (test, case, splits), _, later = shared_pair
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert shared_suite(later).shared_owner(test, case, CPU, "small", splits) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a GPU: each backend compiles its own kernels there
    assert shared_suite(later).shared_owner(test, case, torch.device("cuda"), "small", splits) is None


def test_a_suite_outside_the_table_shares_nothing(shared_pair, interpreter):
    (test, case, splits), _, _ = shared_pair
    outside = type("Outside", (ConformanceSuite,), {"backend": "reference"})()
    assert outside.shared_owner(test, case, CPU, "small", splits) is None


def test_a_backend_whose_tiles_are_all_generics_still_runs_its_smoke_cases(interpreter):
    """bi100 with generic's tiles everywhere: every case it runs is generic's, but for the smoke cases."""
    generic, bi100 = get_registry().get("generic"), get_registry().get("bi100")
    device = interpreter_device("generic", CPU)
    interpreter.setattr(bi100, "tile_config", lambda shape, _device: generic.tile_config(shape, device))
    found = owners("bi100", [(CASE_TEST, case, None) for case in ("alibi", "float32", *SMOKE_CASES)])
    assert found[(CASE_TEST, "alibi", None)] == "generic" and found[(CASE_TEST, "float32", None)] == "generic"
    assert all(found[(CASE_TEST, case, None)] is None for case in SMOKE_CASES)


def test_a_suite_that_runs_other_batches_than_the_shared_view_fails_saying_so(interpreter):
    """The other suites decide from the view of a suite: one that runs anything else (other batches here, or its
    policy told of another device) fails rather than leave a run to nobody."""
    def case_spec(self, case, size, seed):
        return ConformanceSuite.case_spec(self, case, size, seed).replace(head_size=64)

    other = type("Elsewhere", (ConformanceSuite,), {"backend": "bi100", "case_spec": case_spec,
                                                    "device_info": shared_suite("bi100").device_info})
    with pytest.raises(AssertionError, match="make them agree"):
        other().shared_owner(CASE_TEST, "alibi", CPU, "small")


@pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")
def test_the_repositorys_suites_run_every_combination_they_ran_before():
    """ci/interpreter_runs.py over the backends' own suite classes (their devices and skips, not the view)."""
    spec = importlib.util.spec_from_file_location("interpreter_runs", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # (its dataclass looks its module up)
    interpreting = os.environ.get("TRITON_INTERPRET")
    try:
        spec.loader.exec_module(script)  # sets TRITON_INTERPRET=1 for this process
        all_suites = script.suites()
        if {suite.backend for suite in all_suites} != set(SHARED_SUITES):
            pytest.skip("not run from the repository: the backends' suites are not beside core")
        counts = script.coverage(script.runs(all_suites))
    finally:
        if interpreting is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpreting
        sys.modules.pop(spec.name, None)
    assert counts["distinct_before"] == counts["distinct_after"]
    assert counts["after"] < counts["before"]


@pytest.mark.skipif(not (ROOT / "packages" / "backend-bi100" / "tests").is_dir(),
                    reason="not run from the repository: no backend tests beside core")
def test_a_session_of_one_suite_skips_what_an_earlier_suite_runs_naming_it(shared_pair, tmp_path):
    """pytest on the later suite's case alone, in its own process (no other suite collected): it is skipped,
    and the reason names the suite and the case that run it."""
    (test, case, splits), owner, later = shared_pair
    path, suite = next((path, name) for path in sorted(ROOT.glob(f"packages/backend-{later}/tests/test_*.py"))
                       for name in suite_classes(path, later))
    param = case if splits is None else f"{case}-{splits}"
    node = f"{path}::{suite}::{test}[{param}]"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "--pagedprefill-device=cpu", node], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 skipped" in out, out
    assert f"same kernel and tile in Triton's interpreter as {owner}'s {test}[{param}]" in out, out
