"""The core conformance suite on the bi100 backend, with the BI-V100 policy forced.

The backend runs directly (selection bypassed) on the suite's device: Triton's interpreter on the CPU, or
a GPU, where the described BI-V100 makes core's kernel run with the tiles this backend picks on a BI-V100.
"""

import torch
from pagedprefill import DeviceInfo, get_registry
from pagedprefill.features import missing_features
from pagedprefill.testing import ConformanceSuite, make_problem
from pagedprefill_bi100 import described_devices

NO_FP8 = "Triton on Iluvatar CoreX has no FP8: the bi100 backend refuses FP8 KV caches"


class TestBi100Conformance(ConformanceSuite):
    backend = "bi100"
    #: every case and sweep problem with an FP8 cache, whatever its name
    excluded_kv_cache_dtypes = {"fp8_e4m3": NO_FP8, "fp8_e5m2": NO_FP8}

    def device_info(self, device: torch.device) -> DeviceInfo:
        # The tensors stay on ``device``; only the policy sees a BI-V100.
        return described_devices()["BI-V100"]


def test_every_sweep_case_is_one_bi100_runs():
    """The sweep draws no FP8 cache and no FP8 output, so on the CPU all of its cases are computed (drawn from
    every format, five of the eight parts held only FP8 cases and skipped)."""
    suite, cpu = TestBi100Conformance(), torch.device("cpu")
    for seed in range(1000, 1000 + 8 * 3):
        spec = suite.sweep_spec(seed, "small", (torch.float16, torch.float32))
        assert suite._skip_reason(spec, cpu) is None, spec.describe()
        assert not missing_features(get_registry().get("bi100"), make_problem(spec, cpu)), spec.describe()
