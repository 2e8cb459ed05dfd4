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
    if cfg.kernel == "hopper":  # measured by that kernel's own model, checked against its compiled kernels
        from pagedprefill_sm80.hopper.schedule import shared_bytes

        assert shared_bytes(shape, cfg) <= device.max_shared_mem
    else:
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


def _write_user_table(tmp_path, monkeypatch, entries: dict) -> None:
    monkeypatch.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path))
    path = user_table_path("sm80", H200)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": {key: cfg.to_dict() for key, cfg in entries.items()}}))
    forget_tables()  # written behind the policy's back, as another process would


def test_tuned_entries_count_only_for_the_kernel_they_were_measured_on(tmp_path, monkeypatch):
    """A portable-kernel entry leaves the Hopper kernel its own tile, a Hopper entry is used where the Hopper
    kernel runs, and ignored where the portable kernel is forced."""
    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    portable = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, heads_per_tile=4)
    _write_user_table(tmp_path, monkeypatch, {table_key(shape, H200): portable})
    assert sm80_policy(shape, H200) == hopper_config(shape)
    hopper = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, heads_per_tile=1, kernel="hopper")
    assert hopper != hopper_config(shape)
    _write_user_table(tmp_path, monkeypatch, {table_key(shape, H200): hopper})
    assert sm80_policy(shape, H200) == hopper
    monkeypatch.setenv(KERNEL_ENV, "portable")
    assert sm80_policy(shape, H200) == rule_config(shape, H200)


def test_a_tuned_hopper_tile_the_kernel_cannot_take_falls_back_to_its_rule(tmp_path, monkeypatch):
    """A table entry that does not fit (here 64 keys in 3 stages at head size 256: 257 KiB of shared memory)
    is not handed to the kernel."""
    shape = ProblemShape(256, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    too_big = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, heads_per_tile=2, kernel="hopper")
    _write_user_table(tmp_path, monkeypatch, {table_key(shape, H200): too_big})
    assert sm80_policy(shape, H200) == hopper_config(shape)


def test_a_tuned_hopper_tile_that_fits_runs_as_measured(tmp_path, monkeypatch):
    """128 keys in 3 stages at head size 128 (225 KiB in the Hopper kernel) is what ``pagedprefill tune`` chose
    for short NHD calls on the H200: the policy hands it over unchanged, not shrunk by the portable kernel's
    shared-memory model (256 KiB for that tile)."""
    from pagedprefill_sm80.hopper.schedule import shared_bytes

    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=64 * 128, num_seqs=64, block_size=16)
    tuned = TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, heads_per_tile=4, kernel="hopper")
    assert shared_bytes(shape, tuned) <= H200.max_shared_mem < tuned.shared_mem_bytes(128, 2)
    _write_user_table(tmp_path, monkeypatch, {table_key(shape, H200): tuned})
    assert sm80_policy(shape, H200) == tuned


def test_calls_the_hopper_kernel_does_not_take_get_a_portable_tile_that_fits(tmp_path, monkeypatch):
    """Where the policy's tile is a Hopper tile the portable kernel cannot hold (128 keys in 3 stages), a call
    that falls back to the portable kernel (tensors a TMA view cannot address) runs the portable kernel's own
    tile, and the dispatch's shared-memory check looks at that tile: the call is not refused."""
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill.workloads import BatchSpec, make_problem

    problem = make_problem(BatchSpec(query_lens=(64,) * 8, context_lens=(40,) * 8, num_heads=32, num_kv_heads=8,
                                     head_size=128, block_size=16, dtype=torch.bfloat16, layout="nhd"))
    shape = problem_shape(problem)
    tuned = TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, heads_per_tile=4, kernel="hopper")
    _write_user_table(tmp_path, monkeypatch, {table_key(shape, H200): tuned})
    backend = Sm80Backend()
    assert backend.tile_config(shape, H200) == tuned
    fallback = backend.portable_tile(shape, H200)
    assert fallback.kernel == "portable" and fallback.shared_mem_bytes(128, 2) <= H200.max_shared_mem
    monkeypatch.setenv(KERNEL_ENV, "portable")
    assert fallback == backend.tile_config(shape, H200)  # the tile the portable kernel runs when forced
    monkeypatch.delenv(KERNEL_ENV)
    # Checked against the portable tile: the Hopper tile would need 262144 bytes in the portable kernel's model.
    backend.check_problem(problem, H200)


@pytest.mark.parametrize("head_size,layout,kv", [(64, "nhd", "auto"), (128, "nhd", "auto"), (128, "split", "auto"),
                                                 (96, "nhd", "auto"), (256, "nhd", "auto"), (128, "nhd", "fp8_e4m3"),
                                                 (128, "split", "fp8_e4m3"), (64, "split", "fp8_e5m2")])
@pytest.mark.parametrize("num_tokens,num_seqs", [(4096, 4), (64 * 128, 64)])
def test_hopper_search_space_holds_tiles_the_kernel_takes(monkeypatch, head_size, layout, kv, num_tokens, num_seqs):
    """Where the policy runs the Hopper kernel, ``pagedprefill tune`` measures Hopper tiles: the rule's first,
    each one the kernel takes for the shape and that fits the device's shared memory, few enough to tune in
    minutes."""
    from pagedprefill_sm80.hopper.schedule import shape_unfit_reason, shared_bytes

    monkeypatch.setenv(KERNEL_ENV, "hopper")
    shape = ProblemShape(head_size, 32, 8, torch.bfloat16, num_tokens=num_tokens, num_seqs=num_seqs, layout=layout,
                         kv_cache_dtype=kv, block_size=16)
    space = Sm80Backend().search_space(shape, H200)
    assert space[0] == hopper_config(shape) and len(set(space)) == len(space)
    assert 2 <= len(space) <= 10
    for cfg in space:
        assert cfg.kernel == "hopper"
        assert shape_unfit_reason(shape, cfg, H200.max_shared_mem) is None, cfg
        assert shared_bytes(shape, cfg) <= H200.max_shared_mem


