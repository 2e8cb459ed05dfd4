"""The conformance suite every backend runs: its output against the reference on the feature matrix.

A backend's tests subclass :class:`ConformanceSuite`::

    from pagedprefill.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend = "mybackend"
        # declared, reported as skips with the reason:
        excluded_kv_cache_dtypes = {"fp8_e4m3": "no FP8 on this hardware", "fp8_e5m2": "no FP8 on this hardware"}
        exclusions = {"head_size_256": "no tile fits head size 256"}   # single cases, by name

Cases that use an optional feature (:data:`~pagedprefill.testing.cases.FEATURE_CASES`) run against the
reference when the backend lists the feature in ``supported_features``; otherwise the suite checks that the
backend refuses the call with :class:`~pagedprefill.UnsupportedFeatureError` naming the feature, and reports
the case as skipped with that reason.

Options (registered by the pytest plugin): ``--pagedprefill-device`` (default: ``cuda`` when present,
else ``cpu``), ``--pagedprefill-size`` (``small`` for the interpreter, ``large`` for GPUs),
``--pagedprefill-sweep`` (number of random cases in the sweep, run in :data:`SWEEP_PARTS` parts; the
model-heads sweep draws a quarter as many, at least one per part), ``--pagedprefill-seeds`` (only the sweep
cases of these seeds: a failing case names its seed, and is said on the terminal as it fails),
``--pagedprefill-failures-now`` (each failing test's report printed as it fails, pytest-xdist's workers'
included, so that a run cut by a time limit keeps it).

In Triton's interpreter the suites of this repository's backends share the named, multi-tile and split-key
cases they run with the same kernel and tile: one suite runs each, the others skip it naming that suite
(:mod:`pagedprefill.testing.shared_runs`, :meth:`ConformanceSuite.shared_owner`).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Callable, Iterator, Optional

import pytest
import torch

from ..api import get_registry
from ..backends.triton_base import TritonBackend
from ..device import DeviceInfo, interpreter_enabled
from ..features import check_runnable, missing_features
from ..registry import UnsupportedFeatureError
from ..tiling import ProblemShape, TileConfig, problem_shape, settle
from ..types import KVCacheDType, PrefillProblem
from ..validation import validate_problem
from ..workloads import BatchSpec, fresh_output, make_problem
from .cases import (
    BASE,
    CASES,
    DEFAULT_TOLERANCES,
    MULTI_TILE_CASES,
    RANDOM_KV_CACHE_DTYPES,
    SMALL_TILE,
    SPLIT_KEY_CASES,
    SPLIT_KEY_COUNTS,
    assert_matches_reference,
    case_spec,
    model_heads_spec,
    multi_tile_spec,
    random_spec,
    split_key_spec,
)
from .memory_safety import LARGE, SPECS, check_corrupt_metadata
from .shared_runs import SMOKE_CASES, describe_tile, earlier_suites, interpreted_tile, interpreter_device, shares_runs

#: The random sweep runs as this many tests, so that parallel workers (pytest-xdist) share its compiles.
SWEEP_PARTS = 8

#: The tests whose cases the suites of :data:`~pagedprefill.testing.shared_runs.SHARED_SUITES` share in the
#: interpreter (:meth:`ConformanceSuite.shared_owner`). The random sweep is not among them: each suite draws its
#: own cases from what its backend runs, so two sweeps meet only by chance.
CASE_TEST = "test_case_matches_reference"
MULTI_TILE_TEST = "test_multi_tile_case_matches_reference"
SPLIT_KEYS_TEST = "test_split_keys_case_matches_reference"
SHARED_TESTS = (CASE_TEST, MULTI_TILE_TEST, SPLIT_KEYS_TEST)

#: ``change(config, shape)``: a tile a test runs instead of the policy's (None: the policy's own).
TileChange = Optional[Callable[[TileConfig, ProblemShape], TileConfig]]


def small_tile(config: TileConfig, shape: ProblemShape) -> TileConfig:
    """The multi-tile cases' tile: the policy's ``config`` with :data:`~pagedprefill.testing.cases.SMALL_TILE`'s
    rows and keys, settled for ``shape``."""
    heads = min(config.heads_per_tile, SMALL_TILE["block_m"] // 2)
    return settle(config.with_(**SMALL_TILE, heads_per_tile=heads, num_stages=min(config.num_stages, 2)), shape)


def keys_split(splits: int) -> Callable[[TileConfig, ProblemShape], TileConfig]:
    """The split-key cases' tile change: the policy's tile with each query tile's keys shared by ``splits``
    programs."""
    return lambda config, shape: config.with_(key_splits=splits)


@contextlib.contextmanager
def tiles_changed(backend: TritonBackend, change: TileChange) -> Iterator[None]:
    """Within the block ``backend`` runs ``change(its policy's tile, shape)`` for every call (nothing changes
    when ``change`` is None); its own tiles are back after it."""
    if change is None:
        yield
        return
    own = vars(backend).get("tile_config")
    policy_tile = backend.tile_config
    backend.tile_config = lambda shape, device: change(policy_tile(shape, device), shape)
    try:
        yield
    finally:
        if own is None:
            del backend.tile_config
        else:
            backend.tile_config = own


class ConformanceSuite:
    """Backend-vs-reference tests over :data:`CASES` plus a random sweep. Subclass and set ``backend``."""

    backend: str = "reference"
    #: case name -> reason; such cases are reported as skipped with the reason.
    exclusions: dict[str, str] = {}
    #: KV cache dtype (``"fp8_e4m3"``, ``"fp8_e5m2"``; ``"fp8"`` means e4m3) -> reason: every case and sweep
    #: problem whose cache has that dtype is skipped with the reason, whatever the case is called.
    excluded_kv_cache_dtypes: dict[str, str] = {}
    tolerances: dict = DEFAULT_TOLERANCES
    seeds: tuple[int, ...] = (0, 1)

    def device_info(self, device: torch.device) -> DeviceInfo:
        """The device description handed to the backend (override to force a policy, e.g. a described
        BI-V100 while running on another GPU)."""
        return DeviceInfo.detect(device)

    def run_backend(self, problem: PrefillProblem, device: torch.device) -> torch.Tensor:
        """Run the backend directly (selection bypassed), as a forced choice would.

        It runs the way the dispatch does: through :meth:`~pagedprefill.Backend.bind`, whose returned plan then
        computes the same problem again into a fresh output. Where the plan is another path (on GPUs a Triton
        backend's plan launches the compiled kernel directly, the path every repeated call takes) its output
        must be bit-identical to the first run's. A plan that merely calls :meth:`~pagedprefill.Backend.run`
        again (the interpreter on the CPU, the reference) repeats the same path, so nothing is compared."""
        validate_problem(problem, "full")
        info = self.device_info(device)
        backend = get_registry().get(self.backend)
        if device.type == "cpu" and isinstance(backend, TritonBackend) and not interpreter_enabled():
            pytest.skip(f"backend {self.backend!r} runs Triton kernels: on the CPU set TRITON_INTERPRET=1")
        check_runnable(backend, problem, info)
        plan = backend.bind(problem, info)
        again = fresh_output(problem)
        assert plan(again), f"backend {self.backend!r}: its plan declined a problem of the same signature"
        if not getattr(plan, "reruns", False):
            first, second = (t.out.float().nan_to_num(nan=1234.5) for t in (problem, again))
            assert torch.equal(first, second), \
                f"backend {self.backend!r}: the plan's launch differs from the first run"
        return problem.out

    def case_spec(self, case: str, size: str, seed: int) -> BatchSpec:
        """The batch of a named case (override to steer the cases onto the shapes a kernel takes)."""
        return case_spec(case, size, seed)

    def sweep_spec(self, seed: int, size: str, dtypes: tuple) -> BatchSpec:
        """The batch of one random sweep case (override like :meth:`case_spec`), drawn from what the backend
        runs: no cache format of :attr:`excluded_kv_cache_dtypes`, and only the optional features it lists in
        ``supported_features`` (the named cases check that it refuses the others), so that every sweep case
        is computed and compared."""
        # A backend that runs every format and feature draws the cases every such backend shares.
        return random_spec(seed, size, dtypes, **self._what_it_runs())

    def model_heads_spec(self, seed: int, size: str, dtypes: tuple) -> BatchSpec:
        """The batch of one case of the model-heads sweep (:func:`~pagedprefill.testing.cases.model_heads_spec`:
        head sizes 64-256 and head groups of 1 and 3-8), drawn from what the backend runs as
        :meth:`sweep_spec` draws."""
        return model_heads_spec(seed, size, dtypes, **self._what_it_runs())

    def _what_it_runs(self) -> dict:
        """The random draws' limits for this backend: its cache formats (less :attr:`excluded_kv_cache_dtypes`)
        and its ``supported_features``."""
        excluded = {fmt.value for fmt in self._excluded_cache_dtypes()}
        return dict(kv_cache_dtypes={fmt for fmt in RANDOM_KV_CACHE_DTYPES if fmt not in excluded},
                    features=get_registry().get(self.backend).supported_features)

    def _skip_reason(self, spec: BatchSpec, device: torch.device, case: Optional[str] = None) -> Optional[str]:
        if case is not None and case in self.exclusions:
            return f"excluded for backend {self.backend!r}: {self.exclusions[case]}"
        cache_reason = self._excluded_cache_dtypes().get(KVCacheDType.parse(spec.kv_cache_dtype))
        if cache_reason:
            return f"excluded for backend {self.backend!r} (kv_cache_dtype={spec.kv_cache_dtype!r}): {cache_reason}"
        if spec.dtype == torch.bfloat16 and device.type == "cpu" and interpreter_enabled() \
                and self.backend != "reference":
            return "bf16 tl.dot is not supported by Triton's CPU interpreter; covered on the GPU"
        return None

    def _excluded_cache_dtypes(self) -> dict[KVCacheDType, str]:
        """:attr:`excluded_kv_cache_dtypes` with its keys parsed (a misspelt key fails with the accepted ones)."""
        return {KVCacheDType.parse(name): reason for name, reason in self.excluded_kv_cache_dtypes.items()}

    def _refused(self, problem: PrefillProblem, device: torch.device, label: str) -> Optional[str]:
        """None when the backend supports every feature ``problem`` uses; else check that it refuses the call
        naming each missing feature, and return the refusal."""
        missing = missing_features(get_registry().get(self.backend), problem)
        if not missing:
            return None
        with pytest.raises(UnsupportedFeatureError) as refused:
            self.run_backend(problem, device)
        for name in missing:
            assert name in str(refused.value), f"{label}: the refusal does not name {name!r}: {refused.value}"
        # The refusal was checked above; its text already names the backend and the features.
        return f"refused, as its supported_features declare: {refused.value}"

    def _beyond_limits(self, problem: PrefillProblem, device: torch.device) -> Optional[str]:
        """None when the backend's :meth:`~pagedprefill.Backend.check_problem` takes ``problem`` on the suite's
        device; else its refusal, which names the limit (a random case may draw a head size whose float32 tile
        no device's shared memory holds, which the named cases leave out)."""
        try:
            get_registry().get(self.backend).check_problem(problem, self.device_info(device))
        except UnsupportedFeatureError as refused:
            return f"beyond the backend's limits: {refused}"
        return None

    def _check(self, spec: BatchSpec, device: torch.device, label: str) -> None:
        problem = make_problem(spec, device)
        refusal = self._refused(problem, device, label)
        if refusal:
            pytest.skip(refusal)
        out = self.run_backend(problem, device)
        atol, rtol = self.tolerances[spec.dtype]
        assert_matches_reference(out, problem, atol, rtol, label=f"{label} [{spec.describe()}]")

    def runs(self, test: str, case: str, size: str, splits: Optional[int] = None) -> list[tuple[BatchSpec, TileChange]]:
        """The batches the shared test ``test`` (one of :data:`SHARED_TESTS`) computes for ``case`` (with
        ``splits`` for the split-key test) at ``size``, each with the change the test makes to the policy's
        tile."""
        if test == CASE_TEST:
            return [(self.case_spec(case, size, seed), None) for seed in self.seeds]
        if test == MULTI_TILE_TEST:  # the lengths, not the data, make these cases: one seed is enough
            return [(multi_tile_spec(case, seed), small_tile) for seed in self.seeds[:1]]
        if test == SPLIT_KEYS_TEST:
            return [(split_key_spec(case, seed=0), keys_split(splits))]
        raise ValueError(f"test: expected one of {', '.join(SHARED_TESTS)}, got {test!r}")

    def launches(self, test: str, case: str, device: torch.device, size: str,
                 splits: Optional[int] = None) -> Optional[tuple]:
        """What ``test`` runs for ``case`` on ``device`` (see :meth:`runs`): for each batch ``(batch, kernel,
        tile)``, the tile as the kernel receives it in Triton's interpreter
        (:func:`~pagedprefill.testing.shared_runs.interpreted_tile`); None when the test skips the case or the
        backend refuses it. Decided without running anything."""
        backend = get_registry().get(self.backend)
        if not isinstance(backend, TritonBackend):
            return None
        found = []
        for spec, change in self.runs(test, case, size, splits):
            if self._skip_reason(spec, device, case if test == CASE_TEST else None):
                return None
            problem = _batch(spec, device)
            if missing_features(backend, problem):
                return None
            info = self.device_info(device)
            try:
                check_runnable(backend, problem, info)
            except UnsupportedFeatureError:
                return None
            with tiles_changed(backend, change):
                route, config, _ = backend.route_for(problem, info)
            found.append((spec, route.name, interpreted_tile(config)))
        return tuple(found)

    def shared_owner(self, test: str, case: str, device: torch.device, size: str,
                     splits: Optional[int] = None) -> Optional[tuple[str, tuple]]:
        """``(backend, its launches)``: the earlier suite of
        :data:`~pagedprefill.testing.shared_runs.SHARED_SUITES` that runs ``case`` of ``test`` with the same
        kernel and tiles as this suite (:meth:`launches`), so that this one need not; None when this suite runs
        it: on a GPU, outside the table, for the smoke cases, and where no earlier suite's tiles are the same.

        Every suite decides alike from the backends' policies, whichever suites a session collects: the earlier
        suites' launches are computed from their backends (:func:`shared_suite`). So that this holds, the
        suite's own launches must be the ones that view gives it; an ``AssertionError`` says where not."""
        if not shares_runs(self.backend, device) or (test == CASE_TEST and case in SMOKE_CASES):
            return None
        own = self.launches(test, case, device, size, splits)
        seen = shared_suite(self.backend).launches(test, case, device, size, splits)
        if own != seen:
            raise AssertionError(
                f"{self.backend}'s suite runs {test}[{case}] as {own}, but the suites it shares runs with see "
                f"{seen} (core's cases on the device of pagedprefill.testing.shared_runs.SHARED_SUITES): make "
                "them agree, or the others may skip a run for this suite that it does not make")
        if own is None:
            return None
        for other in earlier_suites(self.backend):
            if shared_suite(other).launches(test, case, device, size, splits) == own:
                return other, own
        return None

    def _skip_if_shared(self, test: str, case: str, device: torch.device, size: str,
                        splits: Optional[int] = None) -> None:
        """Skip the running test, naming the suite that runs it, when :meth:`shared_owner` finds one."""
        shared = self.shared_owner(test, case, device, size, splits)
        if shared is None:
            return
        owner, launches = shared
        tiles = "; ".join(dict.fromkeys(f"{kernel} kernel: {describe_tile(tile)}" for _, kernel, tile in launches))
        param = case if splits is None else f"{case}-{splits}"
        pytest.skip(f"same kernel and tile in Triton's interpreter as {owner}'s {test}[{param}], which {owner}'s "
                    f"suite runs ({tiles}); on a GPU it runs here too")

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_case_matches_reference(self, case, pagedprefill_device, pagedprefill_size):
        self._skip_if_shared(CASE_TEST, case, pagedprefill_device, pagedprefill_size)
        for spec, _ in self.runs(CASE_TEST, case, pagedprefill_size):
            reason = self._skip_reason(spec, pagedprefill_device, case)
            if reason:
                pytest.skip(reason)
            self._check(spec, pagedprefill_device, f"{self.backend}/{case}/seed={spec.seed}")

    @pytest.mark.parametrize("case", sorted(MULTI_TILE_CASES))
    def test_multi_tile_case_matches_reference(self, case, pagedprefill_device, pagedprefill_size):
        """Windows, ALiBi, sinks and the optional features over contexts of several key tiles, with the tile
        forced small (:data:`~pagedprefill.testing.cases.SMALL_TILE`): window tile skipping, the mask-free
        middle tiles and every edge tile are reached even in the interpreter's small batches."""
        backend = get_registry().get(self.backend)
        if not isinstance(backend, TritonBackend):
            pytest.skip(f"backend {self.backend!r} has no tiles to force; its conformance cases cover it")
        self._skip_if_shared(MULTI_TILE_TEST, case, pagedprefill_device, pagedprefill_size)
        for spec, change in self.runs(MULTI_TILE_TEST, case, pagedprefill_size):
            reason = self._skip_reason(spec, pagedprefill_device)
            if reason:
                pytest.skip(reason)
            with tiles_changed(backend, change):
                self._check(spec, pagedprefill_device, f"{self.backend}/multi_tile/{case}/seed={spec.seed}")

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_unsplit_case_matches_reference(self, case, pagedprefill_device, pagedprefill_size, monkeypatch):
        """The named cases with one program per query tile where the policy splits their keys (a GPU on which
        the small cases cannot fill the device): the unsplit walk and epilogue stay covered there too."""
        backend = get_registry().get(self.backend)
        if not isinstance(backend, TritonBackend):
            pytest.skip(f"backend {self.backend!r} has no tiles to split; test_case_matches_reference covers it")
        spec = self.case_spec(case, pagedprefill_size, self.seeds[0])
        reason = self._skip_reason(spec, pagedprefill_device, case)
        if reason:
            pytest.skip(reason)
        shape = problem_shape(make_problem(spec, pagedprefill_device))
        policy_tile = backend.tile_config
        if policy_tile(shape, self.device_info(pagedprefill_device)).key_splits == 1:
            pytest.skip("the policy splits no keys of this case here: test_case_matches_reference runs it unsplit")
        monkeypatch.setattr(backend, "tile_config",
                            lambda shape, device: policy_tile(shape, device).with_(key_splits=1))
        self._check(spec, pagedprefill_device, f"{self.backend}/{case}/unsplit/seed={self.seeds[0]}")

    @pytest.mark.parametrize("splits", SPLIT_KEY_COUNTS)
    @pytest.mark.parametrize("case", sorted(SPLIT_KEY_CASES))
    def test_split_keys_case_matches_reference(self, case, splits, pagedprefill_device, pagedprefill_size):
        """Each query tile's keys shared by ``splits`` programs (``TileConfig.key_splits``, on the policy's own
        tile, whichever kernel it names) and merged by the combine launch: the same rows as one program per
        tile, through the first run and the plan's."""
        backend = get_registry().get(self.backend)
        if not isinstance(backend, TritonBackend):
            pytest.skip(f"backend {self.backend!r} has no tiles to split; its conformance cases cover it")
        self._skip_if_shared(SPLIT_KEYS_TEST, case, pagedprefill_device, pagedprefill_size, splits)
        for spec, change in self.runs(SPLIT_KEYS_TEST, case, pagedprefill_size, splits):
            reason = self._skip_reason(spec, pagedprefill_device)
            if reason:
                pytest.skip(reason)
            with tiles_changed(backend, change):
                self._check(spec, pagedprefill_device, f"{self.backend}/split_keys/{case}/x{splits}")

    @pytest.mark.parametrize("batch", [*sorted(SPECS), "large"])
    def test_corrupt_metadata_stays_in_bounds(self, batch, pagedprefill_device):
        """With ``validate="basic"`` corrupt metadata gives wrong rows but no access outside the tensors, and the
        device keeps working (:mod:`pagedprefill.testing.memory_safety`)."""
        device = pagedprefill_device
        if batch == "large" and device.type == "cpu":
            pytest.skip("the GPU-sized batch (head size 128, contexts of 1000) runs on GPUs "
                        "(--pagedprefill-device=cuda); the small batches cover the same paths in the interpreter")
        spec = LARGE if batch == "large" else SPECS[batch]
        backend = get_registry().get(self.backend)
        if device.type == "cpu" and isinstance(backend, TritonBackend) and not interpreter_enabled():
            pytest.skip(f"backend {self.backend!r} runs Triton kernels: on the CPU set TRITON_INTERPRET=1")
        reason = self._skip_reason(spec, device)
        if reason:
            pytest.skip(reason)
        missing = missing_features(backend, make_problem(spec, device))
        if missing:
            pytest.skip(f"backend {self.backend!r} does not support {sorted(missing)}")
        checked = check_corrupt_metadata(backend, self.device_info(device), device, spec,
                                         label=f"{self.backend}/{batch}")
        print(f"{self.backend}/{batch}: {len(checked)} corrupt metadata variants stayed in bounds")

    def test_cache_offsets_beyond_int32(self, pagedprefill_device):
        """Blocks whose element offsets pass 2**31 are addressed correctly (64-bit offset arithmetic)."""
        if pagedprefill_device.type == "cpu":
            pytest.skip(f"needs a ~9 GB cache: run the conformance tests of backend {self.backend!r} on a GPU "
                        "(--pagedprefill-device=cuda)")
        free, _ = torch.cuda.mem_get_info(pagedprefill_device)
        if free < 12 * 2**30:
            pytest.skip(f"needs 12 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
        spec = BASE.replace(query_lens=(33, 1, 70), context_lens=(300, 129, 64), num_heads=2, num_kv_heads=1,
                            head_size=128, block_size=16, spare_blocks=0)
        problem = make_problem(spec, pagedprefill_device)
        cache = problem.cache
        per_block = cache.key[0].numel()
        num_blocks = (2**31 + 64 * per_block) // per_block + 64
        big_k = torch.empty((num_blocks, *cache.key.shape[1:]), dtype=cache.key.dtype, device=pagedprefill_device)
        big_v = torch.empty((num_blocks, *cache.value.shape[1:]), dtype=cache.value.dtype, device=pagedprefill_device)
        used = problem.batch.block_table.long()
        moved = num_blocks - 1 - used  # the same blocks, copied to the far end of the big cache
        big_k[moved.flatten()] = cache.key[used.flatten()]
        big_v[moved.flatten()] = cache.value[used.flatten()]
        import dataclasses

        assert int(moved.min()) * per_block >= 2**31
        problem = dataclasses.replace(
            problem, cache=dataclasses.replace(cache, key=big_k, value=big_v),
            batch=dataclasses.replace(problem.batch, block_table=moved.to(torch.int32)))
        out = self.run_backend(problem, pagedprefill_device)
        atol, rtol = self.tolerances[spec.dtype]
        assert_matches_reference(out, problem, atol, rtol, label=f"{self.backend}/offsets>2^31")

    @pytest.mark.parametrize("part", range(SWEEP_PARTS))
    def test_random_sweep(self, part, pagedprefill_device, pagedprefill_size, pagedprefill_sweep,
                          pagedprefill_seeds, terminal_line):
        """Part ``part`` of the random sweep: the cases whose index is ``part`` modulo :data:`SWEEP_PARTS`
        (most random cases compile a kernel of their own, so parallel workers share them out by part)."""
        self._sweep("sweep", 1000, self.sweep_spec, part, pagedprefill_sweep, pagedprefill_device,
                    pagedprefill_size, terminal_line, pagedprefill_seeds)

    @pytest.mark.parametrize("part", range(SWEEP_PARTS))
    def test_model_heads_sweep(self, part, pagedprefill_device, pagedprefill_size, pagedprefill_sweep,
                               pagedprefill_seeds, terminal_line):
        """Part ``part`` of the model-heads sweep (:meth:`model_heads_spec`): a quarter as many cases as the
        random sweep, at least one per part, at the head sizes and groups models run."""
        cases = max(SWEEP_PARTS, -(-pagedprefill_sweep // 4)) if pagedprefill_sweep else 0
        self._sweep("model heads sweep", 5000, self.model_heads_spec, part, cases, pagedprefill_device,
                    pagedprefill_size, terminal_line, pagedprefill_seeds)

    def _sweep(self, name: str, first_seed: int, spec_of: Callable, part: int, cases: int, device: torch.device,
               size: str, terminal_line, only: Optional[frozenset] = None) -> None:
        """Check the cases of seeds ``first_seed + i`` for the ``i`` of ``range(cases)`` that are ``part`` modulo
        :data:`SWEEP_PARTS`, each batch from ``spec_of(seed, size, dtypes)``; a case the backend declares
        unsupported or refuses (naming the feature) is counted and said, not checked. Every case runs: each one
        that fails is said on the terminal as it fails (its seed, batch and message; pytest-xdist's workers own
        no terminal, where ``--pagedprefill-failures-now`` prints the part's report when it ends), and the part
        then fails naming all of them. ``only``: the seeds to check (``--pagedprefill-seeds``), the others left out."""
        seeds = range(part, cases, SWEEP_PARTS)
        if not seeds:
            pytest.skip(f"a {name} of {cases} cases has none for part {part} of {SWEEP_PARTS}")
        if only is not None:
            seeds = [seed for seed in seeds if first_seed + seed in only]
            if not seeds:
                pytest.skip(f"--pagedprefill-seeds names no case of part {part} of the {name}")
        dtypes = (torch.float16, torch.float32)
        if device.type != "cpu":
            dtypes += (torch.bfloat16,)
        checked, skipped, failed = 0, Counter(), []
        for seed in seeds:
            spec = spec_of(first_seed + seed, size, dtypes)
            label = f"{self.backend}/{name.replace(' ', '_')}/seed={first_seed + seed}"
            reason = self._skip_reason(spec, device)
            if reason:
                skipped[reason] += 1
                continue
            problem = make_problem(spec, device)
            refusal = self._refused(problem, device, label) or self._beyond_limits(problem, device)
            if refusal:  # the refusal named each missing feature, or the limit the problem passes
                skipped[refusal] += 1
                continue
            try:
                self._check(spec, device, label)
            except Exception as why:  # noqa: BLE001 - every case of the part runs; the part fails below
                # Said at once: a run cut by its time limit keeps the message, which pytest prints only at the end.
                said = str(why)  # the comparison's own message names the case already
                failed.append(said if said.startswith(label) else f"{label} [{spec.describe()}]: "
                                                                   f"{type(why).__name__}: {said}")
                terminal_line(f"FAILED {failed[-1]}")
            checked += 1
        terminal_line(f"{self.backend} {name} part {part}: {checked} of {len(seeds)} random cases checked against "
                      f"the reference, {len(failed)} failed, {sum(skipped.values())} skipped"
                      + "".join(f"\n  {n} x {reason}" for reason, n in skipped.items()))
        if failed:
            pytest.fail(f"{len(failed)} of {checked} cases of part {part} of the {name} failed:\n"
                        + "\n".join(failed), pytrace=False)
        if not checked:  # every case of this part was declared unsupported: say which, as a skip
            pytest.skip(f"part {part} of the {name}: all {len(seeds)} cases skipped: "
                        + "; ".join(f"{n} x {reason}" for reason, n in skipped.items()))


@functools.lru_cache(maxsize=512)
def _batch(spec: BatchSpec, device: torch.device) -> PrefillProblem:
    """The batch of ``spec`` on ``device``, made once per process: :meth:`ConformanceSuite.launches` reads only
    its shapes, types and options, and every suite asks for the same cases."""
    return make_problem(spec, device)


def shared_suite(backend: str) -> ConformanceSuite:
    """The suite of ``backend`` (one of :data:`~pagedprefill.testing.shared_runs.SHARED_SUITES`) as the suites
    it shares runs with see it: core's cases as written, its policy planning for the table's device."""
    def device_info(self, device: torch.device) -> DeviceInfo:
        return interpreter_device(backend, device)

    return type(f"Shared{backend.title()}Suite", (ConformanceSuite,), {"backend": backend,
                                                                       "device_info": device_info})()
