"""Fixtures of the GPU tests. Each test skips, printing the reason, where its hardware is absent.

Run them with ``pytest packages/core/tests/gpu --pagedprefill-device=cuda`` (or ``nox -s production``); they use
the backend selected for the GPU (``sm80`` on NVIDIA sm80+).
"""

from __future__ import annotations

import pagedprefill as pp
import pytest
import torch
from pagedprefill.device import interpreter_enabled

HOW_TO_RUN = "pytest packages/core/tests/gpu --pagedprefill-device=cuda (or nox -s production) on a GPU machine"


@pytest.fixture(scope="session")
def gpu(pagedprefill_device) -> torch.device:
    """The CUDA device of the run, with its index."""
    if pagedprefill_device.type != "cuda":
        pytest.skip(f"needs a CUDA GPU, the test device is {pagedprefill_device} "
                    f"(torch {torch.__version__} sees {torch.cuda.device_count()} GPUs); run: {HOW_TO_RUN}")
    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is set: Triton would run on the CPU, not on the GPU")
    index = pagedprefill_device.index if pagedprefill_device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


@pytest.fixture(scope="session")
def gpu_backend(gpu) -> pp.Backend:
    """The backend selected for the GPU; skips when only the reference fits (no Triton backend installed)."""
    backend = pp.select_backend(gpu)
    if backend.name == "reference":
        info = pp.DeviceInfo.detect(gpu)
        reasons = "; ".join(f"{b.name}: {', '.join(b.supports(info)) or 'supported'}" for b in pp.available_backends())
        pytest.skip(f"no Triton backend was selected for {info.describe()} ({reasons}); install "
                    "./packages/backend-generic and ./packages/backend-sm80 from the repository")
    return backend


def pytest_generate_tests(metafunc):
    """Tests taking ``offered_backend`` run once per installed Triton backend (a new backend is covered without
    editing the test); :func:`offered_backend` skips those the GPU does not offer, with their reasons."""
    if "offered_backend_name" in metafunc.fixturenames:
        names = [b.name for b in pp.available_backends() if b.name != "reference"]
        metafunc.parametrize("offered_backend_name", names or ["(no Triton backend installed)"])


@pytest.fixture
def offered_backend(gpu, offered_backend_name) -> pp.Backend:
    """One Triton backend that supports the GPU (as selection would accept it), by name."""
    if offered_backend_name not in {b.name for b in pp.available_backends()}:
        pytest.skip("no Triton backend installed: install ./packages/backend-generic and ./packages/backend-sm80")
    backend = pp.get_registry().get(offered_backend_name)
    info = pp.DeviceInfo.detect(gpu)
    reasons = backend.supports(info)
    if reasons:
        pytest.skip(f"backend {backend.name!r} is not offered on {info.describe()}: {'; '.join(reasons)}")
    return backend


@pytest.fixture(scope="session")
def two_gpus(gpu) -> tuple[torch.device, torch.device]:
    """cuda:0 and cuda:1."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {n}")
    return torch.device("cuda", 0), torch.device("cuda", 1)
