"""Device detection: core's general view (torch and Triton), the ``pagedprefill_detect_device`` hook, the
``PAGEDPREFILL_VENDOR`` override and the defaults for what nobody reported.

Devices that are not present are described to torch by replacing ``get_device_properties`` of the device
type's module, and to Triton by making a described driver the active one, so the same calls run as on a
machine that has them.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pagedprefill as pp
import pytest
import torch
from pagedprefill import DeviceInfo, hookimpl
from pagedprefill.device import FALLBACK_SHARED_MEM, FALLBACK_SHARED_MEM_HIP, general_info, normalise
from pagedprefill.registry import Registry
from pagedprefill.testing.described import DescribedDriver, described_device

TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed: its driver cannot be described")

XPU0 = torch.device("xpu", 0)
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("PAGEDPREFILL_VENDOR", "TRITON_INTERPRET", "PAGEDPREFILL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def describe_to_torch(monkeypatch, device_type: str, **props) -> None:
    """Make ``torch.<device_type>.get_device_properties`` report ``props`` for every index."""
    module = torch.get_device_module(device_type)
    monkeypatch.setattr(module, "get_device_properties", lambda index=None: SimpleNamespace(**props))


@pytest.fixture
def triton_driver():
    """``set(driver)`` makes a described driver Triton's active one for the test."""
    from triton.runtime import driver

    previous = getattr(driver, "_active", None)  # None until Triton looked for a driver
    yield driver.set_active
    driver.set_active(previous)


class Detector:
    """A plugin whose detection hook recognises devices named ``name`` and sets ``changes``."""

    def __init__(self, name: str, **changes) -> None:
        self.name, self.changes, self.seen = name, changes, []

    @hookimpl
    def pagedprefill_detect_device(self, device, info):
        self.seen.append((device, info))
        return info.replace(**self.changes) if info.name == self.name else None


# --------------------------------------------------------------------------------------------------------
# Core's general view
# --------------------------------------------------------------------------------------------------------


def test_cuda_device_is_described_from_torch_properties(clean_env):
    describe_to_torch(clean_env, "cuda", name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                      warp_size=32, shared_memory_per_block_optin=227 * 1024)
    info = general_info(CUDA0).replace(triton_backend=None)  # Triton's part: the tests below
    assert info == DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0),
                              warp_size=32, num_sms=132, max_shared_mem=227 * 1024)


def test_rocm_build_makes_cuda_devices_amd_with_hip_defaults(clean_env):
    describe_to_torch(clean_env, "cuda", name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304)
    clean_env.setattr(torch.version, "hip", "6.2.0", raising=False)
    info = Registry(load_entry_points=False).detect_device(CUDA0)
    assert info.vendor == "amd"
    # neither torch nor Triton reported these: the HIP defaults fill them
    assert (info.warp_size, info.max_shared_mem) == (64, FALLBACK_SHARED_MEM_HIP)


def test_unreported_limits_are_zero_for_hooks_and_filled_after(clean_env):
    describe_to_torch(clean_env, "cuda", name="Some GPU", major=8, minor=0, multi_processor_count=0)
    detector = Detector("nobody")
    registry = Registry(load_entry_points=False)
    registry.register(detector)
    info = registry.detect_device(CUDA0)
    (_, seen), = detector.seen
    assert (seen.warp_size, seen.max_shared_mem, seen.num_sms) == (0, 0, 1)
    assert (info.warp_size, info.max_shared_mem) == (32, FALLBACK_SHARED_MEM)


def test_other_device_types_keep_their_type_as_vendor(clean_env):
    describe_to_torch(clean_env, "xpu", name="Intel(R) Data Center GPU Max 1550")
    info = Registry(load_entry_points=False).detect_device(XPU0)
    assert (info.type, info.index, info.vendor, info.name) == ("xpu", 0, "xpu", "Intel(R) Data Center GPU Max 1550")


def test_a_type_torch_cannot_describe_is_named_by_the_device(clean_env):
    info = Registry(load_entry_points=False).detect_device(torch.device("mtia", 1))
    assert (info.type, info.index, info.vendor, info.name) == ("mtia", 1, "mtia", "mtia:1")


@needs_triton
def test_triton_backend_comes_from_the_active_driver_for_any_device_type(clean_env, triton_driver):
    describe_to_torch(clean_env, "xpu", name="Described XPU")
    triton_driver(DescribedDriver("xpu", "xpu", {"max_shared_mem": 128 * 1024, "multiprocessor_count": 64}))
    info = general_info(XPU0)
    assert info.triton_backend == "xpu"
    assert (info.max_shared_mem, info.num_sms) == (128 * 1024, 64)


@needs_triton
def test_a_driver_for_another_device_type_does_not_serve_this_one(clean_env, triton_driver):
    describe_to_torch(clean_env, "xpu", name="Described XPU")
    triton_driver(DescribedDriver("cuda", "cuda", {"max_shared_mem": 99 * 1024}))
    info = general_info(XPU0)
    assert info.triton_backend is None
    assert info.max_shared_mem == 0


