"""The pytest plugin that pagedprefill installs: the Triton interpreter's flood of one DeprecationWarning is
filtered, and every other warning is still reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

INTERPRETER_MESSAGE = ("Conversion of an array with ndim > 0 to a scalar is deprecated, and will error in future. "
                       "Ensure you extract a single element from your array before performing this operation. "
                       "(Deprecated NumPy 1.25.)")

TESTS = f'''
import warnings


def _warn(message, module):
    warnings.warn_explicit(message, DeprecationWarning, module.replace(".", "/") + ".py", 888, module=module)


def test_interpreter_warning_is_filtered():
    for _ in range(1000):  # the interpreter warns once per element it indexes
        _warn({INTERPRETER_MESSAGE!r}, "triton.runtime.interpreter")


def test_same_warning_elsewhere_is_reported():
    _warn({INTERPRETER_MESSAGE!r}, "mypackage.kernels")


def test_other_interpreter_warnings_are_reported():
    _warn("some other deprecation", "triton.runtime.interpreter")
'''


def test_only_the_interpreter_warning_is_filtered(tmp_path):
    (tmp_path / "test_warnings.py").write_text(textwrap.dedent(TESTS))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 passed, 2 warnings" in out, out
    assert "mypackage/kernels.py:888" in out and "some other deprecation" in out, out
    assert "test_interpreter_warning_is_filtered" not in out.split("warnings summary")[-1], out
