"""The backend guide's walk, as a new backend's author takes it: copy docs/backend-template, rename everything that
says ``mybackend``, give it a finished backend's priority (200, as the guide says), install it, see
``pagedprefill info`` list it, and run its own tests (registration, policy, detection and a few conformance cases)
in Triton's interpreter. Each step runs in a subprocess that sees the package only through its installation."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = REPO / "docs" / "backend-template"
NAME = "walkthrough"
TIMEOUT = 600
#: What changes selection or the device a subprocess sees; the walk sets what it needs.
SELECTION_ENV = ("PAGEDPREFILL_BACKEND", "PAGEDPREFILL_VENDOR", "PAGEDPREFILL_LAZY_SELECT", "TRITON_INTERPRET")

pytestmark = [
    pytest.mark.skipif(not TEMPLATE.is_dir(), reason=f"no backend template at {TEMPLATE} (this checkout has no docs/)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="Triton is not installed: the template's conformance tests run its kernels"),
    pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                       reason="setuptools is not installed: the renamed copy is built without build isolation"),
]


def renamed_copy(destination: Path) -> Path:
    """The template made into a backend named :data:`NAME` by its own helper (``new_backend.py``, run as a user
    runs it), with the priority of a finished backend, as the template's README and the guide's sections 11 and 13
    ask."""
    made = subprocess.run([sys.executable, str(TEMPLATE / "new_backend.py"), NAME, str(destination)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert made.returncode == 0, made.stderr
    left = [str(p) for p in destination.rglob("*") if p.is_file() and p.suffix in (".py", ".toml", ".md")
            and re.search("mybackend|MyBackend", p.read_text())]
    assert not left and not (destination / "new_backend.py").exists(), left
    backend = destination / "src" / f"pagedprefill_{NAME}" / "backend.py"
    text, changed = re.subn(r"^    priority = 150$", "    priority = 200", backend.read_text(), flags=re.M)
    assert changed == 1, "the template's backend no longer sets `priority = 150` on a line of its own"
    backend.write_text(text)
    return destination


def run(command: list[str], site: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SELECTION_ENV}
    path = os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=TIMEOUT,
                          env={**clean, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1",
                               **env})


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> tuple[Path, Path]:
    """The renamed copy and the directory it is installed in (pip ``--target``, without touching this
    environment: the test process itself never sees the new backend)."""
    source = renamed_copy(tmp_path_factory.mktemp("walk") / f"pagedprefill-{NAME}")
    site = tmp_path_factory.mktemp("site-walk")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target", str(site),
                           str(source)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"pip install of the renamed template failed:\n{proc.stdout}\n{proc.stderr}"
    return source, site


def test_the_renamed_copy_keeps_no_trace_of_the_template(walked):
    source, _ = walked
    left = [str(path.relative_to(source)) for path in source.rglob("*")
            if "mybackend" in path.name or (path.is_file() and "mybackend" in path.read_text())]
    assert left == []


def test_info_lists_the_renamed_backend_at_its_priority(walked):
    source, site = walked
    proc = run([sys.executable, "-m", "pagedprefill", "info"], site, source)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next((line for line in proc.stdout.splitlines() if line.strip().startswith(NAME)), None)
    assert row is not None, proc.stdout
    assert re.match(rf"^  {NAME}\s+priority\s+200\s+unsupported - Triton kernels tuned for myvendor accelerators$",
                    row), row
    assert f"why not: {NAME} is for myvendor devices, not vendor 'cpu'" in proc.stdout


def test_its_own_tests_pass_in_the_interpreter(walked):
    """The renamed backend's tests as the guide's section 10 runs them (a few of the conformance cases: the
    whole suite takes many minutes in the interpreter)."""
    source, site = walked
    suite = f"Test{NAME.capitalize()}BackendConformance"  # the template's TestMyBackendConformance, renamed
    picked = (f"not {suite} or (test_case_matches_reference and (basic or gqa_4 or "
              "split_layout_head_24 or skip_decode_two_tokens)) or (test_random_sweep and 0)")
    proc = run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                "--pagedprefill-device=cpu", "-k", picked], site, source, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 25 and "failed" not in summary and "error" not in summary, summary
    assert "skipped" not in summary, summary  # every picked test ran
