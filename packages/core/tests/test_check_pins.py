"""ci/check_pins.py, the CI check that the public index alone resolves the CPU sessions' pins: what it sets
aside, and how it tells a conflict (failure) from an index it cannot reach (a skip with the reason). pip is
replaced by canned answers here; the real resolution runs in the tests session."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "check_pins.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")


@pytest.fixture
def check_pins():
    spec = importlib.util.spec_from_file_location("check_pins", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_pip_settings_are_set_aside(check_pins, monkeypatch):
    for name, value in {"PIP_FIND_LINKS": "/opt/wheels", "PIP_EXTRA_INDEX_URL": "file:///x",
                        "PIP_INDEX_URL": "file:///y", "PIP_CONSTRAINT": "/c.txt", "PIP_CERT": "/ca.pem"}.items():
        monkeypatch.setenv(name, value)
    env = check_pins.public_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert env["PIP_CERT"] == "/ca.pem"
    assert not {"PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"} & env.keys()


def test_an_unreachable_index_is_a_skip_with_the_reason(check_pins, capsys):
    assert check_pins.main(["--index-url", "http://127.0.0.1:9/simple", "packages/core"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("check_pins: skipped: the public index http://127.0.0.1:9/simple cannot be reached ("), out
    assert "were not checked" in out


def _answer(check_pins, monkeypatch, returncode=0, stderr="", versions=None):
    monkeypatch.setattr(check_pins, "unreachable", lambda url, timeout=20.0: None)

    def resolve(requirements, index_url, report):
        if versions is not None:
            report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": v}}
                                                      for n, v in versions.items()]}))
        return subprocess.CompletedProcess([], returncode, "", stderr)

    monkeypatch.setattr(check_pins, "resolve", resolve)


def test_the_tested_pair_passes(check_pins, monkeypatch, capsys):
    _answer(check_pins, monkeypatch, versions={"torch": "2.11.0", "triton": "3.6.0", "numpy": "2.3.5"})
    assert check_pins.main(["packages/core"]) == 0
    assert "resolve on https://pypi.org/simple alone to torch 2.11.0, triton 3.6.0 (numpy 2.3.5)" in \
        capsys.readouterr().out


def test_a_patch_release_of_the_tested_torch_passes(check_pins, monkeypatch, capsys):
    _answer(check_pins, monkeypatch, versions={"torch": "2.11.1", "triton": "3.6.0", "numpy": "2.3.5"})
    assert check_pins.main(["packages/core"]) == 0
    assert "alone to torch 2.11.1, triton 3.6.0" in capsys.readouterr().out


def test_another_pair_fails(check_pins, monkeypatch, capsys):
    _answer(check_pins, monkeypatch, versions={"torch": "2.13.0", "triton": "3.7.1"})
    assert check_pins.main(["packages/core"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "torch 2.13.0, triton 3.7.1, expected the tested pair torch 2.11.0, triton 3.6.0" in out


def test_a_conflict_fails_with_what_pip_said(check_pins, monkeypatch, capsys):
    _answer(check_pins, monkeypatch, 1, "ERROR: ResolutionImpossible: for help visit ...")
    assert check_pins.main(["packages/core"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: the pins in ci/constraints-cpu.txt do not resolve" in out and "ResolutionImpossible" in out


def test_an_index_that_stops_answering_is_a_skip(check_pins, monkeypatch, capsys):
    _answer(check_pins, monkeypatch, 1, "WARNING: Retrying ... ReadTimeoutError(...)\nERROR: No matching distribution")
    assert check_pins.main(["packages/core"]) == 0
    assert "skipped: the public index https://pypi.org/simple stopped answering" in capsys.readouterr().out