@pytest.mark.parametrize("head_size,layout,kv,tile,kib", [
    (128, "nhd", "auto", (128, 128, 2), 160.2), (128, "split", "auto", (128, 128, 2), 224.3),
    (128, "split", "auto", (128, 64, 3), 176.3), (64, "nhd", "auto", (128, 128, 2), 80.2),
    (256, "nhd", "auto", (128, 64, 2), 192.2), (96, "nhd", "auto", (128, 128, 2), 160.2),
    (256, "nhd", "auto", (128, 64, 3), 256.3),  # Triton's error on the H200: "Required: 262416"
])
def test_hopper_shared_memory_model_matches_the_compiled_kernels(head_size, layout, kv, tile, kib):
    """:func:`shared_bytes` against what Triton allocated for sm90 (as ci/codegen_report.py reports it): an upper bound
    within its 1 KiB allowance for the barriers."""
    from pagedprefill_sm80.hopper.schedule import shared_bytes

    shape = ProblemShape(head_size, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4, layout=layout,
                         kv_cache_dtype=kv, block_size=16)
    block_m, block_n, stages = tile
    cfg = TileConfig(block_m=block_m, block_n=block_n, num_warps=8, num_stages=stages, kernel="hopper")
    assert 0 <= shared_bytes(shape, cfg) - kib * 1024 <= 1024


def test_search_space_fits_and_is_declared(monkeypatch):
    """The portable kernel's search space (on H200 the Hopper kernel's is tested above)."""
    monkeypatch.setenv(KERNEL_ENV, "portable")
    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=4096, num_seqs=4)
    space = Sm80Backend().search_space(shape, L40)
    assert len(space) >= 4 and len(set(space)) == len(space)
    assert all(c.fits(128, 2, L40) for c in space)
    assert {c.heads_per_tile for c in space} == {1, 2}  # packed and unpacked GQA for a long workload
    h200 = Sm80Backend().search_space(shape, H200)
    # small enough that the default keys tune in minutes (each candidate is a compile of a few seconds)
    assert 8 <= len(h200) <= 20
    assert sm80_policy(shape, H200) in h200 or rule_config(shape, H200) in h200


@pytest.mark.parametrize("name, value, words", [
    ("PAGEDPREFILL_SM80_KERNEL", "bogus", "expected one of auto, hopper, portable"),
    ("PAGEDPREFILL_SM80_SCHEDULE", "TURNS=1", "got 'TURNS=1'"),
])
def test_a_bad_value_of_sm80s_variables_is_refused_at_selection_on_any_machine(monkeypatch, name, value, words):
    """Checked when a backend is selected, on a machine without an sm90 GPU too (where no policy reads them)."""
    import pagedprefill as pp

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name) as raised:
        pp.select_backend("cpu")
    assert words in str(raised.value)
    monkeypatch.setenv(name, "")
    pp.select_backend("cpu")


@pytest.mark.parametrize(("num_tokens", "num_seqs", "splits"), [(4, 4, 3), (16, 2, 6), (8192, 8, 1), (256, 256, 1)])
def test_hopper_launches_too_small_to_fill_the_gpu_split_their_keys(num_tokens, num_seqs, splits):
    """Decode rows of few sequences (4 x 8 KV heads: 32 programs for 100 multiprocessors here) split each tile's
    keys into waves that fill the device; prefills and full decode batches do not."""
    from pagedprefill.tiling import key_splits_for

    shape = ProblemShape(128, 32, 8, torch.bfloat16, num_tokens=num_tokens, num_seqs=num_seqs)
    config = sm80_policy(shape, H200)
    assert config.kernel == "hopper" and config.key_splits == splits
    assert config.key_splits == key_splits_for(shape, config.with_(key_splits=1), H200)
    kernel, why = Sm80Backend().kernel_choice(shape, H200)
    assert kernel == "hopper" and (f"split {splits} ways" in why) == (splits > 1), why


@pytest.mark.parametrize("heads, kv_heads, tokens, expected", [
    (32, 8, 1024, 2),   # the bench's group of 4: the measured two heads per tile
    (64, 8, 1024, 8),   # groups of 5, 7 and 8: the whole group
    (56, 8, 1024, 7),
    (40, 8, 2048, 5),
    (48, 8, 1024, 2),   # a group of 6: two heads per tile fill every row
    (24, 8, 1024, 1),   # a group of 3 on prefix-cached rows: one head per tile fills the waves
    (71, 1, 1024, 2),   # Falcon-7B's MQA: two heads per tile, not 71 heads of one token
    (64, 8, 1, 8),      # a decode row: its whole group in one tile
])
def test_the_hopper_kernel_packs_each_models_group_as_measured(heads, kv_heads, tokens, expected):
    shape = ProblemShape(head_size=128, num_heads=heads, num_kv_heads=kv_heads, dtype=torch.bfloat16,
                         num_tokens=8 * tokens, num_seqs=8, max_query_len=tokens, kv_in_cache=True)
    config = sm80_policy(shape, H200)
    assert config.kernel == "hopper" and config.heads_per_tile == expected, config
