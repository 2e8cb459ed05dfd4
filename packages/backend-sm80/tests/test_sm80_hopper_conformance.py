"""The core conformance suite on the sm80 backend with its Hopper kernel forced (an sm90 GPU).

Under ``PAGEDPREFILL_SM80_KERNEL=hopper`` the policy runs every call the Hopper kernel takes on it, and the
rest on the portable kernel. The suite's cases mostly use head size 32 and block size 8, which the Hopper
kernel does not take, so here each case that keeps the suite's default head size runs with head size 128
(even seeds) or 64 (odd seeds) instead, and block size 16 instead of 8: the same lengths, features, layouts
and dtypes, on the Hopper kernel wherever those allow it. ``test_sm80_conformance.py`` runs the cases as
written on the portable kernel.

``PAGEDPREFILL_TEST_HOPPER_SCHEDULE`` (e.g. ``PINGPONG=1,TURNS=1``) runs the suite with those schedule flags of
the kernel over its defaults (:data:`pagedprefill_sm80.hopper.launch.SCHEDULE`) and the policy's per-route flags:
added to ``PAGEDPREFILL_SM80_SCHEDULE``, which sets them for any process.
"""

import os

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.testing import ConformanceSuite
from pagedprefill.testing.cases import BASE
from pagedprefill.workloads import BatchSpec
from pagedprefill_sm80.hopper import launch
from pagedprefill_sm80.policy import KERNEL_ENV

SCHEDULE_ENV = "PAGEDPREFILL_TEST_HOPPER_SCHEDULE"


def hopper_head_size(spec: BatchSpec, seed: int) -> BatchSpec:
    """``spec`` with the suite's default head size and block size replaced by ones the Hopper kernel takes on
    both layouts."""
    if spec.block_size == BASE.block_size:
        spec = spec.replace(block_size=16)
    if spec.head_size != BASE.head_size:
        return spec
    return spec.replace(head_size=128 if seed % 2 == 0 else 64)


class TestSm80HopperConformance(ConformanceSuite):
    backend = "sm80"

    @pytest.fixture(autouse=True)
    def hopper_kernel(self, monkeypatch):
        monkeypatch.setenv(KERNEL_ENV, "hopper")
        flags = os.environ.get(SCHEDULE_ENV, "")
        launch.parse_schedule(flags)  # a bad flag fails here, naming it
        if flags:
            monkeypatch.setenv(launch.SCHEDULE_ENV,
                               ",".join(filter(None, (os.environ.get(launch.SCHEDULE_ENV), flags))))

    def case_spec(self, case: str, size: str, seed: int) -> BatchSpec:
        return hopper_head_size(super().case_spec(case, size, seed), seed)

    def sweep_spec(self, seed: int, size: str, dtypes: tuple) -> BatchSpec:
        return hopper_head_size(super().sweep_spec(seed, size, dtypes), seed)

    def device_info(self, device: torch.device) -> DeviceInfo:
        if device.type == "cpu":
            pytest.skip("the Hopper kernel is written in Gluon, which Triton's CPU interpreter does not run; "
                        "it is checked on sm90 GPUs")
        info = DeviceInfo.detect(device)
        if info.vendor != "nvidia" or info.capability != (9, 0):
            pytest.skip(f"the Hopper kernel needs an sm90 GPU, found {info.describe()}")
        return info
