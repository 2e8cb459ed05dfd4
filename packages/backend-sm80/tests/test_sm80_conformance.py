"""The core conformance suite on the sm80 backend (an NVIDIA GPU of capability >= 8.0)."""

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.backends.triton_base import e4m3_arguments
from pagedprefill.testing import ConformanceSuite
from pagedprefill.workloads import make_problem


class TestSm80Conformance(ConformanceSuite):
    backend = "sm80"

    def _skip_reason(self, spec, device, case=None):
        if device.type == "cpu" and e4m3_arguments(make_problem(spec)):
            # core's test_fp8_query checks that an A100 refuses them by name; generic's CPU suite runs the same
            # kernel on them.
            return ("e4m3 values (an FP8 q, an e4m3 cache or an FP8 output) need compute capability 8.9 or later "
                    "(Triton has no e4m3 type before it), and the interpreter runs sm80's policy for a described "
                    "A100; GPUs of sm89 and later run these cases")
        return super()._skip_reason(spec, device, case)

    def device_info(self, device: torch.device) -> DeviceInfo:
        if device.type == "cpu":
            # Under the interpreter the kernels run on the CPU; the policy sees a described A100.
            return DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA A100-SXM4-80GB", capability=(8, 0),
                              warp_size=32, num_sms=108, max_shared_mem=163 * 1024, triton_backend="cuda")
        info = DeviceInfo.detect(device)
        if info.vendor != "nvidia" or info.capability < (8, 0):
            pytest.skip(f"sm80 needs an NVIDIA GPU of capability >= 8.0, found {info.describe()}")
        return info
