"""The core conformance suite on the sm80 backend with its Hopper kernel forced (an sm90 GPU).

Every case runs on the kernel the policy picks under ``PAGEDPREFILL_SM80_KERNEL=hopper``: the Hopper kernel
for the shapes it takes, the portable kernel for the rest (those pass through the same checks, and
``test_sm80_conformance.py`` runs every case on the portable kernel as well).
"""

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.testing import ConformanceSuite
from pagedprefill_sm80.policy import KERNEL_ENV


class TestSm80HopperConformance(ConformanceSuite):
    backend = "sm80"

    @pytest.fixture(autouse=True)
    def hopper_kernel(self, monkeypatch, pagedprefill_device):
        monkeypatch.setenv(KERNEL_ENV, "hopper")

    def device_info(self, device: torch.device) -> DeviceInfo:
        if device.type == "cpu":
            pytest.skip("the Hopper kernel is written in Gluon, which Triton's CPU interpreter does not run; "
                        "it is checked on sm90 GPUs")
        info = DeviceInfo.detect(device)
        if info.vendor != "nvidia" or info.capability != (9, 0):
            pytest.skip(f"the Hopper kernel needs an sm90 GPU, found {info.describe()}")
        return info
