"""The repository's noxfile: what the sessions install and the reason a hardware session skips with.

The noxfile is loaded with a stand-in for nox (its decorators and a recording session), so these tests need
neither nox nor a package index.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

NOXFILE = Path(__file__).resolve().parents[3] / "noxfile.py"

pytestmark = pytest.mark.skipif(not NOXFILE.is_file(), reason=f"no {NOXFILE} (this checkout has no noxfile)")


class Skipped(Exception):
    pass


class RecordingSession:
    """The parts of ``nox.Session`` the noxfile uses; ``run`` answers with ``outputs`` by script name."""

    def __init__(self, venv_backend: str = "venv", outputs: dict | None = None) -> None:
        self.venv_backend = venv_backend
        self.posargs: list[str] = []
        self.outputs = outputs or {}
        self.calls: list[tuple] = []
        self.logs: list[str] = []

    def install(self, *args, **kwargs):
        self.calls.append(("install", *args))

    def run(self, *args, **kwargs):
        self.calls.append(("run", *args))
        return next((out for key, out in self.outputs.items() if key in args), None)

    def log(self, message):
        self.logs.append(message)

    def skip(self, reason):
        raise Skipped(reason)


@pytest.fixture(scope="module")
def noxfile():
    stub = types.ModuleType("nox")
    stub.Session = RecordingSession
    stub.options = types.SimpleNamespace()
    stub.session = lambda func=None, **kwargs: func if func is not None else (lambda f: f)
    saved = sys.modules.get("nox")
    sys.modules["nox"] = stub
    try:
        spec = importlib.util.spec_from_file_location("pagedprefill_noxfile", NOXFILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["nox"]
        else:
            sys.modules["nox"] = saved
    return module


def _editables(call: tuple) -> list[str]:
    return [call[i + 1] for i, arg in enumerate(call) if arg == "-e"]


@pytest.mark.parametrize("venv_backend", ["venv", "none"])
def test_generic_session_installs_each_package_once(noxfile, venv_backend):
    session = RecordingSession(venv_backend, outputs={"ci/detect_target.py": "present: generic runs on X"})
    noxfile.generic(session)
    installs = [call for call in session.calls if "-e" in call]
    assert len(installs) == 1, session.calls
    editables = _editables(installs[0])
    assert len(editables) == len(set(editables)), editables
    assert "packages/backend-generic" in editables


def test_absent_hardware_is_named_once_in_the_skip_reason(noxfile, monkeypatch):
    monkeypatch.delenv("PAGEDPREFILL_FORCE_TARGET", raising=False)
    verdict = "absent: no accelerator visible to torch 2.13.0; the generic session needs one\n"
    session = RecordingSession("none", outputs={"ci/detect_target.py": verdict})
    with pytest.raises(Skipped) as skipped:
        noxfile.generic(session)
    reason = str(skipped.value)
    assert reason.startswith("generic hardware not present: no accelerator visible to torch 2.13.0;"), reason
    assert "absent" not in reason, reason


def test_tests_session_checks_the_pins_against_the_public_index(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: "no network here")
    session = RecordingSession("venv")
    noxfile.tests(session)
    check = next(call for call in session.calls if "ci/check_pins.py" in call)
    install = next(call for call in session.calls if call[0] == "install")
    assert session.calls.index(check) < session.calls.index(install), "the pins are checked before installing"
    assert list(check[3:]) == _editables(install), "the check resolves what the session installs"
    assert "--extra-index-url" not in install
    assert any("does not answer (no network here)" in line for line in session.logs), session.logs


def test_cpu_sessions_take_torch_from_the_cpu_index_where_it_answers(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: "")
    session = RecordingSession("venv")
    noxfile.tests(session)
    install = next(call for call in session.calls if call[0] == "install")
    assert install[1:3] == ("--extra-index-url", noxfile.CPU_TORCH_INDEX), install


@pytest.mark.parametrize("index_answers", [True, False])
def test_demo_without_a_gpu_takes_the_cpu_build_or_says_what_it_downloads(noxfile, monkeypatch, index_answers):
    monkeypatch.setattr(noxfile, "_nvidia_gpu", lambda: False)
    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: "" if index_answers else "no network here")
    monkeypatch.setattr(noxfile.sys, "platform", "linux")
    session = RecordingSession("venv")
    noxfile.demo(session)
    install = next(call for call in session.calls if call[0] == "install")
    assert (install[1:3] == ("--extra-index-url", noxfile.CPU_TORCH_INDEX)) is index_answers, install
    if not index_answers:  # said before pip starts downloading
        said = [line for line in session.logs if "does not answer (no network here)" in line]
        assert said and "the CUDA one: about 4.7 GB" in said[0], session.logs


def test_demo_with_a_gpu_takes_the_public_index_build(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile, "_nvidia_gpu", lambda: True)
    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: pytest.fail("the CPU index was asked"))
    session = RecordingSession("venv")
    noxfile.demo(session)
    install = next(call for call in session.calls if call[0] == "install")
    assert "--extra-index-url" not in install


def test_noxs_uv_probe_line_is_dropped_and_nothing_else(noxfile):
    import logging

    def passes(message: str) -> bool:
        record = logging.LogRecord("nox", logging.INFO, __file__, 1, message, (), None)
        return logging.getLogger("nox").filter(record)

    assert not passes("uv binary not found.")
    assert passes("Running session demo") and passes("uv binary not found. (something else)")


def test_the_tests_session_installs_what_every_core_test_needs(noxfile, monkeypatch):
    """The tests session installs core's ``test`` extra, which must hold pytest-xdist: without it the live run
    of ``test_plugin_order.py`` (two workers) skips."""
    import re

    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: "")
    session = RecordingSession("venv")
    noxfile.tests(session)
    install = next(call for call in session.calls if call[0] == "install")
    assert "packages/core[triton,test,transformers]" in _editables(install), install
    pyproject = (NOXFILE.parent / "packages" / "core" / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*)\]$", pyproject, re.M).group(1)
    assert '"pytest-xdist' in test_extra, test_extra


class VerboseRecordingSession(RecordingSession):
    """A :class:`RecordingSession` that also records each install's keyword arguments and the logs before it."""

    def install(self, *args, **kwargs):
        super().install(*args, **kwargs)
        self.calls.append(("install kwargs", kwargs, list(self.logs)))


@pytest.mark.parametrize("index_answers", [True, False])
def test_installs_say_what_they_install_and_show_pips_progress(noxfile, monkeypatch, index_answers):
    """nox hides an install's output unless run with --verbose: the sessions say what pip installs (and which
    torch) before it starts, and let its progress show."""
    monkeypatch.setattr(noxfile, "_unreachable", lambda url, timeout=5.0: "" if index_answers else "no network here")
    monkeypatch.setattr(noxfile.sys, "platform", "linux")
    session = VerboseRecordingSession("venv")
    noxfile.tests(session)
    (_, kwargs, logs_before), = [call for call in session.calls if call[0] == "install kwargs"]
    assert kwargs.get("silent") is False, kwargs
    said = [line for line in logs_before if line.startswith("pip installs packages/core[triton,test,transformers]")]
    assert said, logs_before
    assert ("torch's CPU build from https://download.pytorch.org/whl/cpu" if index_answers
            else "the CUDA one: about 4.7 GB") in said[0], said[0]
    lint = VerboseRecordingSession("venv")
    noxfile.lint(lint)
    assert [call[1] for call in lint.calls if call[0] == "install kwargs"] == [{"silent": False}]

