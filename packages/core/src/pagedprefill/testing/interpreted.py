"""Running a script with the generic backend in Triton's interpreter, in a process of its own: ``TRITON_INTERPRET``
must be set before Triton is imported, which a test process that imported it already cannot do."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source) in a new interpreter with ``TRITON_INTERPRET=1``; skip the calling test, with
    the reason, when the generic backend or Triton is not installed. Returns the finished process (its output as
    text), for the caller to check."""
    import pytest

    pytest.importorskip("pagedprefill_generic", reason="pagedprefill-generic is not installed")
    pytest.importorskip("triton", reason="Triton is not installed")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=timeout)
