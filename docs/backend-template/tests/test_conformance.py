"""mybackend against the reference: core's conformance suite, plus checks of registration and policy.

Run on the backend's hardware with ``pytest tests``; without it, on the CPU with ``TRITON_INTERPRET=1
pytest tests --pagedprefill-device=cpu`` (slow, small cases; the policy then sees a CPU description).
"""

import dataclasses

import pagedprefill
import pytest
import torch
from pagedprefill.device import DeviceInfo, interpreter_enabled
from pagedprefill.testing import ConformanceSuite
from pagedprefill.testing.described import described_device
from pagedprefill.tiling import ProblemShape
from pagedprefill_mybackend import VENDOR, MyBackend, my_policy
from pagedprefill_mybackend.detect import DEVICE_TYPE, NAME_PREFIX, SHARED_MEM

OWN_DEVICE = DeviceInfo(type=DEVICE_TYPE, vendor=VENDOR, name=f"{NAME_PREFIX} 1", index=0, warp_size=32, num_sms=64,
                        max_shared_mem=64 * 1024, triton_backend=DEVICE_TYPE)


class TestMyBackendConformance(ConformanceSuite):
    backend = "mybackend"
    # Every case and sweep problem whose cache format the backend refuses is reported as a skip with the
    # reason (empty as shipped: the template reads every format).
    excluded_kv_cache_dtypes = {fmt: f"mybackend does not read {fmt} KV caches (MyBackend.kv_cache_dtypes)"
                                for fmt in ("fp8_e4m3", "fp8_e5m2") if fmt not in MyBackend.kv_cache_dtypes}
    # Other cases the hardware cannot compute, by name (see pagedprefill.testing.CASES), e.g.:
    # exclusions = {"head_size_256": "no tile of head size 256 fits the shared memory"}

    @pytest.fixture(autouse=True)
    def _needs_a_triton_device(self, pagedprefill_device):
        if pagedprefill_device.type == "cpu" and not interpreter_enabled():
            pytest.skip("on the CPU the Triton kernel runs only in Triton's interpreter: set TRITON_INTERPRET=1")

    def device_info(self, device: torch.device) -> DeviceInfo:
        """What the backend is told about the device: the real one, or a description under the interpreter."""
        if device.type == "cpu":
            return OWN_DEVICE  # the kernels run in the interpreter; the policy plans for the target hardware
        info = DeviceInfo.detect(device)
        reasons = MyBackend().supports(info)
        if reasons:
            pytest.skip(f"mybackend cannot run on {info.describe()}: {'; '.join(reasons)}")
        return info


#: The generic backend's priority: it runs on any device with a Triton driver, the backend's own included.
GENERIC_PRIORITY = 100


def test_registered_through_the_entry_point_and_chosen_on_its_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # selection for the device itself, not the interpreter
    backend = pagedprefill.get_registry().get("mybackend")
    assert isinstance(backend, MyBackend)
    assert backend.priority > GENERIC_PRIORITY  # 150 as shipped; 200 or more for a finished backend
    assert pagedprefill.select_backend(OWN_DEVICE).name == "mybackend"


def test_supports_only_its_own_vendor():
    other = DeviceInfo(type="cuda", vendor="nvidia", name="NVIDIA H200", index=0, capability=(9, 0),
                       num_sms=132, max_shared_mem=227 * 1024, triton_backend="cuda")
    assert MyBackend().supports(other) != []
    assert MyBackend().supports(DeviceInfo(type="cpu", vendor="cpu", name="cpu")) != []
    assert MyBackend().hardware_reasons(OWN_DEVICE) == []
    small = dataclasses.replace(OWN_DEVICE, max_shared_mem=16 * 1024)
    assert any("shared memory" in reason for reason in MyBackend().hardware_reasons(small))


def test_detection_recognises_the_hardware_by_name(monkeypatch):
    monkeypatch.delenv("PAGEDPREFILL_VENDOR", raising=False)
    # torch reports the device (its runtime does not report shared memory): the hook names it and fills it in
    with described_device(DEVICE_TYPE, name=f"{NAME_PREFIX} 1", num_sms=64):
        info = DeviceInfo.detect(f"{DEVICE_TYPE}:0")
    assert (info.vendor, info.max_shared_mem) == (VENDOR, SHARED_MEM)
    with described_device(DEVICE_TYPE, name="Another accelerator", num_sms=64):
        assert DeviceInfo.detect(f"{DEVICE_TYPE}:0").vendor != VENDOR


@pytest.mark.parametrize("head_size", [1, 24, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_policy_tiles_fit_shared_memory(head_size, dtype):
    for num_tokens, num_seqs in ((8, 8), (8192, 2)):
        shape = ProblemShape(head_size=head_size, num_heads=32, num_kv_heads=8, dtype=dtype,
                             num_tokens=num_tokens, num_seqs=num_seqs)
        tile = my_policy(shape, OWN_DEVICE)
        assert tile.shared_mem_bytes(head_size, shape.element_size) <= OWN_DEVICE.max_shared_mem, tile
