"""Where generic is meant to run but the installation stops it, the reference runs instead with a warning (once
per process), not silently: Triton's interpreter asked for with a numpy it refuses, or ``TRITON_INTERPRET=1`` on
a GPU. On a CPU without the interpreter the reference is the intended choice, and nothing is said."""

from __future__ import annotations

import importlib.util
import warnings

import pagedprefill
import pytest
from pagedprefill import DeviceInfo
from pagedprefill.registry import Fallback, FallbackWarning
from pagedprefill.registry import fallback as fallback_module

NUMPY_24 = "Triton 3.6.0's interpreter needs numpy < 2.4, but numpy 2.4.0 is installed: pip install \"numpy<2.4\""
H200 = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0), num_sms=132,
                  max_shared_mem=227 * 1024, triton_backend="cuda")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed: generic declines for that reason everywhere")


@pytest.fixture
def fresh(monkeypatch):
    """A fresh registry and nothing warned yet, as in a new process; no selection variable set."""
    for name in ("TRITON_INTERPRET", "PAGEDPREFILL_VENDOR", pagedprefill.ENV_BACKEND):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(fallback_module, "_warned", set())
    pagedprefill.reset_registry()
    yield monkeypatch
    pagedprefill.reset_registry()


def chosen_and_warnings(device) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = pagedprefill.select_backend(device).name
    return name, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def test_the_interpreter_with_numpy_24_falls_back_with_a_warning(fresh):
    import pagedprefill.backends.triton_base as triton_base

    fresh.setenv("TRITON_INTERPRET", "1")
    fresh.setattr(triton_base, "interpreter_unready", lambda: NUMPY_24)
    name, messages = chosen_and_warnings("cpu")
    assert name == "reference"
    assert len(messages) == 1 and f"because backend 'generic' cannot run on it: {NUMPY_24}" in messages[0]
    reasons = pagedprefill.get_registry().get("generic").supports(DeviceInfo.detect("cpu"))
    assert reasons == [NUMPY_24] and isinstance(reasons[0], Fallback)


def test_the_interpreter_on_a_gpu_falls_back_with_a_warning(fresh):
    fresh.setenv("TRITON_INTERPRET", "1")
    name, messages = chosen_and_warnings(H200)
    assert name != "generic"
    assert any("because backend 'generic' cannot run on it: TRITON_INTERPRET=1 is set" in m for m in messages), \
        messages


def test_a_cpu_without_the_interpreter_runs_the_reference_silently(fresh):
    name, messages = chosen_and_warnings("cpu")
    assert name == "reference" and messages == []
    reasons = pagedprefill.get_registry().get("generic").supports(DeviceInfo.detect("cpu"))
    assert reasons and not any(isinstance(reason, Fallback) for reason in reasons)
