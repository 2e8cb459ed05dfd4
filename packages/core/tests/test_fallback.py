"""An automatic choice that falls back (a backend meant for the device stopped by the installation, or a plugin
that failed) warns once per process; choosing a backend because the device is not another's does not warn."""

from __future__ import annotations

import warnings

import pytest
from pagedprefill import Backend, DeviceInfo, hookimpl
from pagedprefill.registry import Fallback, FallbackWarning, Registry
from pagedprefill.registry import fallback as fallback_module

GPU = DeviceInfo(type="cuda", vendor="testvendor", name="Test GPU", index=0, capability=(9, 0), num_sms=4,
                 max_shared_mem=64 * 1024, triton_backend="cuda")


class Declining(Backend):
    def __init__(self, name: str, priority: int, reasons: list[str]) -> None:
        self.name, self.priority, self.reasons = name, priority, reasons

    def supports(self, device: DeviceInfo) -> list[str]:
        return list(self.reasons)

    def run(self, problem, device) -> None:
        raise AssertionError("not called by these tests")


class Plugin:
    def __init__(self, *backends: Backend) -> None:
        self.backends = backends

    @hookimpl
    def pagedprefill_backends(self):
        return list(self.backends)


class BrokenPlugin:
    @hookimpl
    def pagedprefill_backends(self):
        raise ImportError("libvendor.so is missing")


@pytest.fixture(autouse=True)
def fresh_process_memory(monkeypatch):
    """Each test starts as a new process would: nothing warned yet, no variable set."""
    monkeypatch.setattr(fallback_module, "_warned", set())
    monkeypatch.delenv("PAGEDPREFILL_BACKEND", raising=False)


def registry_of(*backends: Backend) -> Registry:
    registry = Registry(load_entry_points=False)
    registry.register(Plugin(*backends), name="plugin")
    return registry


def fallback_warnings(select) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = select()
    return chosen, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def test_passing_over_a_backend_stopped_by_the_installation_warns_once():
    stopped = Declining("fast", 200, [Fallback("needs numpy < 2.4, but numpy 2.4.0 is installed")])
    registry = registry_of(stopped, Declining("slow", 1, []))
    chosen, messages = fallback_warnings(lambda: registry.select(GPU))
    assert chosen.name == "slow"
    assert messages == ["pagedprefill runs backend 'slow' on Test GPU (cuda:0) because backend 'fast' cannot run on "
                        "it: needs numpy < 2.4, but numpy 2.4.0 is installed ('pagedprefill info' shows every "
                        "backend's reasons)"]
    registry.register(Plugin(), name="late")  # forgets the cached choice: selection runs again
    assert fallback_warnings(lambda: registry.select(GPU))[1] == []  # once per process
    other = registry_of(stopped, Declining("slow", 1, []))
    assert fallback_warnings(lambda: other.select(GPU))[1] == []  # a new registry, the same process


def test_a_device_that_is_not_a_backends_own_is_no_fallback():
    registry = registry_of(Declining("vendor-x", 200, ["vendor-x runs on vendor X's devices only"]),
                           Declining("slow", 1, []))
    chosen, messages = fallback_warnings(lambda: registry.select(GPU))
    assert chosen.name == "slow" and messages == []


def test_a_backend_below_the_choice_is_no_fallback():
    registry = registry_of(Declining("fast", 200, []), Declining("stopped", 1, [Fallback("a package is missing")]))
    chosen, messages = fallback_warnings(lambda: registry.select(GPU))
    assert chosen.name == "fast" and messages == []


def test_an_explicit_choice_does_not_warn():
    registry = registry_of(Declining("fast", 200, [Fallback("a package is missing")]), Declining("slow", 1, []))
    chosen, messages = fallback_warnings(lambda: registry.select(GPU, backend="slow"))
    assert chosen.name == "slow" and messages == []


def test_a_plugin_that_failed_warns():
    registry = registry_of(Declining("slow", 1, []))
    registry.register(BrokenPlugin(), name="vendor")
    chosen, messages = fallback_warnings(lambda: registry.select(GPU))
    assert chosen.name == "slow"
    assert messages == ["pagedprefill runs backend 'slow' on Test GPU (cuda:0) because plugin 'vendor' is not "
                        "available: ImportError: libvendor.so is missing ('pagedprefill info' shows every backend's "
                        "reasons)"]


def test_the_warning_points_at_the_callers_line():
    import pagedprefill

    registry = registry_of(Declining("fast", 200, [Fallback("a package is missing")]), Declining("slow", 1, []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.select(GPU)
    assert [w.filename for w in caught if issubclass(w.category, FallbackWarning)] == [__file__]
    assert pagedprefill.registry.Fallback is Fallback


def test_a_quiet_selection_leaves_the_warning_to_the_first_use():
    """The selection at import runs nothing and says nothing; the first call that gets the choice is told."""
    registry = registry_of(Declining("fast", 200, [Fallback("a package is missing")]), Declining("slow", 1, []))
    chosen, messages = fallback_warnings(lambda: registry.select(GPU, warn=False))
    assert chosen.name == "slow" and messages == []
    chosen, messages = fallback_warnings(lambda: registry.select(GPU))  # the cached choice, still told
    assert chosen.name == "slow" and len(messages) == 1 and "a package is missing" in messages[0]
