"""The bi100 backend on described devices: which devices it accepts, what selection picks, and its tiles."""

from __future__ import annotations

import dataclasses
from importlib import metadata

import pagedprefill
import pytest
import torch
from pagedprefill import DeviceInfo, ProblemShape, UnsupportedFeatureError
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill_bi100 import bi100_policy, described_devices, device_limits

KiB = 1024


def policy_tile_fits(shape: ProblemShape, device: DeviceInfo) -> bool:
    """Whether the policy's tile for ``shape`` fits the shared memory it plans with (the device's, else the
    table's)."""
    need = bi100_policy(shape, device).shared_mem_bytes(shape.head_size, shape.element_size)
    return need <= device_limits(device).max_shared_mem


BI_V100 = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar BI-V100", capability=(7, 0),
                     warp_size=64, num_sms=16, max_shared_mem=48 * KiB, triton_backend="cuda")
BI_V150 = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar BI-V150", capability=(7, 1),
                     warp_size=64, num_sms=16, max_shared_mem=128 * KiB, triton_backend="corex")
V100 = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="Tesla V100-SXM2-32GB", capability=(7, 0),
                  warp_size=32, num_sms=80, max_shared_mem=96 * KiB, triton_backend="cuda")
A100 = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA A100-SXM4-80GB", capability=(8, 0),
                  warp_size=32, num_sms=108, max_shared_mem=163 * KiB, triton_backend="cuda")
# Iluvatar devices whose runtime reported no shared memory (nor SM count): the table fills in.
BI_V150_UNREPORTED = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar BI-V150",
                                capability=(7, 1), warp_size=64, max_shared_mem=0, triton_backend="corex")
ILUVATAR_7_0_UNNAMED = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar GPU", capability=(7, 0),
                                  warp_size=64, max_shared_mem=0, triton_backend="cuda")
ILUVATAR_FUTURE = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar (future part)",
                             capability=(8, 0), warp_size=64, max_shared_mem=0, triton_backend="corex")
ILUVATAR_UNKNOWN_CAP = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar X", capability=(9, 2),
                                  warp_size=0, num_sms=0, max_shared_mem=0, triton_backend="corex")

