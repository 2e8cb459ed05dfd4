"""This package's detection hook: CUDA-compatible parts without a backend of their own (MetaX) are named,
so NVIDIA-only backends refuse them and the generic backend serves them."""

from __future__ import annotations

import importlib.util

import pagedprefill
import pytest
from pagedprefill import DeviceInfo
from pagedprefill.testing.described import described_device
from pagedprefill_generic.detect import detect_cuda_compatible

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed: the described device would have no Triton target")


@needs_triton
def test_a_metax_part_is_named_and_runs_generic(gpu_env):
    with described_device("cuda", name="MetaX C500", capability=(8, 0), num_sms=104, triton_backend="cuda",
                          max_shared_mem=64 * 1024, warp_size=64):
        info = DeviceInfo.detect("cuda:0")
        rows = {row.name: row for row in pagedprefill.get_registry().status(info)}
        chosen = pagedprefill.select_backend(info).name
    assert info.vendor == "metax"
    assert chosen == "generic"
    if "sm80" in rows:  # installed alongside: it must not claim a MetaX part of capability 8.0
        assert not rows["sm80"].supported and "'metax'" in rows["sm80"].reasons[0]


def test_only_metax_named_nvidia_views_are_answered():
    general = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0))
    assert detect_cuda_compatible(general) is None
    assert detect_cuda_compatible(general.replace(name="MetaX C500")).vendor == "metax"
    # an explicit PAGEDPREFILL_VENDOR (already in the vendor) and other device types are left alone
    assert detect_cuda_compatible(general.replace(name="MetaX C500", vendor="amd")) is None
    assert detect_cuda_compatible(DeviceInfo(type="xpu", vendor="xpu", name="MetaX xpu", index=0)) is None
