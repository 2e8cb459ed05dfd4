"""``ci/detect_target.py bi100`` (which decides whether the ``bi100`` nox session runs) asks this backend's
``supports()`` on the device as detected through the plugins: present on an Iluvatar part, absent elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pagedprefill.testing.described import described_device

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "detect_target.py"
# Every test asks as on a GPU machine (pagedprefill's pytest plugin: no interpreter, no forced vendor or backend).
pytestmark = pytest.mark.usefixtures("gpu_env")


@pytest.fixture(scope="module")
def detect_target():
    if not SCRIPT.is_file():
        pytest.skip(f"{SCRIPT} is not in this checkout (the package was installed without the repository)")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: a described device would have no Triton target")
    spec = importlib.util.spec_from_file_location("detect_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_present_on_an_iluvatar_part(detect_target, capsys):
    with described_device("cuda", name="Iluvatar BI-V150", capability=(7, 1), num_sms=16, triton_backend="corex"):
        assert detect_target("bi100", "cuda:0") == 0
    assert capsys.readouterr().out.startswith("present: bi100 runs on Iluvatar BI-V150 (cuda:0), vendor=iluvatar")


def test_absent_on_an_nvidia_v100_with_the_backends_reason(detect_target, capsys):
    with described_device("cuda", name="Tesla V100-SXM2-32GB", capability=(7, 0), num_sms=80, triton_backend="cuda",
                          max_shared_mem=96 * 1024, warp_size=32):
        assert detect_target("bi100", "cuda:0") == 3
    out = capsys.readouterr().out
    assert out.startswith("absent: the bi100 backend cannot run on Tesla V100-SXM2-32GB")
    assert "for Iluvatar CoreX GPUs only" in out


def test_absent_on_the_cpu(detect_target, capsys):
    assert detect_target("bi100", "cpu") == 3
    assert capsys.readouterr().out.startswith("absent: no accelerator visible to torch")