@needs_triton
def test_the_interpreter_keeps_triton_off_accelerators(clean_env, triton_driver):
    describe_to_torch(clean_env, "xpu", name="Described XPU")
    triton_driver(DescribedDriver("xpu", "xpu"))
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert general_info(XPU0).triton_backend is None
    assert general_info(torch.device("cpu")).triton_backend == "interpreter"


def test_normalise_fills_the_index_and_reads_ints_as_accelerator_indices():
    assert normalise("cpu") == torch.device("cpu")
    assert normalise("xpu:1") == torch.device("xpu", 1)
    assert normalise(2).index == 2
    if not torch.accelerator.is_available():
        assert normalise(None) == torch.device("cpu")


# --------------------------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------------------------


def test_the_first_hook_that_recognises_the_device_wins(clean_env):
    describe_to_torch(clean_env, "xpu", name="Contoso X1")
    registry = Registry(load_entry_points=False)
    late, first, other = Detector("Contoso X1", vendor="late"), Detector("Contoso X1", vendor="contoso",
                                                                         warp_size=16), Detector("Other")
    registry.register(late, name="late")
    registry.register(other, name="other")
    registry.register(first, name="first")  # pluggy calls the last registered first
    info = registry.detect_device(XPU0)
    assert (info.vendor, info.warp_size) == ("contoso", 16)
    assert late.seen == [] and len(other.seen) == 0
    assert len(first.seen) == 1 and first.seen[0][0] == XPU0


def test_a_hook_may_take_only_the_arguments_it_needs(clean_env):
    class InfoOnly:
        @hookimpl
        def pagedprefill_detect_device(self, info):
            return info.replace(vendor="contoso") if info.type == "xpu" else None

    registry = Registry(load_entry_points=False)
    registry.register(InfoOnly())
    assert registry.detect_device(XPU0).vendor == "contoso"
    assert registry.detect_device(torch.device("cpu")).vendor == "cpu"


def test_a_hook_that_raises_is_recorded_and_the_others_still_answer(clean_env):
    class Raising:
        @hookimpl
        def pagedprefill_detect_device(self, device):
            raise RuntimeError("vendor runtime missing")

    registry = Registry(load_entry_points=False)
    registry.register(Detector("xpu:0", vendor="contoso"), name="good")
    registry.register(Raising(), name="raising")
    assert registry.detect_device(XPU0).vendor == "contoso"
    assert registry.load_errors["raising"] == "pagedprefill_detect_device raised RuntimeError: vendor runtime missing"


def test_vendor_override_is_seen_by_hooks_and_wins_over_them(clean_env):
    describe_to_torch(clean_env, "cuda", name="Unnamed GPU", major=7, minor=0)
    detector = Detector("Unnamed GPU", vendor="contoso", warp_size=64)
    registry = Registry(load_entry_points=False)
    registry.register(detector)
    assert registry.detect_device(CUDA0).vendor == "contoso"
    clean_env.setenv("PAGEDPREFILL_VENDOR", " Iluvatar ")
    info = registry.detect_device(CUDA0)  # a changed variable is not answered from the cache
    assert detector.seen[-1][1].vendor == "iluvatar"
    assert (info.vendor, info.warp_size) == ("iluvatar", 64)  # the override's vendor, the hook's limits
    assert registry.detect_device(torch.device("cpu")).vendor == "cpu"  # the CPU is never overridden


def test_detection_is_cached_until_plugins_change(clean_env):
    detector = Detector("xpu:0", vendor="contoso")
    registry = Registry(load_entry_points=False)
    registry.register(detector)
    assert registry.detect_device(XPU0) is registry.detect_device(XPU0)
    assert len(detector.seen) == 1
    registry.register(Detector("xpu:0", vendor="newer"), name="newer")
    assert registry.detect_device(XPU0).vendor == "newer"


def test_deviceinfo_detect_asks_the_process_registry(clean_env):
    pp.reset_registry()
    try:
        pp.get_registry().register(Detector("xpu:0", vendor="contoso"), name="contoso-detector")
        assert DeviceInfo.detect("xpu:0").vendor == "contoso"
    finally:
        pp.reset_registry()
    assert DeviceInfo.detect("xpu:0").vendor == "xpu"


@needs_triton
def test_described_device_reports_through_torch_and_triton_then_restores(clean_env):
    from triton.runtime import driver

    before = getattr(driver, "_active", None)
    with described_device("xpu", name="Contoso X1", triton_backend="xpu", max_shared_mem=96 * 1024, num_sms=24,
                          warp_size=16, capability=(1, 2)):
        info = DeviceInfo.detect("xpu:0")
    assert info == DeviceInfo(type="xpu", index=0, vendor="xpu", name="Contoso X1", capability=(1, 2), warp_size=16,
                              num_sms=24, max_shared_mem=96 * 1024, triton_backend="xpu")
    assert getattr(driver, "_active", None) is before
    assert DeviceInfo.detect("xpu:0").name == "xpu:0"  # torch no longer knows the device
