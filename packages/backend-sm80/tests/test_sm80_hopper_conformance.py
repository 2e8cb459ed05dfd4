"""The core conformance suite on the sm80 backend with its Hopper kernel forced (an sm90 GPU).

Under ``PAGEDPREFILL_SM80_KERNEL=hopper`` the policy runs every call the Hopper kernel takes on it, and the
rest on the portable kernel. The suite's cases mostly use head size 32 and block size 8, which the Hopper
kernel does not take, so here each case that keeps the suite's default head size runs with head size 128
(even seeds) or 64 (odd seeds) instead, and block size 16 instead of 8: the same lengths, features, layouts
and dtypes, on the Hopper kernel wherever those allow it. ``test_sm80_conformance.py`` runs the cases as
written on the portable kernel.

``PAGEDPREFILL_TEST_HOPPER_SCHEDULE`` (e.g. ``PINGPONG=0,FUSED_SCALE=0``) runs the suite with those schedule
flags of the kernel over its defaults (:data:`pagedprefill_sm80.hopper.schedule.DEFAULTS`) and the policy's
per-route flags: added to ``PAGEDPREFILL_SM80_SCHEDULE``, which sets them for any process.
``PAGEDPREFILL_TEST_HOPPER_TILE`` (e.g. ``block_n=128,num_stages=2``) changes the policy's Hopper tile of every
call where the changed tile fits, so that the suite's short calls also run a tile the policy gives long ones
(and the schedule flags of its route); the backend remembers its tiles per process, so run the class alone with
it set.
"""

import os

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.testing import ConformanceSuite
from pagedprefill.testing.cases import BASE
from pagedprefill.workloads import BatchSpec
from pagedprefill_sm80 import policy
from pagedprefill_sm80.hopper import launch
from pagedprefill_sm80.hopper import schedule as hopper_schedule
from pagedprefill_sm80.policy import KERNEL_ENV

SCHEDULE_ENV = "PAGEDPREFILL_TEST_HOPPER_SCHEDULE"
TILE_ENV = "PAGEDPREFILL_TEST_HOPPER_TILE"


def tile_changes(text: str) -> dict:
    """``{"block_n": 128, ...}`` from ``"block_n=128,..."``: integer fields of the Hopper kernel's tile."""
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in ("block_n", "num_stages", "heads_per_tile") or not value.strip().isdigit():
            raise ValueError(f"{TILE_ENV}: expected block_n, num_stages or heads_per_tile=<integer>, got {item!r}")
        changes[name] = int(value)
    return changes


def changed_hopper_config(changes: dict, rule=policy.hopper_config):
    """The policy's Hopper tile rule with ``changes`` made wherever the changed tile fits an sm90 GPU."""
    def config(shape):
        tile = rule(shape)
        changed = tile.with_(**changes)
        return changed if hopper_schedule.shape_unfit_reason(shape, changed, 227 * 1024) is None else tile
    return config


def hopper_head_size(spec: BatchSpec, seed: int) -> BatchSpec:
    """``spec`` with the suite's default head size and block size replaced by ones the Hopper kernel takes on
    both layouts."""
    if spec.block_size == BASE.block_size:
        spec = spec.replace(block_size=16)
    if spec.head_size != BASE.head_size:
        return spec
    return spec.replace(head_size=128 if seed % 2 == 0 else 64)


def hopper_pages(spec: BatchSpec, seed: int) -> BatchSpec:
    """``spec`` with a page size the Hopper kernel reads (a power of two of at least 8 tokens) in place of one it
    leaves to the portable kernel (the random draws' 1, 3 and 19)."""
    if spec.block_size >= 8 and spec.block_size & (spec.block_size - 1) == 0:
        return spec
    return spec.replace(block_size=(16, 32, 8, 64)[seed % 4])