#: device -> (is Iluvatar, shared memory per block the tiles must fit, table stage limit)
DEVICES = {
    "bi-v100": (BI_V100, True, 48 * KiB, 1),
    "bi-v150": (BI_V150, True, 128 * KiB, 2),
    "nvidia-v100": (V100, False, 96 * KiB, 1),
    "nvidia-a100": (A100, False, 163 * KiB, 2),
    "bi-v150-unreported": (BI_V150_UNREPORTED, True, 128 * KiB, 2),
    "iluvatar-7.0-unnamed": (ILUVATAR_7_0_UNNAMED, True, 48 * KiB, 1),
    "iluvatar-future-8.0": (ILUVATAR_FUTURE, True, 48 * KiB, 2),
    "iluvatar-unknown-9.2": (ILUVATAR_UNKNOWN_CAP, True, 48 * KiB, 1),
}
ILUVATAR = [name for name, row in DEVICES.items() if row[1]]
OTHERS = [name for name, row in DEVICES.items() if not row[1]]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture
def gpu_selection(monkeypatch):
    """Selection as on a GPU machine: no interpreter, no backend forced, no cached choices."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pagedprefill.ENV_BACKEND, raising=False)
    pagedprefill.reset_registry()
    yield
    pagedprefill.reset_registry()


def bi100():
    return pagedprefill.get_registry().get("bi100")


def test_plugin_is_discovered_through_its_entry_point():
    names = {ep.name: ep.value for ep in metadata.entry_points(group=pagedprefill.ENTRY_POINT_GROUP)}
    assert names.get("bi100") == "pagedprefill_bi100.plugin"
    backend = bi100()
    assert backend.priority == 200 and backend.runs_in_interpreter is False


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_supports_only_iluvatar(name, gpu_selection):
    device, is_iluvatar, _, _ = DEVICES[name]
    reasons = bi100().supports(device)
    if is_iluvatar:
        assert reasons == []
    else:
        assert reasons, f"bi100 must reject {device.name}"
        text = " ".join(reasons)
        assert "Iluvatar" in text and repr(device.vendor) in text


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_selection_picks_bi100_for_iluvatar_only(name, gpu_selection):
    device, is_iluvatar, _, _ = DEVICES[name]
    chosen = pagedprefill.select_backend(device)
    if is_iluvatar:
        assert chosen.name == "bi100"
    else:
        assert chosen.name != "bi100"


@pytest.mark.parametrize("name", sorted(ILUVATAR))
def test_bi100_outranks_generic(name, gpu_selection):
    try:
        generic = pagedprefill.get_registry().get("generic")
    except pagedprefill.BackendUnavailableError:
        pytest.skip("pagedprefill-generic is not installed")
    device = DEVICES[name][0]
    assert generic.supports(device) == [], "generic accepts any device Triton has a driver for"
    assert bi100().priority > generic.priority
    assert pagedprefill.select_backend(device).name == "bi100"


def test_rejects_the_cpu(gpu_selection):
    reasons = bi100().supports(DeviceInfo(type="cpu", vendor="cpu", name="cpu", triton_backend="interpreter"))
    assert reasons and "GPU" in " ".join(reasons)


def test_rejects_devices_without_a_triton_driver(gpu_selection):
    assert bi100().supports(DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar BI-V100",
                                       capability=(7, 0), warp_size=64, triton_backend=None))


def cannot_fit(shape: ProblemShape, smem: int) -> bool:
    """The one combination no legal tile fits in 48 KiB: float32 with head sizes padded to 256."""
    return shape.element_size == 4 and shape.head_size_padded == 256 and smem < 64 * KiB


@pytest.mark.parametrize("name", sorted(DEVICES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_tile_fits(name, dtype):
    """Head sizes 1..256, every dtype, MHA and GQA, short and long calls: fits, <= 2 stages, 2^k warps."""
    device, _, smem, max_stages = DEVICES[name]
    elem = torch.empty((), dtype=dtype).element_size()
    workloads = [
        {},                                                                  # nothing known about lengths
        {"num_tokens": 8, "num_seqs": 8, "max_query_len": 1},                # decode-like rows
        {"num_tokens": 4096, "num_seqs": 2, "max_query_len": 2048},          # long prefill
    ]
    for heads, kv_heads in ((8, 8), (12, 4), (32, 8), (8, 1)):
        for extra in workloads:
            for head_size in range(1, 257):
                shape = ProblemShape(head_size=head_size, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype,
                                     **extra)
                cfg = bi100_policy(shape, device)
                label = f"{name} D={head_size} {dtype} H={heads}/{kv_heads} {extra}: {cfg}"
                assert 1 <= cfg.num_stages <= min(2, max_stages), label
                assert cfg.num_warps & (cfg.num_warps - 1) == 0 and 1 <= cfg.num_warps <= 8, label
                assert cfg.block_m % cfg.heads_per_tile == 0, label
                assert cfg.heads_per_tile <= shape.group_size, label
                assert cfg.split_masks, label
                if cannot_fit(shape, smem):
                    assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (16, 16, 1), label
                    assert not policy_tile_fits(shape, device), label
                else:
                    assert cfg.shared_mem_bytes(head_size, elem) <= smem, label
                    assert policy_tile_fits(shape, device), label


def test_float32_beyond_head_size_128_is_refused_on_bi_v100_only():
    problem = make_problem(BatchSpec(query_lens=(3,), context_lens=(5,), num_heads=2, num_kv_heads=1,
                                     head_size=192, dtype=torch.float32), "cpu")
    with pytest.raises(UnsupportedFeatureError) as err:
        bi100().check_problem(problem, BI_V100)
    message = str(err.value)
    assert "head_size 192 with float32" in message and "shared memory" in message
    assert "Iluvatar BI-V100 has 49152 per block" in message
    assert "float16/bfloat16" in message and "reference" in message
    bi100().check_problem(problem, BI_V150)


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_common_head_sizes_on_bi_v100(head_size, dtype):
    shape = ProblemShape(head_size=head_size, num_heads=32, num_kv_heads=8, dtype=dtype)
    cfg = bi100_policy(shape, BI_V100)
    if cannot_fit(shape, BI_V100.max_shared_mem):
        assert not policy_tile_fits(shape, BI_V100)  # refused: float32 with a head size above 128
        return
    assert cfg.fits(head_size, shape.element_size, BI_V100)
    assert cfg.num_stages == 1, "no pipelining on capability 7.0 (async copy is off)"
    assert cfg.num_warps * 64 <= 256


def test_starting_tiles_are_those_used_on_this_hardware():
    fp16 = lambda d: bi100_policy(ProblemShape(head_size=d, num_heads=8, num_kv_heads=8, dtype=torch.float16),
                                  BI_V100)
    assert (fp16(64).block_m, fp16(64).block_n, fp16(64).num_warps) == (64, 64, 4)
    assert (fp16(128).block_m, fp16(128).block_n, fp16(128).num_warps) == (64, 32, 4)
    fp32 = bi100_policy(ProblemShape(head_size=64, num_heads=8, num_kv_heads=8, dtype=torch.float32), BI_V100)
    assert (fp32.block_m, fp32.block_n) == (32, 32)


def test_two_stages_on_ivcore11_only():
    shape = ProblemShape(head_size=128, num_heads=32, num_kv_heads=8, dtype=torch.bfloat16)
    assert bi100_policy(shape, BI_V150).num_stages == 2
    assert bi100_policy(shape, BI_V150_UNREPORTED).num_stages == 2
    assert bi100_policy(shape, BI_V100).num_stages == 1
    assert bi100_policy(shape, ILUVATAR_7_0_UNNAMED).num_stages == 1


def test_head_size_256_is_shrunk_on_bi_v100_and_not_on_bi_v150():
    shape = ProblemShape(head_size=256, num_heads=8, num_kv_heads=8, dtype=torch.float16)
    start = pagedprefill.TileConfig(block_m=64, block_n=32).shared_mem_bytes(256, 2)
    small = bi100_policy(shape, BI_V100)
    big = bi100_policy(shape, BI_V150)
    assert small.shared_mem_bytes(256, 2) <= 48 * KiB < start
    assert (big.block_m, big.block_n, big.num_stages) == (64, 32, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "expected"), [(8, 8, 1), (16, 8, 2), (24, 8, 2), (32, 8, 4),
                                                             (8, 1, 4), (48, 8, 4)])
def test_gqa_packing_is_a_power_of_two_within_the_group(heads, kv_heads, expected):
    cfg = bi100_policy(ProblemShape(head_size=128, num_heads=heads, num_kv_heads=kv_heads, dtype=torch.float16),
                       BI_V100)
    assert cfg.heads_per_tile == expected
    assert cfg.block_m % cfg.heads_per_tile == 0


def test_decode_like_calls_get_small_tiles():
    shape = ProblemShape(head_size=128, num_heads=8, num_kv_heads=8, dtype=torch.float16, num_tokens=64,
                         num_seqs=64, max_query_len=1)
    assert bi100_policy(shape, BI_V100).block_m == 16
    gqa = ProblemShape(head_size=128, num_heads=32, num_kv_heads=8, dtype=torch.float16, num_tokens=64,
                       num_seqs=64, max_query_len=1)
    cfg = bi100_policy(gqa, BI_V100)
    assert cfg.block_m == 16 and cfg.heads_per_tile == 4


def test_small_grids_are_spread_over_the_sms():
    shape = ProblemShape(head_size=64, num_heads=1, num_kv_heads=1, dtype=torch.float16, num_tokens=256,
                         num_seqs=1, max_query_len=256)
    assert bi100_policy(shape, BI_V100).block_m == 32  # 256 / 64 + 1 = 5 programs < 16 SMs


def test_table_fills_in_what_the_runtime_does_not_report():
    limits = device_limits(BI_V150_UNREPORTED)
    assert (limits.arch, limits.matched_by, limits.max_shared_mem) == ("ivcore11", "name", 128 * KiB)
    assert "max_shared_mem" in limits.from_table and "num_sms" in limits.from_table
    assert limits.num_sms == 16
    assert device_limits(ILUVATAR_7_0_UNNAMED).arch == "ivcore10"
    assert device_limits(ILUVATAR_7_0_UNNAMED).matched_by == "capability"
    assert device_limits(ILUVATAR_FUTURE).arch == "ivcore20"
    unknown = device_limits(ILUVATAR_UNKNOWN_CAP)
    assert (unknown.arch, unknown.max_shared_mem, unknown.warp_size, unknown.max_stages) == \
        ("default", 48 * KiB, 64, 1)


def test_reported_values_win_over_the_table():
    bigger = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name="Iluvatar BI-V100", capability=(7, 0),
                        warp_size=64, num_sms=20, max_shared_mem=64 * KiB, triton_backend="cuda")
    limits = device_limits(bigger)
    assert (limits.max_shared_mem, limits.num_sms, limits.from_table) == (64 * KiB, 20, ())
    assert limits.max_stages == 1


@pytest.mark.parametrize(("name", "arch"), [("Iluvatar BI-V100", "ivcore10"), ("Iluvatar BI-V150", "ivcore11"),
                                            ("Iluvatar BI-V150S", "ivcore11"), ("Iluvatar MR-V50", "ivcore11"),
                                            ("iluvatar bi-v150s", "ivcore11")])
def test_parts_are_found_by_name(name, arch):
    # capability (9, 9) matches no architecture, so only the name can find the entry
    device = DeviceInfo(type="cuda", index=0, vendor="iluvatar", name=name, capability=(9, 9), warp_size=64,
                        max_shared_mem=0, triton_backend="corex")
    limits = device_limits(device)
    assert (limits.arch, limits.matched_by) == (arch, "name")


def test_described_devices_are_the_hand_built_ones():
    described = described_devices()
    assert described["BI-V100"] == BI_V100
    assert described["BI-V150"] == dataclasses.replace(BI_V150, triton_backend="cuda")
    assert described_devices("corex")["BI-V150"] == BI_V150
    assert {"BI-V150S", "MR-V50"} <= set(described)
    for device in described.values():
        assert device.vendor == "iluvatar" and device.name.startswith("Iluvatar ")


def _fp8_message(kv_cache_dtype: str) -> str:
    problem = make_problem(BatchSpec(query_lens=(3,), context_lens=(5,), kv_cache_dtype=kv_cache_dtype), "cpu")
    with pytest.raises(UnsupportedFeatureError) as err:
        bi100().check_problem(problem, BI_V100)
    return str(err.value)


@pytest.mark.parametrize(("kv_cache_dtype", "stored"), [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"),
                                                        ("fp8_e5m2", "fp8_e5m2")])
def test_fp8_kv_cache_is_refused_with_alternatives(kv_cache_dtype, stored):
    message = _fp8_message(kv_cache_dtype)
    assert "FP8 KV cache" in message
    assert f"kv_cache_dtype={stored!r}" in message
    assert "no FP8" in message
    assert "kv_cache_dtype='auto'" in message and "fp16" in message and "bf16" in message
    assert "reference" in message


@pytest.mark.parametrize("features", [
    {},
    {"num_heads": 8, "num_kv_heads": 1},
    {"alibi": True, "sliding_window": 7, "softcap": 5.0, "sinks": True},
    {"dtype": torch.bfloat16},
    {"dtype": torch.float32, "head_size": 128},
    {"head_size": 256, "num_heads": 2, "num_kv_heads": 1},
    {"head_size": 80, "block_size": 7, "layout": "split"},
])
def test_other_features_are_accepted(features):
    """Everything but an FP8 cache is accepted on a BI-V100, with a tile that fits its 48 KiB."""
    problem = make_problem(BatchSpec(query_lens=(3, 2), context_lens=(5, 0)).replace(**features), "cpu")
    assert bi100().check_problem(problem, BI_V100) is None  # raises UnsupportedFeatureError when refused
    config = bi100().tile_config(problem_shape(problem), BI_V100)
    assert config.shared_mem_bytes(problem.head_size, problem.q.element_size()) <= BI_V100.max_shared_mem
