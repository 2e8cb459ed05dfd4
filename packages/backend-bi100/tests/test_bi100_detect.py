"""This package's detection hook: Iluvatar parts are told apart from NVIDIA's, and get the table's limits.

Devices are described to torch and Triton (:func:`pagedprefill.testing.described.described_device`), so
``DeviceInfo.detect`` runs as on a machine that has them: core's general view, then every installed
plugin's hook.
"""

from __future__ import annotations

import importlib.util

import pagedprefill
import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.testing.described import described_device
from pagedprefill_bi100.detect import detect_iluvatar, is_iluvatar

KiB = 1024
CUDA0 = torch.device("cuda", 0)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed: the described device would have no Triton target")


@needs_triton
@pytest.mark.parametrize(("name", "capability", "smem"), [("Iluvatar BI-V100", (7, 0), 48 * KiB),
                                                          ("Iluvatar BI-V150", (7, 1), 128 * KiB),
                                                          ("Iluvatar MR-V50", (7, 1), 128 * KiB)])
def test_iluvatar_parts_are_detected_with_the_table_limits_and_choose_bi100(gpu_env, name, capability, smem):
    # The runtime reports neither shared memory nor warp size: devices.json fills both.
    with described_device("cuda", name=name, capability=capability, num_sms=16, triton_backend="corex"):
        info = DeviceInfo.detect("cuda:0")
        chosen = pagedprefill.select_backend(info).name
    assert (info.vendor, info.max_shared_mem, info.warp_size) == ("iluvatar", smem, 64)
    assert info.triton_backend == "corex"
    assert chosen == "bi100"


@needs_triton
def test_what_the_runtime_reports_wins_over_the_table(gpu_env):
    with described_device("cuda", name="Iluvatar BI-V150", capability=(7, 1), triton_backend="cuda",
                          max_shared_mem=96 * KiB, warp_size=64):
        info = DeviceInfo.detect("cuda:0")
    assert (info.vendor, info.max_shared_mem) == ("iluvatar", 96 * KiB)


@needs_triton
def test_an_nvidia_v100_is_not_taken_for_a_bi_v100(gpu_env):
    with described_device("cuda", name="Tesla V100-SXM2-32GB", capability=(7, 0), num_sms=80, triton_backend="cuda",
                          max_shared_mem=96 * KiB, warp_size=32):
        info = DeviceInfo.detect("cuda:0")
        rows = {row.name: row for row in pagedprefill.get_registry().status(info)}
    assert info.vendor == "nvidia"
    assert not rows["bi100"].supported
    assert "set PAGEDPREFILL_VENDOR=iluvatar" in rows["bi100"].reasons[0]


@needs_triton
def test_vendor_override_makes_an_unrecognised_part_iluvatar(gpu_env):
    gpu_env.setenv("PAGEDPREFILL_VENDOR", "iluvatar")
    with described_device("cuda", name="GPU 0", capability=(7, 0), triton_backend="cuda"):
        info = DeviceInfo.detect("cuda:0")
        chosen = pagedprefill.select_backend(info).name
    # the hook saw the override and filled the limits of the 7.0 architecture from the table
    assert (info.vendor, info.max_shared_mem, info.warp_size, chosen) == ("iluvatar", 48 * KiB, 64, "bi100")


@pytest.mark.parametrize("signal", ["version", "module"])
def test_a_corex_build_of_torch_marks_its_cuda_devices(gpu_env, signal):
    general = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="GPU 0", capability=(7, 1), warp_size=0)
    assert not is_iluvatar(general)
    if signal == "version":
        gpu_env.setattr(torch, "__version__", "2.4.1+corex.4.3.0")
    else:
        gpu_env.setattr(torch, "corex", object(), raising=False)
    found = detect_iluvatar(general)
    assert found is not None and found.vendor == "iluvatar"
    assert (found.max_shared_mem, found.warp_size) == (128 * KiB, 64)  # ivcore11 by capability


def test_other_device_types_are_never_iluvatar(gpu_env):
    gpu_env.setattr(torch, "corex", object(), raising=False)
    assert detect_iluvatar(DeviceInfo(type="cpu", vendor="cpu", name="Iluvatar host")) is None
    assert detect_iluvatar(DeviceInfo(type="xpu", vendor="xpu", name="Iluvatar-named xpu", index=0)) is None

