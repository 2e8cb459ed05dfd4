"""ci/gpu/guard_cost.py, which measures the memory-safety guards on a GPU: its copy of the kernel without the
guards must still be found, built and launched, and agree with the kernel on valid metadata. Checked here in
Triton's interpreter on one small batch (``--smoke``), so a change to the kernel's source that the script no
longer recognises fails in CI, not on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "guard_cost.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")


def test_unguarded_copy_builds_and_matches_on_valid_metadata():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| portable | smoke | nhd | - | - | - | True |" in proc.stdout, proc.stdout
