"""ci/gpu/unfinished_tests.py, which lists the tests a cut GPU run did not finish: checked on logs in pytest's own
formats and on a small test folder written here, so that a change to its reading fails in CI, not after a cut run
on the GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "unfinished_tests.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")

TESTS = '''
import pytest

@pytest.mark.parametrize("x", ["a b", "c", "d - e"])
def test_p(x):
    assert x


class TestK:
    def test_k(self):
        pass
'''


def load():
    spec = importlib.util.spec_from_file_location("unfinished_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_log_format_names_the_finished_tests():
    unfinished_tests = load()
    lines = [
        "tests/test_a.py::test_p[a b] ",  # xdist names a test as it starts: not finished
        "[gw1] [ 25%] PASSED tests/test_a.py::test_p[a b] ",
        "[gw0] [ 50%] SKIPPED tests/test_a.py::test_p[c] ",
        "tests/test_b.py::test_q[x y] FAILED                                    [ 75%]",
        "tests/test_b.py::test_q[z] SKIPPED (needs a GPU)                       [ 80%]",
        "FAILED tests/test_a.py::test_p[d - e] - AssertionError: assert x[0] - 1",
        "ERROR pkg/tests/test_c.py::TestK::test_k - RuntimeError",
        "..s.F [ 90%]",
    ]
    assert unfinished_tests.finished_ids(lines) == {
        "tests/test_a.py::test_p[a b]", "tests/test_a.py::test_p[c]", "tests/test_b.py::test_q[x y]",
        "tests/test_b.py::test_q[z]", "tests/test_a.py::test_p[d - e]", "tests/test_c.py::TestK::test_k"}


def test_the_tests_a_cut_log_left_are_listed_in_collection_order(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(TESTS)
    # Written from the repository's root: its ids carry the package's folder, the collection here does not.
    log = tmp_path / "cut.log"
    log.write_text("[gw0] [ 25%] PASSED packages/x/tests/test_a.py::test_p[a b] \n"
                   "packages/x/tests/test_a.py::test_p[c] \n"
                   "[gw1] [ 50%] FAILED packages/x/tests/test_a.py::TestK::test_k \n")
    out = tmp_path / "rest.txt"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(log), "--out", str(out), "--", "tests"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.read_text().splitlines() == ["tests/test_a.py::test_p[c]", "tests/test_a.py::test_p[d - e]"]
    assert "4 collected, 2 finished in the logs, 2 unfinished" in proc.stderr


def test_it_asks_for_the_runs_pytest_arguments(tmp_path):
    log = tmp_path / "cut.log"
    log.write_text("")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "after --" in proc.stderr
