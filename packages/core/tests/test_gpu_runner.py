"""The GPU runner, ``ci/gpu/verify.sh``, without a GPU: its header lists every step it runs, ``--dry-run`` prints
each step's commands, a list of several runs at once gives each its own environment, and an unknown step is
refused before anything runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "verify.sh"

pytestmark = [
    pytest.mark.skipif(not RUNNER.is_file(), reason=f"no {RUNNER} (this checkout has no ci/)"),
    pytest.mark.skipif(shutil.which("bash") is None, reason="the runner is a bash script; no bash here"),
]


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUNNER), *args], capture_output=True, text=True, timeout=60)


def listed_steps() -> list[str]:
    """The steps of the header (``--list``), each as a runnable name: ``fuzz[=N]`` as ``fuzz``."""
    lines = runner("--list").stdout.splitlines()
    names = [line.split()[0] for line in lines if re.match(r"^  [a-z]", line)]
    return [re.sub(r"\[=.*\]$", "", name).replace("=B,...", "=sm80,bi100") for name in names]


def test_every_step_the_runner_knows_is_in_its_header():
    text = RUNNER.read_text()
    block = text[text.index("known_step() {"):]
    simple = block[block.index("case $1 in") + len("case $1 in"):block.index(") return 0")]
    known = {name.strip(" \\\n") for name in simple.split("|")}
    with_values = set(re.findall(r"^\s+([a-z-]+)=\*\)", block[:block.index("esac")], re.M))
    bases = {name.split("=")[0] for name in listed_steps()}
    assert known - bases == set(), f"steps missing from the header: {sorted(known - bases)}"
    assert with_values - bases == set(), f"steps with values missing from the header: {sorted(with_values - bases)}"
    assert {"core-gpu", "conformance-sm80", "conformance-generic", "conformance-bi100", "fuzz", "bench",
            "host-overhead", "hopper", "nox"} <= known


def test_dry_run_prints_every_listed_step_and_runs_nothing(tmp_path):
    steps = listed_steps() + ["fuzz=5000", "host-overhead=nhd,split,nhd,split"]
    done = runner(str(tmp_path / "out"), "--dry-run", *steps)
    assert done.returncode == 0, done.stderr
    for step in steps:
        assert f"=== {step} (" in done.stdout, step
    assert "--pagedprefill-fuzz=5000" in done.stdout
    assert done.stdout.count("ci/gpu/host_overhead.py") == 2 + 4
    assert "packages/backend-bi100/tests" in done.stdout
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = runner(str(tmp_path / "out"), "core-gpu", "confromance", "fuzz=many")
    assert done.returncode == 2
    assert "unknown step(s): confromance fuzz=many" in done.stderr
    assert not (tmp_path / "out").exists()


def test_lists_run_together_each_with_its_environment(tmp_path):
    done = runner(str(tmp_path / "out"), "--dry-run", "--deadline", "540", "--together",
                  "WORKERS=7 PAGEDPREFILL_SM80_KERNEL=hopper -- conformance-sm80", "-- hopper bench")
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.split("######## list2")
    assert "env WORKERS=7 PAGEDPREFILL_SM80_KERNEL=hopper" in first and "-n 7" in first
    assert "=== hopper (" in second and "=== bench (" in second and "list2/bench.json" in second


def test_two_gpus_puts_each_list_on_its_own_gpu(tmp_path):
    done = runner(str(tmp_path / "out"), "--dry-run", "--two-gpus", "core-gpu", "-- conformance")
    assert done.returncode == 0, done.stderr
    assert "gpu0: env CUDA_VISIBLE_DEVICES=0" in done.stdout
    assert "gpu1: env CUDA_VISIBLE_DEVICES=1" in done.stdout
    assert runner(str(tmp_path / "out"), "--two-gpus", "core-gpu").returncode == 2
