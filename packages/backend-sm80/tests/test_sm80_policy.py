"""Policy and device checks of the sm80 backend on described devices (no GPU needed)."""

import json

import pytest
import torch
from pagedprefill import DeviceInfo, select_backend
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.tuning import forget_tables, table_key, user_table_path
from pagedprefill_sm80 import Sm80Backend, sm80_policy
from pagedprefill_sm80.policy import KERNEL_ENV, hopper_config, rule_config


@pytest.fixture(autouse=True)
def _described_gpus_need_no_interpreter(monkeypatch):
    """These tests describe GPUs; Triton's interpreter (set for the kernel tests) would veto every GPU. The
    kernel preference of the environment (a GPU run may force the Hopper kernel) is the default here."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(KERNEL_ENV, raising=False)


def nvidia(cap, smem, name="NVIDIA X"):
    return DeviceInfo(type="cuda", index=0, vendor="nvidia", name=name, capability=cap, warp_size=32, num_sms=100,
                      max_shared_mem=smem, triton_backend="cuda")


A100 = nvidia((8, 0), 163 * 1024, "A100")
L40 = nvidia((8, 9), 99 * 1024, "L40")
H200 = nvidia((9, 0), 227 * 1024, "H200")
V100 = nvidia((7, 0), 96 * 1024, "Tesla V100")
ILUVATAR_FUTURE = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar future", capability=(8, 0),
                             warp_size=64, num_sms=16, max_shared_mem=128 * 1024, triton_backend="cuda")
METAX = DeviceInfo(type="cuda", index=0, vendor="metax", name="MetaX C500", capability=(8, 0), warp_size=64,
                   num_sms=104, max_shared_mem=64 * 1024, triton_backend="cuda")


@pytest.mark.parametrize("device", [A100, L40, H200])
def test_supports_nvidia_sm80_and_newer(device):
    assert Sm80Backend().supports(device) == []
    assert select_backend(device).name == "sm80"


@pytest.mark.parametrize("device,needle", [(V100, "capability >= 8.0"), (ILUVATAR_FUTURE, "vendor is 'iluvatar'"),
                                           (METAX, "vendor is 'metax'")])
def test_rejects_by_vendor_and_capability(device, needle):
    reasons = Sm80Backend().supports(device)
    assert reasons and any(needle in r for r in reasons), reasons
    assert select_backend(device).name != "sm80"


@pytest.mark.parametrize("device", [A100, L40, H200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [1, 16, 64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("workload", [dict(num_tokens=64 * 128, num_seqs=64), dict(num_tokens=16384, num_seqs=2)])
def test_every_tile_fits_the_device(device, dtype, head_size, workload):
    shape = ProblemShape(head_size, 32, 8, dtype, **workload)
    cfg = sm80_policy(shape, device)
    assert cfg.shared_mem_bytes(head_size, shape.element_size) <= device.max_shared_mem
    assert cfg.num_stages >= 1 and cfg.num_warps in (1, 2, 4, 8, 16)


def test_user_tuned_table_takes_precedence(tmp_path, monkeypatch):
    """For the portable kernel's tiles (the ones ``pagedprefill tune`` measures)."""
    monkeypatch.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path))
    monkeypatch.setenv(KERNEL_ENV, "portable")
    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    before = sm80_policy(shape, H200)
    tuned = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, heads_per_tile=4)
    assert tuned != before
    path = user_table_path("sm80", H200)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": {table_key(shape, H200): tuned.to_dict()}}))
    forget_tables()  # written behind the policy's back, as another process would
    assert sm80_policy(shape, H200) == tuned
    other = ProblemShape(64, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    assert sm80_policy(other, H200) != tuned  # other keys still come from the rules


def test_tuned_table_leaves_the_hopper_kernel_its_tile(tmp_path, monkeypatch):
    """A tuned table holds portable-kernel tiles: where the Hopper kernel runs, it keeps its own tile."""
    monkeypatch.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path))
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    tuned = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, heads_per_tile=4)
    path = user_table_path("sm80", H200)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": {table_key(shape, H200): tuned.to_dict()}}))
    forget_tables()
    assert sm80_policy(shape, H200) == hopper_config(shape)


def test_search_space_fits_and_is_declared():
    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    space = Sm80Backend().search_space(shape, L40)
    assert len(space) >= 4 and len(set(space)) == len(space)
    assert all(c.fits(128, 2, L40) for c in space)
    assert {c.heads_per_tile for c in space} == {1, 2}  # packed and unpacked GQA for a long workload
    h200 = Sm80Backend().search_space(shape, H200)
    # small enough that the default keys tune in minutes (each candidate is a compile of a few seconds)
    assert 8 <= len(h200) <= 20
    assert sm80_policy(shape, H200) in h200 or rule_config(shape, H200) in h200
