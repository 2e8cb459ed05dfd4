"""A ``device`` argument naming a device this process cannot use is refused up front, by name.

torch's own errors for an absent device (``Torch not compiled with CUDA enabled``, ``Found no NVIDIA
driver``) name no argument, and selection for an absent device used to answer with the reference backend.
"""

from __future__ import annotations

import re

import pagedprefill as pp
import pytest
import torch
from pagedprefill.placement import require_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: these are errors of "
                                                                "machines without one")


def _absent_cuda_pattern(name: str, device: str = "cuda") -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        why = rf"this torch \({re.escape(torch.__version__)}\) is built without CUDA; install a CUDA build of torch"
    else:
        why = r"no CUDA device is visible \(check the driver and CUDA_VISIBLE_DEVICES\)"
    return rf"^{name}: expected a device this process can use, got '{device}': {why}, or pass {name}='cpu'$"


@no_cuda
@pytest.mark.parametrize("call", ["from_lengths", "allocate_cache", "select_backend"])
def test_absent_cuda_device_is_named(call):
    table = torch.zeros(2, 1, dtype=torch.int32)
    calls = {
        "from_lengths": lambda: pp.BatchMetadata.from_lengths([3, 1], [0, 2], table, device="cuda"),
        "allocate_cache": lambda: pp.allocate_cache(4, 8, 1, 16, device="cuda"),
        "select_backend": lambda: pp.select_backend("cuda"),
    }
    with pytest.raises(pp.DeviceUnavailableError, match=_absent_cuda_pattern("device")) as raised:
        calls[call]()
    # Both kinds a caller may catch: a bad argument, and no backend for the device.
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, pp.BackendUnavailableError)


@no_cuda
def test_an_index_is_a_device_of_the_accelerator():
    if torch.accelerator.is_available():
        pytest.skip(f"an accelerator ({torch.accelerator.current_accelerator()}) is available: index 0 is present")
    # A CPU build of torch has no accelerator for the index; a CUDA build reads it as cuda:0, which is absent.
    with pytest.raises(pp.DeviceUnavailableError, match=r"^device: expected a device this process can use, got "
                       r"(0 \(an index of the accelerator\): this torch \(.*\) sees no accelerator; |'cuda:0': .*, or )"
                       r"pass device='cpu'$"):
        pp.select_backend(0)


@pytest.mark.parametrize("value, error, pattern", [
    ("gpu7", ValueError, r"^device: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got 'gpu7'$"),
    (2.5, TypeError, r"^device: expected a torch device, a device string .*, got float$"),
    (True, TypeError, r"^device: expected a torch device, a device string .*, got bool$"),
])
def test_a_device_that_is_no_device(value, error, pattern):
    with pytest.raises(error, match=pattern):
        require_device("device", value)
    with pytest.raises(error, match=pattern):
        pp.allocate_cache(4, 8, 1, 16, device=value)


def test_present_devices_are_accepted():
    assert require_device("device", "cpu") == torch.device("cpu")
    assert require_device("device", torch.device("meta")) == torch.device("meta")
    assert pp.allocate_cache(4, 8, 1, 16, device="cpu").key.device.type == "cpu"
    assert pp.select_backend("cpu") is pp.select_backend(torch.device("cpu"))


def test_a_described_device_is_not_checked():
    """A hand-written DeviceInfo describes hardware that need not be present (``info --describe``, policies)."""
    h200 = pp.DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0),
                         num_sms=132, max_shared_mem=227 * 1024, triton_backend="cuda")
    assert pp.select_backend(h200).name  # answers, whatever is installed

