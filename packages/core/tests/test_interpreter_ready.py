"""A backend that runs in Triton's CPU interpreter is refused, with the reason and the fix, when the
interpreter cannot run here: numpy missing, or a numpy the installed Triton's interpreter refuses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata

import pytest
from pagedprefill import DeviceInfo, hookimpl
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import interpreter_unready
from pagedprefill.registry import Registry
from test_cli import HIDE_NUMPY  # the import hook that makes numpy absent in a child process

CPU = DeviceInfo(type="cpu", vendor="cpu", name="test cpu", triton_backend="interpreter")


class InterpreterBackend(TritonBackend):
    name = "interp"
    priority = 100
    runs_in_interpreter = True


@pytest.fixture
def installed(monkeypatch):
    """Set the installed versions seen through the distributions' metadata (None: not installed)."""
    real_version, real_find_spec = metadata.version, importlib.util.find_spec

    def pretend(**versions):
        def version(name):
            if name in versions:
                if versions[name] is None:
                    raise metadata.PackageNotFoundError(name)
                return versions[name]
            return real_version(name)

        def find_spec(name, *args, **kwargs):
            if name == "numpy" and versions.get("numpy", "") is None:
                return None
            return real_find_spec(name, *args, **kwargs)

        monkeypatch.setattr(metadata, "version", version)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return pretend


def test_missing_numpy_is_the_reason_and_names_the_fix(installed):
    installed(numpy=None, triton="3.6.0")
    reasons = InterpreterBackend().supports(CPU)
    assert len(reasons) == 1, reasons
    assert "Triton's interpreter needs numpy, which is not installed" in reasons[0]
    assert 'pip install "numpy<2.4"' in reasons[0] and "backend-generic[interpreter]" in reasons[0]


@pytest.mark.parametrize("numpy", ["2.4.0", "2.4.6", "3.0.0rc1"])
def test_numpy_too_new_for_triton_36_interpreter(installed, numpy):
    installed(numpy=numpy, triton="3.6.0")
    reasons = InterpreterBackend().supports(CPU)
    assert reasons == [f"Triton 3.6.0's interpreter needs numpy < 2.4, but numpy {numpy} is installed: "
                       'pip install "numpy<2.4" (or the interpreter extra: '
                       'pip install "./packages/backend-generic[interpreter]")'], reasons


@pytest.mark.parametrize(("numpy", "triton"), [("2.3.5", "3.6.0"), ("1.26.4", "3.2.0"), ("2.4.0", "3.7.0")])
def test_a_numpy_the_interpreter_accepts_is_no_reason(installed, numpy, triton):
    installed(numpy=numpy, triton=triton)
    assert interpreter_unready() is None
    assert InterpreterBackend().supports(CPU) == []


class Plugin:
    @hookimpl
    def pagedprefill_backends(self):
        from pagedprefill.backends.reference import ReferenceBackend

        return [InterpreterBackend(), ReferenceBackend()]


def test_selection_passes_over_the_backend_and_says_why(installed, monkeypatch):
    installed(numpy=None, triton="3.6.0")
    monkeypatch.delenv("PAGEDPREFILL_BACKEND", raising=False)
    registry = Registry(load_entry_points=False)
    registry.register(Plugin(), name="plugin-interp")
    assert registry.select(CPU).name == "reference"
    row = next(r for r in registry.status(CPU) if r.name == "interp")
    assert not row.supported and "needs numpy" in row.reasons[0], row




@pytest.mark.skipif(importlib.util.find_spec("pagedprefill_generic") is None,
                    reason="pagedprefill-generic is not installed (install ./packages/backend-generic)")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_info_and_demo_without_numpy(tmp_path):
    """As a user runs them after an install without numpy: info does not choose generic and says why; the
    demo asked for generic says so in one line, with no traceback."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_NUMPY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDPREFILL_")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])))
    info = subprocess.run([sys.executable, "-m", "pagedprefill", "info", "--device", "cpu"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert info.returncode == 0, info.stdout + info.stderr
    generic = info.stdout[info.stdout.index("  generic "):]
    assert generic.splitlines()[0].split()[3] == "unsupported", info.stdout
    assert "why not: Triton's interpreter needs numpy, which is not installed" in generic, info.stdout
    assert "choice: reference" in info.stdout, info.stdout
    # TRITON_INTERPRET=1 asked for Triton's kernels: the automatic choice fell back, and says so in one line.
    lines = info.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedprefill info: warning: pagedprefill runs backend "
                                                   "'reference' on "), info.stderr
    assert "because backend 'generic' cannot run on it: Triton's interpreter needs numpy, which is not installed" \
        in lines[0], info.stderr
    demo = subprocess.run([sys.executable, "-m", "pagedprefill", "demo", "--backend", "generic", "--repeats", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr and len(demo.stderr.splitlines()) == 1, demo.stderr
    assert 'needs numpy, which is not installed: pip install "numpy<2.4"' in demo.stderr, demo.stderr