class TestSm80HopperConformance(ConformanceSuite):
    backend = "sm80"

    @pytest.fixture(autouse=True)
    def hopper_kernel(self, monkeypatch):
        monkeypatch.setenv(KERNEL_ENV, "hopper")
        flags = os.environ.get(SCHEDULE_ENV, "")
        hopper_schedule.parse(flags)  # a bad flag fails here, naming it
        if flags:
            monkeypatch.setenv(hopper_schedule.SCHEDULE_ENV,
                               ",".join(filter(None, (os.environ.get(hopper_schedule.SCHEDULE_ENV), flags))))
        changes = tile_changes(os.environ.get(TILE_ENV, ""))
        if changes:
            # The backend remembers its tiles for the process: run this class alone with the variable set.
            monkeypatch.setattr(policy, "hopper_config", changed_hopper_config(changes))

    def case_spec(self, case: str, size: str, seed: int) -> BatchSpec:
        return hopper_head_size(super().case_spec(case, size, seed), seed)

    def sweep_spec(self, seed: int, size: str, dtypes: tuple) -> BatchSpec:
        return hopper_head_size(super().sweep_spec(seed, size, dtypes), seed)

    def model_heads_spec(self, seed: int, size: str, dtypes: tuple) -> BatchSpec:
        return hopper_pages(super().model_heads_spec(seed, size, dtypes), seed)

    def device_info(self, device: torch.device) -> DeviceInfo:
        if device.type == "cpu":
            pytest.skip("the Hopper kernel is written in Gluon, which Triton's CPU interpreter does not run; "
                        "it is checked on sm90 GPUs")
        info = DeviceInfo.detect(device)
        if info.vendor != "nvidia" or info.capability != (9, 0):
            pytest.skip(f"the Hopper kernel needs an sm90 GPU, found {info.describe()}")
        return info

    @pytest.mark.parametrize("head_size", [128, 64])
    def test_split_fp8_key_cache_the_page_boxes_cannot_describe(self, head_size, pagedprefill_device):
        """A split FP8 key cache that is every other block of a larger tensor (not contiguous from its block
        dimension in): the launch reads its keys by the 16-byte copies instead of the page boxes, on the policy's
        tile for the split FP8 cache, and matches the reference."""
        import dataclasses

        from pagedprefill import get_registry
        from pagedprefill.testing.cases import assert_matches_reference
        from pagedprefill.tiling import problem_shape
        from pagedprefill.workloads import make_problem

        info = self.device_info(pagedprefill_device)
        spec = BASE.replace(layout="split", kv_cache_dtype="fp8_e4m3", head_size=head_size, block_size=16,
                            dtype=torch.bfloat16, num_heads=4, num_kv_heads=2, query_lens=(300, 1, 170),
                            context_lens=(450, 77, 0), seed=11)
        problem = make_problem(spec, pagedprefill_device)
        key = problem.cache.key
        wider = torch.empty((2 * key.shape[0], *key.shape[1:]), dtype=key.dtype, device=key.device)[::2]
        wider.copy_(key)
        problem = dataclasses.replace(problem, cache=dataclasses.replace(problem.cache, key=wider))
        shape = problem_shape(problem)
        config = get_registry().get(self.backend).tile_config(shape, info)
        call = launch.kernel_call(problem, config, shape)
        assert config.kernel == "hopper" and not call.constexprs["SCHEDULE"].FP8_BOXES, (config, call.constexprs)
        out = self.run_backend(problem, pagedprefill_device)
        atol, rtol = self.tolerances[spec.dtype]
        assert_matches_reference(out, problem, atol, rtol, label=f"strided split FP8 key cache [{spec.describe()}]")

    @pytest.mark.parametrize("changes", [{"layout": "nhd"}, {"layout": "split"},
                                         {"layout": "split", "kv_cache_dtype": "fp8_e4m3", "scale_as_tensor": True},
                                         {"layout": "nhd", "kv_in_cache": True}],
                             ids=["nhd", "split", "split-fp8", "nhd-kv-in-cache"])
    def test_a_plan_follows_tensors_that_moved(self, changes, pagedprefill_device):
        """The launch plan of one call signature (TMA descriptors encoded per address) computes later calls whose
        tensors all moved, then whose new tokens' keys and values alone moved, then the first call's tensors
        again, each matching the reference."""
        import dataclasses

        from pagedprefill import get_registry
        from pagedprefill.testing.cases import assert_matches_reference
        from pagedprefill.workloads import make_problem

        info = self.device_info(pagedprefill_device)
        spec = BASE.replace(head_size=128, block_size=16, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2,
                            query_lens=(70, 1, 130), context_lens=(200, 45, 0), **changes)
        first = make_problem(spec, pagedprefill_device)
        backend = get_registry().get(self.backend)
        assert backend.kernel_for(first, info) == "hopper", spec.describe()
        plan = backend.bind(first, info)
        other = make_problem(spec.replace(seed=7), pagedprefill_device)
        new_tokens_moved = other if other.k is None else dataclasses.replace(other, k=other.k.clone(),
                                                                             v=other.v.clone())
        atol, rtol = self.tolerances[spec.dtype]
        for label, later in (("every tensor moved", other), ("new tokens moved", new_tokens_moved),
                             ("the first call's tensors", first)):
            later = dataclasses.replace(later, out=torch.full_like(later.out, float("nan")))
            assert plan(later), f"the plan declined a call of its signature ({label})"
            assert_matches_reference(later.out, later, atol, rtol, label=f"{label} [{spec.describe()}]")

    @pytest.mark.parametrize("window", [17, 64])
    @pytest.mark.parametrize("group", [3, 4, 5, 7, 8])
    def test_windows_on_a_group_packed_in_one_tile(self, group, window, pagedprefill_device):
        """A sliding window shorter than a key tile on tiles that hold the policy's packing of a KV group: the
        whole group for 3, 5 and 7 heads (tokens per tile 42, 25 and 18, not powers of two), beside groups of 4 and
        8; a long prefill with no context, one on cached keys and a decode row. The random sweep draws windows
        this short on such tiles almost never, the model-heads sweep a few times: here each packing is named, so
        that a failure says which."""
        from pagedprefill import get_registry
        from pagedprefill.testing.cases import assert_matches_reference
        from pagedprefill.tiling import problem_shape
        from pagedprefill.workloads import make_problem

        info = self.device_info(pagedprefill_device)
        spec = BASE.replace(head_size=128, block_size=32, dtype=torch.float16, num_heads=group, num_kv_heads=1,
                            query_lens=(203, 150, 1), context_lens=(0, 300, 90), sliding_window=window, seed=5)
        problem = make_problem(spec, pagedprefill_device)
        config = get_registry().get(self.backend).tile_config(problem_shape(problem), info)
        assert config.kernel == "hopper", config
        out = self.run_backend(problem, pagedprefill_device)
        atol, rtol = self.tolerances[spec.dtype]
        assert_matches_reference(out, problem, atol, rtol,
                                 label=f"{config.heads_per_tile} heads per tile [{spec.describe()}]")

    def test_split_keys_leave_their_arrival_counters_zero_for_the_next_launch(self, pagedprefill_device):
        """Decode rows on a wide block table, whose keys the policy splits: two calls on one stream count on the
        same kept counters and leave them zero, a call on another stream gets its own, and every call matches
        the reference."""
        from pagedprefill import get_registry
        from pagedprefill.testing.cases import assert_matches_reference
        from pagedprefill.tiling import problem_shape
        from pagedprefill.workloads import make_problem

        info = self.device_info(pagedprefill_device)
        spec = BASE.replace(head_size=128, block_size=16, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2,
                            query_lens=(1, 1, 4), context_lens=(3000, 1200, 4000))
        backend = get_registry().get(self.backend)
        first = make_problem(spec, pagedprefill_device)
        config = backend.tile_config(problem_shape(first), info)
        assert config.kernel == "hopper" and config.key_splits > 1, config
        atol, rtol = self.tolerances[spec.dtype]
        side = torch.cuda.Stream(pagedprefill_device)
        kept = []
        for seed, stream in ((1, None), (2, None), (3, side)):
            problem = make_problem(spec.replace(seed=seed), pagedprefill_device)
            with torch.cuda.stream(stream or torch.cuda.current_stream(pagedprefill_device)):
                out = self.run_backend(problem, pagedprefill_device)
                torch.cuda.synchronize(pagedprefill_device)
                counters = launch.arrival_counters.kept(pagedprefill_device)
            assert counters is not None and not counters.any(), f"seed {seed}: counters left {counters}"
            kept.append(counters.data_ptr())
            assert_matches_reference(out, problem, atol, rtol, label=f"seed {seed} [{spec.describe()}]")
        assert kept[0] == kept[1] != kept[2], kept
