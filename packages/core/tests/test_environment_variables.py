"""Every environment variable core and the backends read is declared with the values it takes; selection refuses
any other value with an error naming the variable (:mod:`pagedprefill.variables`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pagedprefill
import pytest
from pagedprefill import Backend, DeviceInfo, hookimpl
from pagedprefill.registry import Registry
from pagedprefill.variables import CORE_VARIABLES, EnvironmentVariable

CPU = DeviceInfo(type="cpu", vendor="cpu", name="test cpu")
GPU = DeviceInfo(type="cuda", vendor="testvendor", name="Test GPU", index=0, capability=(9, 0), num_sms=4,
                 max_shared_mem=64 * 1024, triton_backend="cuda")
CORE_SOURCE = Path(pagedprefill.__file__).parent


class KnobBackend(Backend):
    """Runs on testvendor GPUs and reads two variables of its own."""

    name = "knob"
    priority = 50

    def __init__(self, checked: list) -> None:
        def check_flags(value: str) -> None:
            checked.append(value)
            for item in value.split(","):
                key, _, flag = item.partition("=")
                if key not in ("FAST", "SAFE") or flag not in ("0", "1"):
                    raise ValueError(f"expected NAME=0 or NAME=1 with NAME one of FAST, SAFE, got {item!r}")

        self.environment_variables = (
            EnvironmentVariable("PAGEDPREFILL_KNOB_KERNEL", "the kernel knob runs", choices=("auto", "fast", "safe")),
            EnvironmentVariable("PAGEDPREFILL_KNOB_FLAGS", "knob's schedule flags", check=check_flags),
        )

    def supports(self, device: DeviceInfo) -> list[str]:
        return [] if device.vendor == "testvendor" else ["knob runs on testvendor devices only"]

    def run(self, problem, device) -> None:
        raise AssertionError("not called by these tests")


class Plugin:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @hookimpl
    def pagedprefill_backends(self):
        return [self.backend]


@pytest.fixture
def knob(monkeypatch):
    """A registry with the reference and the knob backend, and the list of values knob's flag check saw."""
    for declared in (*CORE_VARIABLES, EnvironmentVariable("PAGEDPREFILL_KNOB_KERNEL", "-", choices=("x",)),
                     EnvironmentVariable("PAGEDPREFILL_KNOB_FLAGS", "-", choices=("x",))):
        monkeypatch.delenv(declared.name, raising=False)
    from pagedprefill.backends import reference

    checked: list = []
    registry = Registry(load_entry_points=False, builtins=[reference])
    registry.register(Plugin(KnobBackend(checked)), name="knob")
    return registry, checked, monkeypatch


@pytest.mark.parametrize("name, value, expected", [
    ("PAGEDPREFILL_KNOB_KERNEL", "bogus", "expected one of auto, fast, safe (the kernel knob runs, read by backend "
                                          "'knob')"),
    ("PAGEDPREFILL_KNOB_FLAGS", "FAST=2", "expected NAME=0 or NAME=1 with NAME one of FAST, SAFE, got 'FAST=2' "
                                          "(knob's schedule flags, read by backend 'knob')"),
    ("PAGEDPREFILL_LAZY_SELECT", "yes", "expected one of 0, 1 (whether selection waits for the first call, read by "
                                        "core)"),
    ("PAGEDPREFILL_VENDOR", "Iluvatar CoreX", "expected a vendor name such as iluvatar or metax (a vendor is one "
                                              "word of letters, digits, '-', '_' or '.')"),
])
def test_a_value_outside_the_declared_ones_is_an_error_naming_the_variable(knob, name, value, expected):
    registry, _, env = knob
    env.setenv(name, value)
    message = rf"^{name}={re.escape(repr(value))}: {re.escape(expected)}.*; correct it, or unset {name} for the " \
              r"default$"
    # On every device: a variable of a backend that cannot run here is still wrong, and said so.
    for device in (GPU, CPU):
        with pytest.raises(ValueError, match=message):
            registry.select(device)
    with pytest.raises(ValueError, match=message):
        registry.select(GPU, backend="reference")  # an explicit choice too


def test_a_tune_directory_that_is_a_file_is_refused(knob, tmp_path):
    registry, _, env = knob
    (tmp_path / "tables").write_text("not a directory")
    env.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path / "tables"))
    with pytest.raises(ValueError, match=r"^PAGEDPREFILL_TUNE_DIR=.*: .* exists and is not a directory"):
        registry.select(CPU)
    env.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path / "not-yet"))  # tune creates it
    assert registry.select(CPU).name == "reference"


def test_declared_values_are_accepted_and_each_is_checked_once(knob):
    registry, checked, env = knob
    env.setenv("PAGEDPREFILL_KNOB_KERNEL", " Fast ")  # whitespace and case, as the reader takes them
    env.setenv("PAGEDPREFILL_KNOB_FLAGS", "FAST=1,SAFE=0")
    env.setenv("PAGEDPREFILL_LAZY_SELECT", "1")
    for _ in range(3):
        assert registry.select(GPU).name == "knob"
    assert checked == ["FAST=1,SAFE=0"]
    env.setenv("PAGEDPREFILL_KNOB_FLAGS", "SAFE=1")
    assert registry.select(CPU).name == "reference"
    assert checked == ["FAST=1,SAFE=0", "SAFE=1"]


def test_unset_and_empty_variables_mean_the_default(knob):
    registry, checked, env = knob
    env.setenv("PAGEDPREFILL_KNOB_KERNEL", "")
    env.setenv("PAGEDPREFILL_VENDOR", "  ")
    assert registry.select(GPU).name == "knob" and checked == []


def test_a_declaration_says_what_it_takes():
    with pytest.raises(ValueError, match="^PAGEDPREFILL_X: a declared variable needs choices, a check or the "
                                         "expected values$"):
        EnvironmentVariable("PAGEDPREFILL_X", "nothing")


def test_every_variable_core_reads_is_declared():
    """A PAGEDPREFILL_ variable named anywhere in core's source is one of CORE_VARIABLES (a new one without a
    declaration would be accepted with any value)."""
    named = set()
    for path in CORE_SOURCE.rglob("*.py"):
        named |= set(re.findall(r"\bPAGEDPREFILL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    named.discard("PAGEDPREFILL_MY_KERNEL")  # a backend's, in the example of pagedprefill.variables' docstring
    assert named == {declared.name for declared in CORE_VARIABLES}


def test_info_says_which_variable_is_wrong_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "pagedprefill", "info"], capture_output=True, text=True,
                          env={**os.environ, "PAGEDPREFILL_LAZY_SELECT": "true"}, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "pagedprefill info: error: PAGEDPREFILL_LAZY_SELECT='true': expected one of 0, 1 (whether selection waits "
        "for the first call, read by core); correct it, or unset PAGEDPREFILL_LAZY_SELECT for the default"]


def test_info_lists_the_variables_that_are_set():
    proc = subprocess.run([sys.executable, "-m", "pagedprefill", "info"], capture_output=True, text=True,
                          env={**os.environ, "PAGEDPREFILL_LAZY_SELECT": "1"}, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "environment: PAGEDPREFILL_LAZY_SELECT=1" in proc.stdout.splitlines()
