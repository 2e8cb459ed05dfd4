"""The Hopper kernel without a GPU: which calls the policy routes to it and why, what it refuses, and what it
compiles to for sm90 (warp specialisation, TMA, warpgroup MMA, register split, no spills).

Its results are checked on an sm90 GPU by ``test_sm80_hopper_conformance.py``: Gluon kernels do not run in
Triton's CPU interpreter.
"""

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Optional

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.tiling import ProblemShape, launch_grid
from pagedprefill.workloads import BatchSpec, default_suite, make_problem
from pagedprefill_sm80 import Sm80Backend
from pagedprefill_sm80.hopper.launch import kernel_call, unfit_reason
from pagedprefill_sm80.hopper.schedule import (
    DEFAULTS,
    SCHEDULE_ENV,
    from_environment,
    parse,
    resolve,
    route_flags,
    shape_unfit_reason,
    shared_bytes,
)
from pagedprefill_sm80.policy import HOPPER_BY_DEFAULT, KERNEL_ENV, choose_kernel, hopper_config, kernel_preference

# Gluon wraps Triton's own functions when it is first imported, and refuses interpreter-decorated ones unless the
# interpreter is on at that moment: import it now, under the environment the suite was started with, rather than
# inside a test below (whose fixture switches the interpreter off) whatever order the tests run in.
import triton.experimental.gluon.language  # noqa: E402, F401  isort: skip


def nvidia(cap, smem, name):
    return DeviceInfo(type="cuda", index=0, vendor="nvidia", name=name, capability=cap, warp_size=32, num_sms=132,
                      max_shared_mem=smem, triton_backend="cuda")


H200 = nvidia((9, 0), 227 * 1024, "NVIDIA H200")
A100 = nvidia((8, 0), 163 * 1024, "NVIDIA A100")
SPEC = BatchSpec(query_lens=(40, 1, 70), context_lens=(90, 33, 0), num_heads=8, num_kv_heads=2, head_size=128,
                 block_size=16, dtype=torch.bfloat16, layout="nhd")


@pytest.fixture(autouse=True)
def _described_gpus(monkeypatch):
    """These tests describe GPUs; Triton's interpreter (set for the kernel tests) would veto every GPU. Neither a
    kernel preference nor schedule flags from the caller's environment reach them."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)


def shape(**changes) -> ProblemShape:
    return problem_shape(make_problem(SPEC.replace(**changes)))


def test_forced_hopper_kernel_takes_the_shapes_it_is_built_for(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    for changes in ({}, {"head_size": 64}, {"head_size": 256},
                    {"dtype": torch.float16}, {"block_size": 64}, {"block_size": 8},
                    {"num_kv_heads": 8}, {"layout": "split"}, {"layout": "split", "head_size": 64},
                    {"sliding_window": 7, "alibi": True, "softcap": 5.0, "sinks": True},
                    {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2", "head_size": 64},
                    {"head_size": 96}, {"head_size": 96, "kv_cache_dtype": "fp8_e4m3"},
                    {"head_size": 96, "layout": "split"}, {"head_size": 256, "layout": "split"},
                    {"kv_cache_dtype": "fp8_e4m3", "layout": "split"},
                    {"kv_cache_dtype": "fp8_e5m2", "layout": "split", "head_size": 96}):
        kernel, why = choose_kernel(shape(**changes), H200)
        assert (kernel, why) == ("hopper", f"{KERNEL_ENV}=hopper"), changes
        config = Sm80Backend().tile_config(shape(**changes), H200)
        assert config.kernel == "hopper" and config.block_m == 16 * config.num_warps


@pytest.mark.parametrize("changes, words", [
    ({"layout": "split", "block_size": 8}, "block size >= 16"),
    ({"kv_cache_dtype": "fp8_e4m3", "head_size": 256}, "head sizes up to 128"),
    ({"dtype": torch.float32}, "float32"),
    ({"head_size": 80}, "head sizes"),
    ({"block_size": 4}, "block size"),
    ({"block_size": 48}, "block size"),
])
def test_shapes_it_does_not_take_run_on_the_portable_kernel_with_the_reason(monkeypatch, changes, words):
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    kernel, why = choose_kernel(shape(**changes), H200)
    assert kernel == "portable" and words in why, why
    assert Sm80Backend().tile_config(shape(**changes), H200).kernel == "portable"


def test_not_on_other_gpus_and_not_by_default(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    kernel, why = choose_kernel(shape(), A100)
    assert kernel == "portable" and "9.0" in why
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert choose_kernel(shape(), H200)[0] == ("hopper" if HOPPER_BY_DEFAULT else "portable")
    monkeypatch.setenv(KERNEL_ENV, "portable")
    assert choose_kernel(shape(), H200) == ("portable", f"{KERNEL_ENV}=portable")


def test_a_misspelt_preference_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "hoper")
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}: expected one of auto, hopper, portable, got 'hoper'"):
        kernel_preference()


def test_tensors_a_tma_view_cannot_address_fall_back_to_the_portable_kernel(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    backend = Sm80Backend()
    problem = make_problem(SPEC)
    config = backend.tile_config(problem_shape(problem), H200)
    assert unfit_reason(problem, config) is None and backend.kernel_for(problem, H200) == "hopper"
    # Keys that are a slice of a wider tensor along the head dim: heads are not contiguous rows any more.
    wide = torch.randn(problem.cache.key.shape[:-1] + (2 * SPEC.head_size,), dtype=torch.bfloat16)
    import dataclasses

    sliced = dataclasses.replace(problem, cache=dataclasses.replace(problem.cache, key=wide[..., :SPEC.head_size]))
    assert "key_cache" in unfit_reason(sliced, config)
    assert backend.kernel_for(sliced, H200) == "portable"
    # New keys one element off 16-byte alignment.
    flat = torch.randn(problem.k.numel() + 1, dtype=torch.bfloat16)[1:].view(problem.k.shape)
    shifted = dataclasses.replace(problem, k=flat)
    assert unfit_reason(shifted, config).startswith("k:")


@pytest.mark.parametrize("changes", [{}, {"layout": "split"}, {"head_size": 96, "kv_cache_dtype": "fp8_e5m2"},
                                     {"layout": "split", "kv_cache_dtype": "fp8_e4m3", "scale_as_tensor": True,
                                      "sliding_window": 9, "softcap": 5.0},
                                     {"kv_in_cache": True, "causal": False, "alibi": True, "sinks": True}],
                         ids=["nhd", "split", "nhd-d96-fp8", "split-fp8-features", "nhd-kv-in-cache"])
def test_a_launch_passes_cores_groups_and_the_kernels_tile_layout_and_schedule(changes):
    """The Hopper launch passes core's argument groups as the portable kernel's launch builds them (tokens,
    cache, batch, per-head values, scale tensors and partial rows; scales, extents, features, which scales come
    from tensors)
    and its own: five TMA descriptors at ``DESCRIPTORS``, its strides, and its tile, cache layout and resolved
    schedule as one constexpr each; under ``PINGPONG`` the launch's warps are the first consumer warpgroup's."""
    from pagedprefill.triton.arguments import Batch, Cache, Partials, PerHead, ScaleTensors, Tokens
    from pagedprefill.triton.launch import call_extents, call_features, scale_arguments
    from pagedprefill_sm80.hopper.arguments import Layout, Strides, Tile
    from pagedprefill_sm80.hopper.launch import DESCRIPTORS
    from pagedprefill_sm80.hopper.schedule import PADDED_HEADS, kernel_schedule
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    problem = make_problem(SPEC.replace(**changes))
    s = problem_shape(problem)
    config = hopper_config(s)
    call = kernel_call(problem, config, s)
    assert [type(t) for t in call.tensors] == [Tokens, *[TensorDescriptor] * 5, Cache, Batch, PerHead, ScaleTensors,
                                               Partials, torch.Tensor]
    assert call.tensors[-1] is problem.q  # no split: the arrival counters' placeholder
    assert all(isinstance(t, TensorDescriptor) for t in call.tensors[DESCRIPTORS])
    assert call.tensors[0].q is problem.q and call.tensors[0].out is problem.out
    assert call.tensors[6].block_table is problem.batch.block_table
    assert call.tensors[6].key.data_ptr() == problem.cache.key.data_ptr()
    assert call.tensors[6].key.dtype == (problem.cache.dtype.torch_dtype if problem.cache.dtype.is_fp8
                                         else problem.q.dtype)  # an FP8 cache as the type it stores
    qk_scale, scales, softcap, window, *extents, strides = call.scalars
    assert (scales, call.constexprs["SCALE_FROM_TENSOR"]) == scale_arguments(problem)
    assert tuple(extents) == call_extents(problem) and isinstance(strides, Strides)
    assert (softcap, window) == (problem.options.softcap, problem.options.sliding_window or 0)
    assert strides.q == (problem.q.stride(0), problem.q.stride(1)) and strides.table_seq == \
        problem.batch.block_table.stride(0)
    assert set(call.constexprs) == {"TILE", "LAYOUT", "FEATURES", "SCALE_FROM_TENSOR", "SCHEDULE"}
    assert call.constexprs["FEATURES"] == call_features(problem)
    group = SPEC.num_heads // SPEC.num_kv_heads
    assert call.constexprs["TILE"] == Tile(config.block_m, config.block_n, config.heads_per_tile,
                                           -(-group // config.heads_per_tile), config.num_stages, config.num_warps)
    layout = call.constexprs["LAYOUT"]
    assert isinstance(layout, Layout) and layout.SPLIT == (s.layout == "split")
    assert (layout.PAGE, layout.HEAD_DIM, layout.HEAD_SIZE) == \
        (s.block_size, s.head_size, PADDED_HEADS.get(s.head_size, s.head_size))
    assert layout.FP8_CACHE == problem.cache.dtype.is_fp8
    assert layout.X == (problem.cache.key.shape[4] if layout.SPLIT else 8)
    assert call.constexprs["SCHEDULE"] == kernel_schedule(resolve(s, config), s, config)
    assert call.options == {"num_warps": 4 if call.constexprs["SCHEDULE"].PINGPONG else config.num_warps}


def test_the_kernels_parameters_are_the_launchs_arguments_in_order():
    """A bound launch passes the tensors and scalars positionally and then the constexprs by the kernel's
    parameter names: the kernel's signature is exactly that (checked in a child process, outside Triton's
    interpreter)."""
    got = child_result("kernel_parameters")
    assert got["tensors"] + got["scalars"] + got["constexprs"] == got["parameters"], got
    assert got["parameters"][1:6] == ["k_cache", "v_cache", "k_new", "v_new", "v_cache_t"], got


def kernel_parameters() -> dict:
    """The Hopper kernel's parameter names, and how many tensors and scalars a launch passes and the names of its
    constexprs."""
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    names = list(hopper_prefill_kernel.arg_names)
    problem = make_problem(SPEC.replace(layout="split"))
    s = problem_shape(problem)
    call = kernel_call(problem, hopper_config(s), s)
    tensors, scalars = len(call.tensors), len(call.scalars)
    return {"parameters": names, "tensors": names[:tensors], "scalars": names[tensors:tensors + scalars],
            "constexprs": list(call.constexprs)}


def test_the_kernel_takes_its_tile_in_cores_order():
    """Each program's query tile is core's ``program_tile`` of its index under the schedule's ``HEAVY_FIRST``,
    handed as it is to ``tile_sequence``: the order that core's ``test_launch_order.py`` runs in Triton's
    interpreter and checks takes every query tile of every sequence once (Gluon kernels do not run there)."""
    path = importlib.util.find_spec("pagedprefill_sm80.hopper.kernel").origin
    tree = ast.parse(Path(path).read_text())
    kernel = next(node for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "hopper_prefill_kernel")
    calls = [node for node in ast.walk(kernel) if isinstance(node, ast.Call)]
    order = [ast.unparse(c) for c in calls if ast.unparse(c.func) == "program_tile"]
    assert order == ["program_tile(gl.program_id(0), gl.num_programs(0), SCHEDULE.HEAVY_FIRST)"], order
    located = [ast.unparse(c.args[0]) for c in calls if ast.unparse(c.func) == "tile_sequence"]
    assert located == ["tile"], located
    written = [ast.unparse(node) for node in ast.walk(kernel) if isinstance(node, (ast.Assign, ast.AugAssign))
               and "tile" in {target.id for target in ast.walk(node) if isinstance(target, ast.Name)
                              and isinstance(target.ctx, ast.Store)}]
    assert written == [f"tile = {order[0]}"], written


def test_every_routes_register_split_fits_the_sm():
    """``setmaxnreg`` takes multiples of 8 from 24 to 256 per thread, and the producer's and the two consumer
    warpgroups' threads share the SM's 65,536 registers: so under every schedule of every route the kernel takes,
    and every flag a caller may add."""
    from pagedprefill_sm80.hopper.schedule import kernel_schedule

    for layout in ("nhd", "split"):
        for head_size in (64, 96, 128, 256):
            for cache in ("auto", "fp8_e4m3"):
                for workload in ({}, dict(num_tokens=4096, num_seqs=2, max_query_len=2048)):
                    s = dataclasses.replace(shape(layout=layout, head_size=head_size, kv_cache_dtype=cache),
                                            **workload)
                    config = hopper_config(s)
                    if shape_unfit_reason(s, config, H200.max_shared_mem) is not None:
                        continue
                    for asked in ({}, dict(WIDE_PRODUCER=True), dict(KEY_LOADS=True, WIDE_KEY_CHUNKS=True),
                                  dict(KEY_LOADS=False, WIDE_PRODUCER=False), dict(PINGPONG=False)):
                        got = kernel_schedule(resolve(s, config, asked), s, config)
                        where = (layout, head_size, cache, workload, asked, got)
                        for regs in (got.PRODUCER_REGS, got.CONSUMER_REGS):
                            assert regs % 8 == 0 and 24 <= regs <= 256, where
                        assert got.PRODUCER_WARPS in (1, 4), where
                        assert 32 * got.PRODUCER_WARPS * got.PRODUCER_REGS + 256 * got.CONSUMER_REGS <= 65536, where


def test_the_policy_and_the_schedule_import_without_triton():
    """The policy decides a call's kernel, tile and schedule flags without compiling anything, so a process that
    only asks (``pagedprefill info``, a serving engine's planner) does not import Triton for it."""
    # Core's import selects a backend, asking Triton's driver about a GPU: deferred here, as a planner may defer
    # it. torch's CUDA builds may import Triton themselves: only what the policy adds counts.
    proc = run_child("import os, sys, torch\n"
                     "os.environ['PAGEDPREFILL_LAZY_SELECT'] = '1'\n"
                     "loaded = lambda: {m for m in sys.modules if m == 'triton' or m.startswith('triton.')}\n"
                     "before = loaded()\n"
                     "import pagedprefill_sm80.policy, pagedprefill_sm80.hopper.schedule\n"
                     "print('TRITON', sorted(loaded() - before))")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TRITON []" in proc.stdout, proc.stdout[-2000:]


#: Calls compiled for sm90 by :func:`test_compiles_for_sm90_warp_specialised_with_tma_and_wgmma`.
COMPILED = {
    "d128": {}, "d64": {"head_size": 64}, "d256": {"head_size": 256},
    # One query head per KV head: the group size, an argument equal to 1, reaches the kernel as a constant.
    "mha": {"num_kv_heads": 8}, "split-mha": {"layout": "split", "num_kv_heads": 8},
    "block64": {"block_size": 64}, "block8": {"block_size": 8},
    "features": {"sliding_window": 20, "alibi": True, "softcap": 10.0, "sinks": True, "fp8_out_scale": 0.5},
    "vllm-options": {"kv_in_cache": True, "causal": False, "skip_decode": True},
    "fp8": {"kv_cache_dtype": "fp8_e4m3"},
    "d96-mqa-block64": {"head_size": 96, "num_kv_heads": 1, "block_size": 64},
    "d96-fp8-vllm-options": {"head_size": 96, "kv_cache_dtype": "fp8_e4m3", "kv_in_cache": True, "causal": False},
    "fp8-e5m2-d64-vllm-options": {"kv_cache_dtype": "fp8_e5m2", "head_size": 64, "kv_in_cache": True,
                                  "causal": False, "sliding_window": 9, "scale_as_tensor": True},
    "split": {"layout": "split"}, "split-block64": {"layout": "split", "block_size": 64},
    "split-d96-features": {"layout": "split", "head_size": 96, "num_kv_heads": 1, "sliding_window": 20,
                           "alibi": True, "sinks": True},
    "split-d256": {"layout": "split", "head_size": 256},
    "split-vllm-options": {"layout": "split", "kv_in_cache": True, "causal": False, "sliding_window": 9},
    "split-fp8": {"layout": "split", "kv_cache_dtype": "fp8_e4m3"},
    "split-fp8-e5m2-d96-features": {"layout": "split", "kv_cache_dtype": "fp8_e5m2", "head_size": 96,
                                    "sliding_window": 20, "softcap": 10.0, "scale_as_tensor": True},
}


#: Schedules each :data:`COMPILED` call is compiled with.
SCHEDULES = {
    "heavy-first": dict(HEAVY_FIRST=True, PINGPONG=False),
    "in-order": dict(HEAVY_FIRST=False, PINGPONG=False),
    "pingpong": dict(HEAVY_FIRST=True, PINGPONG=True),
    "pingpong-wide-producer": dict(HEAVY_FIRST=True, PINGPONG=True, WIDE_PRODUCER=True),
    "pingpong-key-loads": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True),
    "pingpong-key-loads-values-first": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True),
    "pingpong-key-loads-early-keys": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True,
                                          EARLY_KEYS=True),
    "pingpong-softmax-under-pv": dict(HEAVY_FIRST=True, PINGPONG=True, SOFTMAX_UNDER_PV=True),
}


#: Bytes of spills the split layout's calls may have under the ping-pong schedule alone, and why: its copies
#: without key loads in ping-pong (the policy's schedule for no 16-bit split route at head size 128; its consumers
#: have 240 registers): clearing the stale V^T columns of the tile where a walk's keys end keeps two or three of
#: the epilogue's row registers in local memory across the key loop (stored before it, loaded after) and two
#: values around the clearing, which runs on that one tile per walk: nothing in the per-tile path.
SPLIT_COPIES_SPILLS = 20

#: Bytes of local memory calls may use under ``SOFTMAX_UNDER_PV``, and why (read in the SASS): at head size 256
#: ``ptxas`` keeps the shared memory's base address there (stored once, read at each partition's start and in
#: the barrier waits' retry paths); with ALiBi the producer warp (24 registers) keeps one value there across a
#: tile's boxes (a call with ALiBi alone does the same).
UNDER_PV_SPILLS = {"d256": 40, "features": 4}


def spill_allowance(name: str) -> int:
    """The spill bytes a compiled call ``name`` (``compiled/schedule``) may have: :data:`SPLIT_COPIES_SPILLS`
    for the split layout's copies in ping-pong, :data:`UNDER_PV_SPILLS` under ``SOFTMAX_UNDER_PV``, none for any
    other."""
    compiled, _, schedule = name.partition("/")
    if compiled.startswith("split") and schedule in ("pingpong", "pingpong-softmax-under-pv"):
        return SPLIT_COPIES_SPILLS  # the flag's rule does not take the split layout: the same code
    return UNDER_PV_SPILLS.get(compiled, 0) if schedule == "pingpong-softmax-under-pv" else 0


#: The flags the policy sets per route (:func:`pagedprefill_sm80.hopper.schedule.route_flags`) and
#: ``SOFTMAX_UNDER_PV``, off unless a schedule of :data:`SCHEDULES` names them, so that each schedule's label says
#: all it runs.
POLICY_FLAGS_OFF = dict(KEY_LOADS=False, VALUES_FIRST=False, WIDE_KEY_CHUNKS=False, EARLY_KEYS=False,
                        FP8_BOXES=False, WIDEN_TO_V=False, SOFTMAX_UNDER_PV=False)


def compile_summaries() -> dict:
    """Codegen summary of each :data:`COMPILED` call under each of :data:`SCHEDULES` on the policy's tile, with
    the launch's warps."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    for name, changes in COMPILED.items():
        problem = make_problem(SPEC.replace(**changes))
        s = problem_shape(problem)
        config = hopper_config(s)
        if s.layout == "split" and config.block_n > 64 and changes.get("alibi"):
            # On the split layout's 128-key tiles the ALiBi slopes' registers spill under every ping-pong
            # schedule (split-d96-features: 60 bytes with the copies, 12 with 32-key chunks of key loads): the
            # schedules are compared on the 64-key tile in 3 stages instead.
            config = config.with_(block_n=64, num_stages=3)
        for label, schedule in SCHEDULES.items():
            # Each label names the whole schedule: the policy's own flags for a route do not reach it.
            schedule = {**POLICY_FLAGS_OFF, **schedule}
            call = kernel_call(problem, config, s, schedule=schedule)
            summary = summarize(compile_call(hopper_prefill_kernel, call, 90), 90).to_dict()
            out[f"{name}/{label}"] = {**summary, "launch_warps": call.options["num_warps"],
                                      "tile_warps": call.constexprs["TILE"].NUM_WARPS, "block_n": config.block_n,
                                      "modelled_shared": shared_bytes(s, config, schedule)}
    return out


def without_interpreter() -> dict:
    """The environment for a child process that compiles for a GPU (Triton's interpreter, set for the kernel
    tests, decorates kernels for the CPU and Gluon refuses those)."""
    import os

    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", KERNEL_ENV, SCHEDULE_ENV)}


def test_compiles_for_sm90_warp_specialised_with_tma_and_wgmma():
    summaries = child_result("compile_summaries")
    assert len(summaries) == len(SCHEDULES) * len(COMPILED)
    for name, summary in summaries.items():
        assert summary["warp_specialized"] and summary["setmaxnreg"] > 0, name
        assert summary["wgmma"] > 0 and summary["mma_sync"] == 0, name
        # TMA boxes for every call: the NHD cache, the split layout's value pages, or the new tokens' K/V.
        assert summary["tma_copies"] > 0, name
        # Split-layout keys have no TMA view: 16-byte asynchronous copies by the producer (under key-loads,
        # loads and stores; an FP8 cache's values are copies still).
        copied = name.startswith("split") and ("fp8" in name or "/pingpong-key-loads" not in name)
        assert (summary["async_copies"] > 0) == copied, name
        assert (summary["spill_bytes"] or 0) <= spill_allowance(name), (name, summary["spill_bytes"])
        assert summary["shared_bytes"] <= H200.max_shared_mem, name
        # The policy's shared-memory model bounds what Triton allocated, and is exact but for its 1 KiB
        # allowance for the barriers under the default, ping-pong schedule.
        if summary["shared_bytes"] is not None:
            assert summary["shared_bytes"] <= summary["modelled_shared"], name
            if name.endswith("/pingpong"):
                assert summary["modelled_shared"] - summary["shared_bytes"] <= 1024, name
        # No instruction touches registers an asynchronous warpgroup MMA still owns (P of an in-flight P V).
        assert summary["wgmma_hazards"] in (0, None), name
    for call in COMPILED:
        plain, pingpong = summaries[f"{call}/heavy-first"], summaries[f"{call}/pingpong"]
        wide = summaries[f"{call}/pingpong-wide-producer"]
        fp8 = "kv_cache_dtype" in COMPILED[call]
        if call.startswith("split") and not fp8 and COMPILED[call].get("head_size", 128) <= 128:
            # Four producer warps instead of one: each thread issues a quarter of the key copies.
            assert 4 * wide["async_copies"] == pingpong["async_copies"], call
        else:
            # The producer is a warpgroup already (an FP8 cache, which it widens; head size 256, where one warp
            # spills its copy addresses), or there is nothing to copy (NHD is all TMA): the flag changes nothing.
            assert wide == pingpong, call
        key_loads = summaries[f"{call}/pingpong-key-loads"]
        if call.startswith("split"):
            # The keys by loads and stores of a producer warpgroup: fewer copies (an FP8 cache's values only),
            # the value boxes still there.
            assert key_loads["async_copies"] < pingpong["async_copies"], call
            assert key_loads["tma_copies"] > 0, call
        else:
            assert key_loads == pingpong, call
        values_first = summaries[f"{call}/pingpong-key-loads-values-first"]
        if call.startswith("split") and not fp8:  # the same copies and boxes, issued in another order
            assert values_first["async_copies"] == key_loads["async_copies"], call
            assert values_first["tma_copies"] > 0, call
        else:  # an FP8 cache's values are copies, not boxes; NHD has no key loads
            assert values_first == key_loads, call
        under_pv = summaries[f"{call}/pingpong-softmax-under-pv"]
        if COMPILED[call].get("head_size", 128) in (128, 256) and COMPILED[call].get("block_size", 16) >= 16 \
                and not call.startswith("split") and "kv_cache_dtype" not in COMPILED[call]:
            # Two tiles' MMAs in flight: the loop's body holds tile j's scores and tile j-1's P V, twice the MMAs
            # of the loop that runs them one after the other.
            assert under_pv["wgmma"] > pingpong["wgmma"], call
        else:  # off where its rule does not hold (the split layout, an FP8 cache, other head sizes, pages of 8)
            assert under_pv == pingpong, call
        if plain["tile_warps"] == 8:
            # Two consumer partitions of one warpgroup each, each with its own MMAs; the launch is the first's.
            assert pingpong["launch_warps"] == 4 and pingpong["wgmma"] == 2 * plain["wgmma"], call
        else:  # one warpgroup holds the whole tile: nothing to split
            assert pingpong == plain, call


def test_codegen_report_shows_the_hopper_kernel(tmp_path):
    """CI's codegen report compiles the Hopper kernel for the H200 rows the policy gives it, and with
    ``--portable`` the same rows on the portable kernel, and says which per row."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "report.json"
    env = without_interpreter()
    proc = subprocess.run([sys.executable, str(root / "ci" / "codegen_report.py"), "--quick", "--portable", "--json",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    h200 = [r for r in rows if r["device"] == "h200"]
    assert [(r["layout"], r["tile"]["kernel"], r.get("forced")) for r in h200] == [
        ("split", "hopper", None), ("nhd", "hopper", None), ("split", "portable", "portable"),
        ("nhd", "portable", "portable")]
    for row in h200[:2]:
        assert row["warp_specialized"] and row["setmaxnreg"] > 0 and row["tma_copies"] > 0, row
        assert row["dots"] == "wgmma" and row["spill_bytes"] == 0 and row["wgmma_hazards"] == 0, row
    assert all(r["tile"]["kernel"] == "portable" for r in rows if r["device"] == "a100")


def test_info_shows_each_routes_kernel_and_reason():
    import subprocess
    import sys

    env = {**without_interpreter(), KERNEL_ENV: "hopper"}
    proc = subprocess.run([sys.executable, "-m", "pagedprefill", "info", "--describe", "h200"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    routes = [line.split() for line in lines if line.startswith("  ") and ("hopper" in line or "portable" in line)]
    assert any(r[:4] == ["prefix-cached", "8x(1024+7168)", "nhd", "hopper"] for r in routes), proc.stdout
    fp8 = [line.split() for line in lines if line.lstrip().startswith("FP8 e4m3 KV")]
    assert sorted(r[4:6] for r in fp8) == [["nhd", "hopper"], ["split", "hopper"]], proc.stdout
    # Under auto every bench row runs the Hopper kernel and says why; the portable kernel, when asked for, says so.
    asked = (("auto", "hopper", "is the faster one"), ("portable", "portable", f"{KERNEL_ENV}=portable"))
    for wanted, kernel, reason in asked:
        env[KERNEL_ENV] = wanted
        proc = subprocess.run([sys.executable, "-m", "pagedprefill", "info", "--describe", "h200"],
                              capture_output=True, text=True, timeout=300, env=env)
        rows = [line for line in proc.stdout.splitlines() if " split " in line or " nhd " in line]
        assert len(rows) == 2 * len(default_suite()), proc.stdout  # every bench workload, two layouts
        assert all(f" {kernel} " in line and reason in line for line in rows), proc.stdout


def test_repeated_calls_rebuild_only_the_descriptors_whose_tensor_moved():
    """The launch plan's arguments for a later call equal what a fresh launch would pass (the new addresses
    with the signature's shapes, strides, boxes and layouts), reuse unchanged descriptors, and decline an
    address that lost TMA's 16-byte alignment (checked in a child process: Gluon's descriptors cannot be
    imported under Triton's interpreter)."""
    proc = run_child("import test_sm80_hopper as t; t.check_rebuilt_arguments(); print('REBUILT OK')")
    assert "REBUILT OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def run_child(code: str):
    """Run ``code`` in a Python child in this folder, outside Triton's interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          cwd=str(Path(__file__).parent), env=without_interpreter())


def child_result(function: str):
    """What this module's ``function()`` returns (JSON-serialisable), computed in a child (:func:`run_child`):
    ahead-of-time compiles run outside Triton's interpreter. Fails with the child's output when it fails."""
    import json

    proc = run_child(f"import json, test_sm80_hopper as t; print('RESULT', json.dumps(t.{function}()))")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def _flat(arguments: tuple) -> list:
    """A kernel's tensor arguments with its groups (core's named tuples, or the plain tuples of a later call)
    flattened into their fields, in signature order."""
    return [field for arg in arguments for field in (arg if isinstance(arg, tuple) else (arg,))]


def _address(t: torch.Tensor) -> tuple:
    """What a launch reads of a plain tensor argument: its address, with the shape, strides and element size that
    make it the same argument of the signature. (An FP8 cache is its ``uint8`` bytes in core's tensor groups of a
    later call, and the float8 view of them at the first: the same address.)"""
    return t.data_ptr(), t.shape, t.stride(), t.element_size()


def check_rebuilt_arguments():
    import dataclasses

    from pagedprefill_sm80.hopper.launch import DESCRIPTORS, _Arguments, call_tensors_of

    # An FP8 cache is described through views of its bytes as FP8: rebuilt with that type, not the bytes'
    # (under FP8_BOXES the split layout's key cache too).
    for changes, flags in (({"layout": "nhd"}, {}), ({"layout": "split"}, {}),
                           ({"layout": "nhd", "kv_cache_dtype": "fp8_e4m3", "scale_as_tensor": True}, {}),
                           ({"layout": "split", "kv_cache_dtype": "fp8_e4m3"}, {"FP8_BOXES": True}),
                           ({"layout": "nhd", "head_size": 96}, {})):
        first = make_problem(SPEC.replace(**changes))
        config = hopper_config(problem_shape(first))
        flags = resolve(problem_shape(first), config, flags)
        grid = launch_grid(problem_shape(first), config)
        arguments = _Arguments(first, call_tensors_of(first, config, flags, grid), config, grid)
        later = make_problem(SPEC.replace(**changes, seed=7))
        got, want = arguments(later), call_tensors_of(later, config, flags, grid)
        assert len(got) == len(want)
        for g, w in zip(got[DESCRIPTORS], want[DESCRIPTORS]):
            assert (g.base.data_ptr(), g.base.dtype, g.shape, g.strides, g.block_shape, g.layout) == \
                (w.base.data_ptr(), w.base.dtype, w.shape, w.strides, w.block_shape, w.layout)
        # The tensor groups around the descriptors, field by field, as a fresh launch passes them.
        groups = [i for i in range(len(want)) if i not in range(DESCRIPTORS.start, DESCRIPTORS.stop)]
        got_plain, want_plain = _flat([got[i] for i in groups]), _flat([want[i] for i in groups])
        assert len(got_plain) == len(want_plain) and all(isinstance(w, torch.Tensor) for w in want_plain)
        assert [_address(g) for g in got_plain] == [_address(w) for w in want_plain], changes
        again = arguments(later)
        assert all(a is b for a, b in zip(again[DESCRIPTORS], got[DESCRIPTORS]))
        shifted = torch.empty(later.k.numel() + 8, dtype=later.k.dtype)[1:1 + later.k.numel()].view(later.k.shape)
        assert arguments(dataclasses.replace(later, k=shifted)) is None


def test_repeated_calls_pass_the_descriptors_encoded_once_per_address():
    """The launch plan hands Triton's compiled launcher exactly the arguments Triton's own launch path would,
    with each TMA descriptor encoded when its tensor moved and not again for the next call (checked in a child
    process, with the driver's encoder replaced by one that records what it encodes)."""
    proc = run_child("import test_sm80_hopper as t; t.check_encoded_launch(); print('ENCODED OK')")
    assert "ENCODED OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


class _RecordingEncoder:
    """Stands in for the driver's ``fill_tma_descriptor``: an encoding that shows every input, and a count."""

    def __init__(self):
        self.calls = 0

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block_size, shape, strides, padding):
        self.calls += 1
        return ("tensor map", ptr, swizzle, elem_size, elem_type, tuple(block_size), tuple(shape), tuple(strides),
                padding)


def _same_arguments(got: list, want: list) -> bool:
    """Whether two launches' argument lists agree, their tensor groups flattened (tensors by :func:`_address`)."""
    def key(a):
        return _address(a) if isinstance(a, torch.Tensor) else a
    got, want = _flat(got), _flat(want)
    return len(got) == len(want) and all(key(g) == key(w) for g, w in zip(got, want))


def check_encoded_launch():
    import functools
    import types

    from pagedprefill_sm80.hopper.encoded import EncodedLauncher
    from pagedprefill_sm80.hopper.launch import DESCRIPTORS, _Arguments, kernel_call
    from triton.backends.nvidia.driver import wrap_handle_tensordesc
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    encoder = _RecordingEncoder()
    driver.set_active(types.SimpleNamespace(utils=encoder))
    positions = range(DESCRIPTORS.start, DESCRIPTORS.stop)
    for changes in ({"layout": "nhd"}, {"layout": "split"}, {"layout": "nhd", "kv_cache_dtype": "fp8_e4m3"},
                    {"layout": "nhd", "head_size": 96}):
        first = make_problem(SPEC.replace(**changes))
        shape = problem_shape(first)
        call = kernel_call(first, hopper_config(shape), shape)
        args = call.tensors + call.scalars
        assert [i for i, a in enumerate(args) if isinstance(a, TensorDescriptor)] == list(positions), changes
        # Triton's launcher as the driver builds it for this kernel: the descriptors' positions in the signature
        # and an encoding of each (values of the kind the compiler records), around an entry point that records.
        launched = []
        signature = {f"a{i}": "tensordesc<bf16[64, 128]>" if i in positions else "i32" for i in range(len(args))}
        encodings = tuple({"swizzle": 3, "elem_size": 2, "elem_type": 10 + i, "block_size": [64, 128 + i],
                           "fp4_padded": False} for i in range(len(positions)))
        record = functools.partial(lambda into, *a: into.append(list(a)), launched)
        run = types.SimpleNamespace(launch=wrap_handle_tensordesc(record, signature, encodings),
                                    global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                                    launch_pdl=False)
        compiled = types.SimpleNamespace(run=run)
        encoded = EncodedLauncher.of(compiled, positions)
        assert encoded is not None
        arguments = _Arguments(first, call.tensors, hopper_config(shape), call.grid, encoded)
        head = (7, 1, 1, 99, "function", "metadata", None, None, None)
        other = make_problem(SPEC.replace(**changes, seed=7))
        new_tokens_moved = dataclasses.replace(other, k=other.k.clone(), v=other.v.clone())
        for later, moved in ((first, 5), (first, 0), (other, 5), (new_tokens_moved, 2), (new_tokens_moved, 0)):
            # Float scales belong to the signature (another value, another plan): the scalars of a fresh call.
            fresh = kernel_call(later, hopper_config(shape), shape)
            before = encoder.calls
            encoded(*head, *arguments(later), *fresh.scalars)
            assert encoder.calls - before == moved, (changes, moved, encoder.calls - before)
            run.launch(*head[:5], False, False, None, None, *head[5:], *fresh.tensors, *fresh.scalars)
            assert _same_arguments(launched[-2], launched[-1]), changes
        # Where the launcher is built otherwise (the descriptors elsewhere), the plan keeps Triton's path.
        assert EncodedLauncher.of(compiled, range(positions.start + 1, positions.stop + 1)) is None
        for changed in ({"global_scratch_size": 128}, {"launch": lambda *a: None}):
            assert EncodedLauncher.of(types.SimpleNamespace(run=types.SimpleNamespace(**{**vars(run), **changed})),
                                      positions) is None


def test_schedule_flags_parse_by_name():
    assert parse("") == {}
    assert parse("PINGPONG=1, EARLY_KEYS=0") == {"PINGPONG": True, "EARLY_KEYS": False}
    assert set(parse(",".join(f"{name}=1" for name in DEFAULTS))) == set(DEFAULTS)
    for bad in ("PINGPONG", "PINGPONG=yes", "PING=1"):
        with pytest.raises(ValueError, match=f"schedule: expected NAME=0 or NAME=1 .*got '{bad}'"):
            parse(bad)


#: Flags of schedules that measured slower than the kernel's, or level with it, and were removed with their code.
REMOVED_FLAGS = ("TURNS", "OVERLAP", "VT_COPIES", "THREAD_ARRIVALS", "NEW_VALUES_T", "PRODUCER_WIDENS")


@pytest.mark.parametrize("name", REMOVED_FLAGS)
def test_a_removed_schedule_flag_from_the_environment_is_refused_by_name(monkeypatch, name):
    """``PAGEDPREFILL_SM80_SCHEDULE`` naming a flag the kernel does not have (here those of removed schedules,
    which scripts and notes may still set) fails every resolution (the environment's, the launch's, the
    shared-memory model's), naming the variable, the flag and the flags there are: ignored, it would have a run
    time or check the default schedule under another schedule's name."""
    assert name not in DEFAULTS
    with pytest.raises(ValueError, match=f"schedule: expected NAME=0 or NAME=1 .*got '{name}=0'"):
        parse(f"{name}=0")
    monkeypatch.setenv(SCHEDULE_ENV, f"PINGPONG=1,{name}=1")
    split = shape(layout="split")
    expected = f"^{SCHEDULE_ENV}: schedule: expected NAME=0 or NAME=1 with NAME one of {', '.join(DEFAULTS)}, " \
               f"got '{name}=1'$"
    for resolution in (from_environment, lambda: resolve(split, hopper_config(split)),
                       lambda: shared_bytes(split, hopper_config(split)),
                       lambda: kernel_call(make_problem(SPEC.replace(layout="split")), hopper_config(split), split)):
        with pytest.raises(ValueError, match=expected):
            resolution()


def test_auto_leaves_a_route_not_yet_run_on_a_gpu_to_the_portable_kernel(monkeypatch):
    """A route listed in ``UNVERIFIED`` runs when asked for; ``auto`` keeps it on the portable kernel, with the
    reason, until the suites have passed on a GPU. (The list is empty today; a listed split FP8 route stands in.)"""
    import pagedprefill_sm80.policy as policy

    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(policy, "UNVERIFIED", frozenset({("split", 128, "fp8_e4m3")}))
    kernel, why = choose_kernel(shape(kv_cache_dtype="fp8_e4m3", layout="split"), H200)
    assert kernel == "portable" and "only when asked for" in why and "passed the suites on a GPU" in why, why
    assert choose_kernel(shape(kv_cache_dtype="fp8_e4m3"), H200)[0] == "hopper"  # NHD is not listed
    monkeypatch.setenv(KERNEL_ENV, "hopper")
    assert choose_kernel(shape(kv_cache_dtype="fp8_e4m3", layout="split"), H200) == ("hopper", f"{KERNEL_ENV}=hopper")


def test_auto_takes_the_split_layouts_fp8_cache(monkeypatch):
    """It passed the suites on the H200 and measured faster than the portable kernel."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert choose_kernel(shape(kv_cache_dtype="fp8_e4m3", layout="split"), H200) == \
        ("hopper", "the Hopper kernel takes this shape and is the faster one")


def test_flags_that_do_not_apply_to_a_call_are_dropped_for_the_launch_and_the_memory_model():
    """``resolve`` is what the launch compiles and what ``shared_bytes`` counts: flags a call's layout or cache
    cannot take are dropped from both (the V ring that ``WIDEN_TO_V`` would fill takes a 16-bit cache's values
    by boxes of V^T pages, which the model counts as a ring of their own)."""
    from pagedprefill_sm80.hopper.schedule import kernel_schedule

    odd = dict(WIDE_PRODUCER=True, KEY_LOADS=True, VALUES_FIRST=True, WIDE_KEY_CHUNKS=True, EARLY_KEYS=True,
               F32_WIDENING=True, FP8_BOXES=True, WIDEN_TO_V=True)
    nhd = shape()
    config = hopper_config(nhd)
    flags = resolve(nhd, config, odd)
    assert not any(flags[name] for name in odd), flags  # NHD reads by TMA boxes only, a 16-bit cache widens none
    assert flags == resolve(nhd, config) and shared_bytes(nhd, config, odd) == shared_bytes(nhd, config)
    problem = make_problem(SPEC)
    assert kernel_call(problem, config, nhd, odd).constexprs == kernel_call(problem, config, nhd).constexprs
    split = shape(layout="split")
    n64 = hopper_config(split).with_(block_n=64, num_stages=3)
    for name in ("F32_WIDENING", "FP8_BOXES", "WIDEN_TO_V"):  # an FP8 cache's only
        assert not resolve(split, n64, {name: True})[name], name
    assert shared_bytes(split, n64, dict(WIDEN_TO_V=True)) == shared_bytes(split, n64) > shared_bytes(nhd, n64)
    split_fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    flags = resolve(split_fp8, hopper_config(split_fp8), odd)
    # The producer widens an FP8 cache's tiles through its own ring: no value boxes to issue first, no room in
    # its registers for wider chunks of key loads, or for loading them early.
    assert flags["KEY_LOADS"] and not (flags["VALUES_FIRST"] or flags["WIDE_KEY_CHUNKS"] or flags["EARLY_KEYS"])
    assert kernel_schedule(flags, split_fp8, hopper_config(split_fp8)).KEY_LOADS == 32


def test_an_fp8_cache_is_widened_by_a_producer_warpgroup_under_every_schedule():
    """The producer warpgroup widens each FP8 tile once into the 16-bit ring both consumers read, on both layouts
    and whatever the schedule asks for: four producer warps with the registers of a 16-byte slice of each tile
    (two 64-key chunks of key loads are a 16-bit cache's only), the rest to the consumers, within the SM's
    registers. A 16-bit NHD cache keeps one producer warp, which only issues TMA boxes."""
    from pagedprefill_sm80.hopper.schedule import WIDENING_CONSUMER_REGS, WIDENING_PRODUCER_REGS

    for layout in ("nhd", "split"):
        for cache in ("fp8_e4m3", "fp8_e5m2"):
            problem = make_problem(SPEC.replace(layout=layout, kv_cache_dtype=cache))
            s = problem_shape(problem)
            for schedule in ({}, dict(WIDE_PRODUCER=False, KEY_LOADS=False), dict(PINGPONG=False),
                             dict(KEY_LOADS=True, WIDE_KEY_CHUNKS=True), dict(WIDE_PRODUCER=True)):
                call = kernel_call(problem, hopper_config(s), s, schedule)
                got = call.constexprs["SCHEDULE"]
                assert call.constexprs["LAYOUT"].FP8_CACHE, (layout, cache)
                assert (got.PRODUCER_WARPS, got.PRODUCER_REGS, got.CONSUMER_REGS) == \
                    (4, WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS), (layout, cache, schedule)
    assert 128 * WIDENING_PRODUCER_REGS + 256 * WIDENING_CONSUMER_REGS <= 65536
    problem = make_problem(SPEC)
    call = kernel_call(problem, hopper_config(shape()), shape())
    assert call.constexprs["SCHEDULE"].PRODUCER_WARPS == 1 and not call.constexprs["LAYOUT"].FP8_CACHE


def test_key_loads_apply_to_split_tiles_of_at_least_32_keys_with_a_warpgroups_registers(monkeypatch):
    """``KEY_LOADS`` reads split keys 32 at a time through a producer warpgroup: dropped for NHD and for
    narrower tiles, and the launch gives that warpgroup the registers of one that widens FP8 tiles."""
    from dataclasses import replace

    from pagedprefill_sm80.hopper.schedule import WIDENING_CONSUMER_REGS, WIDENING_PRODUCER_REGS

    split = shape(layout="split")
    config = hopper_config(split).with_(block_n=64, num_stages=3)  # one 32-key chunk's registers
    asked = dict(KEY_LOADS=True)
    assert resolve(split, config, asked)["KEY_LOADS"]
    assert not resolve(shape(), hopper_config(shape()), asked)["KEY_LOADS"]
    assert not resolve(split, replace(config, block_n=16), asked)["KEY_LOADS"]
    assert not resolve(split, config, dict(KEY_LOADS=False))["KEY_LOADS"]
    # Value boxes first: with key loads only, and only where the values are boxes.
    first = dict(KEY_LOADS=True, VALUES_FIRST=True)
    assert resolve(split, config, first)["VALUES_FIRST"]
    assert not resolve(split, config, dict(KEY_LOADS=False, VALUES_FIRST=True))["VALUES_FIRST"]
    split_fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve(split_fp8, hopper_config(split_fp8), first)["VALUES_FIRST"]
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split, asked)
    got = call.constexprs["SCHEDULE"]
    assert got.KEY_LOADS == 32 and got.PRODUCER_WARPS == 4
    assert (got.PRODUCER_REGS, got.CONSUMER_REGS) == (WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS)
    copies = kernel_call(make_problem(SPEC.replace(layout="split")), config, split, dict(KEY_LOADS=False))
    assert copies.constexprs["SCHEDULE"].KEY_LOADS == 0 and copies.constexprs["SCHEDULE"].PRODUCER_WARPS == 1


def test_the_policy_reads_split_16_bit_caches_with_key_loads(monkeypatch):
    """Where they measured faster than the 16-byte copies: ``KEY_LOADS`` and ``VALUES_FIRST`` on the split
    layout's 16-bit cache at head sizes 128 and 256 on every tile, and at head sizes 64 and 96 on tiles of more
    than 64 keys (which the policy gives every split call of theirs), the copies elsewhere; the policy's flags
    are :func:`route_flags`' for its tile, the environment and a caller's flags override them, and ``info``'s
    reason names the flags."""
    from pagedprefill_sm80.policy import hopper_schedule

    assert not DEFAULTS["KEY_LOADS"] and not DEFAULTS["VALUES_FIRST"]  # the kernel's own defaults stay off
    for head_size in (64, 96, 128, 256):
        for layout, cache in (("split", "auto"), ("split", "fp8_e4m3"), ("nhd", "auto")):
            if cache != "auto" and head_size > 128:
                continue  # the Hopper kernel reads FP8 caches up to head size 128
            s = shape(layout=layout, head_size=head_size, kv_cache_dtype=cache)
            flags = resolve(s, hopper_config(s))
            assert hopper_schedule(s) == route_flags(s, hopper_config(s).block_n), (layout, head_size, cache)
            assert hopper_schedule(s, block_n=64) == route_flags(s, 64), (layout, head_size, cache)
            taken = layout == "split" and cache == "auto"
            assert (flags["KEY_LOADS"], flags["VALUES_FIRST"]) == (taken, taken), (layout, head_size, cache)
            assert bool(hopper_schedule(s).get("KEY_LOADS")) == taken
            # 64-key tiles: the copies at head sizes 64 and 96, the loads at 128 and 256.
            assert bool(hopper_schedule(s, block_n=64).get("KEY_LOADS")) == (taken and head_size in (128, 256))
            kernel, why = Sm80Backend().kernel_choice(s, H200)
            flags_named = "KEY_LOADS+VALUES_FIRST" + "+WIDE_KEY_CHUNKS+EARLY_KEYS" * (head_size <= 128)
            assert (f"; schedule {flags_named}" in why) == taken, why
            # (an FP8 cache's page boxes: test_fp8_boxes_apply_to_the_split_layouts_fp8_cache_at_full_head_sizes;
            # short calls' 64-key tiles keep the V^T ring: test_the_policy_widens_split_fp8_values_into_the_v_ring)
            boxes = layout == "split" and cache != "auto" and head_size != 96
            if cache != "auto":
                assert hopper_schedule(s) == ({"FP8_BOXES": True} if boxes else {}), (layout, head_size)
            assert ("; schedule FP8_BOXES" in why) == (boxes and kernel == "hopper"), why
            assert kernel == "hopper" or not taken
    split = shape(layout="split")
    config = hopper_config(split)
    assert not resolve(split, config, dict(VALUES_FIRST=False))["VALUES_FIRST"]
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=0")
    assert not resolve(split, config)["KEY_LOADS"]
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split)
    assert not call.constexprs["SCHEDULE"].KEY_LOADS and not call.constexprs["SCHEDULE"].VALUES_FIRST
    monkeypatch.delenv(SCHEDULE_ENV)
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split)
    assert call.constexprs["SCHEDULE"].KEY_LOADS and call.constexprs["SCHEDULE"].VALUES_FIRST


def test_the_policy_reads_128_key_split_tiles_with_64_key_chunks_at_head_sizes_64_to_256():
    """Long calls of the split layout's 16-bit cache (128-key tiles) take ``KEY_LOADS``, ``VALUES_FIRST`` and
    ``WIDE_KEY_CHUNKS`` at head sizes 64, 96 and 128 (a whole tile in flight in two chunks: faster than four
    32-key chunks); head size 256 (32-key tiles) keeps 32-key chunks, an FP8 cache its page boxes, NHD none of
    them; ``info`` names what the tile takes."""
    from pagedprefill_sm80.policy import hopper_schedule

    names = ("KEY_LOADS", "VALUES_FIRST", "WIDE_KEY_CHUNKS", "EARLY_KEYS")
    for head_size in (64, 96, 128, 256):
        for layout, cache in (("split", "auto"), ("split", "fp8_e4m3"), ("nhd", "auto")):
            if cache != "auto" and head_size != 128:
                continue
            s = dataclasses.replace(shape(layout=layout, head_size=head_size, kv_cache_dtype=cache),
                                    num_tokens=4096, num_seqs=2, max_query_len=2048)
            assert s.workload == "long"
            config = Sm80Backend().tile_config(s, H200)
            flags = resolve(s, config)
            split16 = layout == "split" and cache == "auto"
            expected = (split16, split16, split16 and head_size <= 128, split16 and head_size <= 128)
            assert tuple(flags[n] for n in names) == expected, (layout, head_size, cache, config)
            assert tuple(bool(hopper_schedule(s, config.block_n).get(n)) for n in names) == expected
            why = Sm80Backend().kernel_choice(s, H200)[1]
            taken = "+".join(n for n, on in zip(names, expected) if on) or "FP8_BOXES+WIDEN_TO_V" * (cache != "auto")
            assert f"; schedule {taken}" in why if taken else "schedule" not in why, why
    # A tile of 64 keys at head size 64 (a caller's, or a table's) gets neither the loads nor their chunks.
    s64 = dataclasses.replace(shape(layout="split", head_size=64), num_tokens=4096, num_seqs=2, max_query_len=2048)
    assert hopper_schedule(s64, 64) == {} and hopper_schedule(s64)["WIDE_KEY_CHUNKS"]


def test_split_short_calls_take_128_key_tiles_at_head_sizes_64_to_128():
    """The split layout's short calls of a 16-bit cache at head sizes 64, 96 and 128 take 128 keys in a 2-deep
    ring, with 64-key chunks of loads issued early, where they measured faster than 64-key tiles on the H200
    (many short at head size 128: 379.8 vs 367.6 TFLOP/s; 64: 284.6 vs 244.9; 96: 323.5 vs 278.2); an FP8 cache
    keeps its 64-key tiles (128 keys with its values widened into the V ring measured 0.97 x); the tile fits an
    sm90 GPU."""
    for head_size, cache, expected in ((128, "auto", (128, 2)), (64, "auto", (128, 2)), (96, "auto", (128, 2)),
                                       (128, "fp8_e4m3", (64, 2))):
        s = shape(layout="split", head_size=head_size, kv_cache_dtype=cache)
        assert s.workload == "short"
        config = Sm80Backend().tile_config(s, H200)
        assert (config.kernel, config.block_n, config.num_stages) == ("hopper", *expected), (head_size, cache)
        assert shape_unfit_reason(s, config, H200.max_shared_mem) is None
        if cache == "auto":
            flags = resolve(s, config)
            assert all(flags[n] for n in ("KEY_LOADS", "VALUES_FIRST", "WIDE_KEY_CHUNKS", "EARLY_KEYS")), flags


def test_split_short_tiles_compile_for_sm90_without_spills():
    """The policy's tiles and schedules for the split layout's short calls at head sizes 64 and 96 (128 keys, four
    query heads per tile, early 64-key chunks of key loads; the bench has no such row, so the codegen report
    does not compile them) compile for sm90 with warpgroup MMAs and no spills."""
    summaries = child_result("compile_split_short_tiles")
    assert set(summaries) == {"64", "96"}, summaries
    for head_size, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, (head_size, summary)


def compile_split_short_tiles() -> dict:
    """Codegen summaries, by head size, of short split calls at head sizes 64 and 96 on the policy's tile."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    for head_size in (64, 96):
        problem = make_problem(SPEC.replace(layout="split", head_size=head_size))
        s = problem_shape(problem)
        config = Sm80Backend().tile_config(s, H200)
        assert s.workload == "short" and (config.block_n, config.heads_per_tile) == (128, 4), config
        out[str(head_size)] = summarize(compile_call(hopper_prefill_kernel, kernel_call(problem, config, s), 90),
                                        90).to_dict()
    return out


def test_head_size_64_nhd_long_calls_take_256_keys_in_3_stages():
    """256 keys per step in a 3-deep ring at head size 64 (NHD, long calls), where it measured 1.07 x over 128
    keys; the shipped table's tuned entry agrees, and ``pagedprefill tune`` offers the tile."""
    from pagedprefill_sm80.policy import hopper_search_space

    s = dataclasses.replace(shape(head_size=64), num_tokens=4096, num_seqs=2, max_query_len=2048)
    rule = hopper_config(s)
    assert (rule.block_n, rule.num_stages) == (256, 3) and shape_unfit_reason(s, rule, H200.max_shared_mem) is None
    assert Sm80Backend().tile_config(s, H200).with_(kernel="hopper") == rule
    short = shape(head_size=64)
    assert short.workload == "short" and hopper_config(short).block_n == 128
    assert hopper_config(dataclasses.replace(s, layout="split")).block_n == 128
    assert any(c.block_n == 256 for c in hopper_search_space(short, H200))


def test_wide_key_chunks_apply_to_16_bit_split_tiles_of_more_than_64_keys(monkeypatch):
    """``WIDE_KEY_CHUNKS`` loads 64 keys per chunk: the kernel takes the chunk as ``KEY_LOADS``, and its producer
    the registers of two such chunks."""
    from pagedprefill_sm80.hopper.schedule import WIDE_CHUNK_CONSUMER_REGS, WIDE_CHUNK_PRODUCER_REGS, Schedule

    split = shape(layout="split")
    n128 = hopper_config(split).with_(block_n=128, num_stages=2)
    wide = dict(WIDE_KEY_CHUNKS=True)
    assert resolve(split, n128, wide)["WIDE_KEY_CHUNKS"]
    assert not resolve(split, n128, dict(wide, KEY_LOADS=False))["WIDE_KEY_CHUNKS"]
    assert not resolve(split, n128.with_(block_n=64, num_stages=3), wide)["WIDE_KEY_CHUNKS"]
    split_fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve(split_fp8, n128, dict(wide, KEY_LOADS=True))["WIDE_KEY_CHUNKS"]
    problem = make_problem(SPEC.replace(layout="split"))
    got = kernel_call(problem, n128, split, wide).constexprs["SCHEDULE"]
    assert got.KEY_LOADS == 64 and "WIDE_KEY_CHUNKS" not in Schedule._fields
    assert (got.PRODUCER_REGS, got.CONSUMER_REGS) == (WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS)
    assert 128 * WIDE_CHUNK_PRODUCER_REGS + 256 * WIDE_CHUNK_CONSUMER_REGS <= 65536
    # The policy's, on 128-key tiles.
    assert kernel_call(problem, n128, split).constexprs["SCHEDULE"].KEY_LOADS == 64
    assert kernel_call(problem, n128, split, dict(WIDE_KEY_CHUNKS=False)).constexprs["SCHEDULE"].KEY_LOADS == 32


def test_wide_key_chunks_compile_for_sm90_without_spills():
    """Two 64-key chunks in flight fit the producer's registers and leave the consumers enough (sm90, no
    spills), with the register split of :data:`WIDE_CHUNK_PRODUCER_REGS` in the code."""
    summary = child_result("compile_wide_key_chunks")
    assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0 and summary["async_copies"] == 0, summary
    assert summary["producer_regs_set"] and summary["consumer_regs_set"], summary


def compile_wide_key_chunks() -> dict:
    """Codegen summary of the split layout's 128-key tile under ``WIDE_KEY_CHUNKS``, and whether its PTX sets
    the producer's and the consumers' register counts."""
    import re

    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel
    from pagedprefill_sm80.hopper.schedule import WIDE_CHUNK_CONSUMER_REGS, WIDE_CHUNK_PRODUCER_REGS

    problem = make_problem(SPEC.replace(layout="split"))
    s = problem_shape(problem)
    call = kernel_call(problem, hopper_config(s).with_(block_n=128, num_stages=2), s, dict(WIDE_KEY_CHUNKS=True))
    compiled = compile_call(hopper_prefill_kernel, call, 90)
    ptx = compiled.asm["ptx"]
    counts = {m.groups() for m in re.finditer(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx)}
    return {**summarize(compiled, 90).to_dict(),
            "producer_regs_set": ("dec", str(WIDE_CHUNK_PRODUCER_REGS)) in counts,
            "consumer_regs_set": ("inc", str(WIDE_CHUNK_CONSUMER_REGS)) in counts}


def test_early_keys_apply_where_the_producer_loads_a_tile_in_one_or_two_chunks():
    """``EARLY_KEYS`` needs the split layout's key loads of a 16-bit cache, and a tile of at most two chunks (the
    registers the loads hold anyway): the policy's 128-key tiles (64-key chunks), 64-key tiles (32) and head size
    256's 32-key tiles; not 128-key tiles in 32-key chunks, an FP8 cache, NHD, or the copies."""

    early = dict(EARLY_KEYS=True)
    split = shape(layout="split")
    n128 = hopper_config(split).with_(block_n=128, num_stages=2)
    n64 = hopper_config(split).with_(block_n=64, num_stages=3)
    assert resolve(split, n128, early)["EARLY_KEYS"]  # the policy's 64-key chunks
    assert resolve(split, n64, early)["EARLY_KEYS"]  # two chunks of 32
    assert not resolve(split, n128, dict(early, WIDE_KEY_CHUNKS=False))["EARLY_KEYS"]  # four of 32
    assert not resolve(split, n128, dict(early, KEY_LOADS=False))["EARLY_KEYS"]
    d256 = shape(layout="split", head_size=256)
    assert resolve(d256, hopper_config(d256), early)["EARLY_KEYS"]
    fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve(fp8, hopper_config(fp8), dict(early, KEY_LOADS=True))["EARLY_KEYS"]
    assert not resolve(shape(), hopper_config(shape()), early)["EARLY_KEYS"]
    assert not resolve(split, n128, dict(EARLY_KEYS=False))["EARLY_KEYS"]  # a caller turns it off


def test_the_policy_loads_split_keys_early_up_to_head_size_128():
    """The split layout's key loads of a 16-bit cache are issued before their buffer is free at head sizes 64, 96
    and 128 (1.03-1.09 x on the split rows), on the policy's tiles of long and short calls; not at head size 256
    (0.985 x), not with an FP8 cache or in the NHD layout."""
    from pagedprefill_sm80.policy import hopper_schedule

    for head_size in (64, 96, 128, 256):
        for workload in ("short", "long"):
            changes = dict(num_tokens=4096, num_seqs=2, max_query_len=2048) if workload == "long" else {}
            for layout, cache in (("split", "auto"), ("split", "fp8_e4m3"), ("nhd", "auto")):
                if cache != "auto" and head_size != 128:
                    continue
                s = dataclasses.replace(shape(layout=layout, head_size=head_size, kv_cache_dtype=cache), **changes)
                assert s.workload == workload
                config = Sm80Backend().tile_config(s, H200)
                early = resolve(s, config)["EARLY_KEYS"]
                expected = layout == "split" and cache == "auto" and head_size <= 128 and config.block_n > 32 \
                    and (head_size == 128 or config.block_n > 64)
                assert early == expected, (head_size, workload, layout, cache, config)
                assert bool(hopper_schedule(s, config.block_n).get("EARLY_KEYS")) == expected
                assert ("EARLY_KEYS" in Sm80Backend().kernel_choice(s, H200)[1]) == expected


def test_early_keys_compile_for_sm90_without_spills():
    """The split layout's keys loaded before their buffer is free, on the policy's tiles of head sizes 96 and 128
    (128 keys in 64-key chunks), 64 keys in 32-key chunks, and head size 256's 32 keys: no spills, and code
    that differs from the same tile's without it."""
    summaries = child_result("compile_early_keys")
    assert len(summaries) == 4
    for name, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, (name, summary)
        assert summary["differs"], name


def compile_early_keys() -> dict:
    """Codegen summaries of split tiles under ``EARLY_KEYS``, each with whether its PTX differs without it."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    long = dict(query_lens=(400, 300), context_lens=(500, 0))
    out = {}
    for name, changes, tile in (("d128_n128", long, (128, 2)), ("d96_n128", dict(long, head_size=96), (128, 2)),
                                ("d128_n64", {}, (64, 3)), ("d256_n32", dict(head_size=256), (32, 2))):
        problem = make_problem(SPEC.replace(layout="split", **changes))
        s = problem_shape(problem)
        config = hopper_config(s).with_(block_n=tile[0], num_stages=tile[1])
        # The policy's own flags for these routes take EARLY_KEYS up to head size 128: both are named here.
        early = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(EARLY_KEYS=True)), 90)
        plain = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(EARLY_KEYS=False)), 90)
        out[name] = {**summarize(early, 90).to_dict(), "differs": ptx_code(early) != ptx_code(plain)}
    return out


def ptx_code(compiled) -> list:
    """The instructions of a compiled kernel's PTX, without its debug information (source lines, DWARF)."""
    code = compiled.asm["ptx"].split(".section")[0]  # the DWARF sections come last
    return [line for line in code.splitlines() if not line.strip().startswith((".loc", ".file", "//"))]


def test_f32_widening_applies_where_the_producer_widens_fp8_tiles_to_bfloat16():
    """``F32_WIDENING`` needs the producer's widening of an FP8 cache (both layouts) and a bfloat16 call: not
    float16 (one packed conversion from FP8 already) or a 16-bit cache; on unless asked off (1.50 x NHD, 1.26 x
    split on the FP8 row: the direct widening's scalar conversions take the exponentials' pipe), and in the
    launch's constexprs."""

    f32 = dict(F32_WIDENING=True)
    for layout in ("nhd", "split"):
        fp8 = shape(layout=layout, kv_cache_dtype="fp8_e4m3")
        config = hopper_config(fp8)
        assert resolve(fp8, config)["F32_WIDENING"], layout  # on by default
        assert not resolve(fp8, config, dict(F32_WIDENING=False))["F32_WIDENING"], layout
        half = shape(layout=layout, kv_cache_dtype="fp8_e4m3", dtype=torch.float16)
        assert not resolve(half, hopper_config(half), f32)["F32_WIDENING"], layout
        assert not resolve(shape(layout=layout), hopper_config(shape(layout=layout)), f32)["F32_WIDENING"]
    fp8 = shape(kv_cache_dtype="fp8_e4m3")
    problem = make_problem(SPEC.replace(kv_cache_dtype="fp8_e4m3"))
    assert kernel_call(problem, hopper_config(fp8), fp8).constexprs["SCHEDULE"].F32_WIDENING
    direct = kernel_call(problem, hopper_config(fp8), fp8, dict(F32_WIDENING=False))
    assert not direct.constexprs["SCHEDULE"].F32_WIDENING


def test_f32_widening_compiles_for_sm90_without_scalar_conversions():
    """FP8 tiles widened through float32, on the policy's FP8 tiles of both layouts: no spills, code that differs
    from the direct widening, and (where the disassembler ships with Triton) no scalar float16-to-bfloat16
    conversion left, where the direct widening has one per element."""
    summaries = child_result("compile_f32_widening")
    assert sorted(summaries) == ["nhd", "split"]
    for name, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, (name, summary)
        assert summary["differs"], name
        if summary["scalar_conversions"] is not None:
            assert summary["scalar_conversions"] == 0 < summary["direct_scalar_conversions"], (name, summary)


def compile_f32_widening() -> dict:
    """Codegen summaries of FP8 calls under ``F32_WIDENING``, with whether the PTX differs from the direct
    widening and each one's count of scalar float16-to-bfloat16 conversions in the SASS (None without the
    disassembler)."""
    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    def scalar_conversions(compiled):
        text = sass(compiled)
        return None if text is None else text.count("F2F.BF16.F16")

    out = {}
    for layout in ("nhd", "split"):
        problem = make_problem(SPEC.replace(layout=layout, kv_cache_dtype="fp8_e4m3",
                                            query_lens=(400, 300), context_lens=(500, 0)))
        s = problem_shape(problem)
        config = hopper_config(s)
        f32 = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(F32_WIDENING=True)), 90)
        direct = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(F32_WIDENING=False)), 90)
        out[layout] = {**summarize(f32, 90).to_dict(), "differs": ptx_code(f32) != ptx_code(direct),
                       "scalar_conversions": scalar_conversions(f32),
                       "direct_scalar_conversions": scalar_conversions(direct)}
    return out


def test_fp8_boxes_apply_to_the_split_layouts_fp8_cache_at_full_head_sizes():
    """``FP8_BOXES`` (the policy's for the split layout's FP8 cache, off in the kernel's own defaults) applies to
    the split layout's FP8 cache at head sizes that fill the tile (not 96, whose padded columns the boxes would
    leave unwritten), and the launch's constexprs carry it with a descriptor of the key cache by pages; a key
    cache the boxes cannot describe (not contiguous from its block dimension in) takes the 16-byte copies, with
    no such descriptor."""
    assert not DEFAULTS["FP8_BOXES"]
    split8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert resolve(split8, hopper_config(split8))["FP8_BOXES"]
    assert not resolve(split8, hopper_config(split8), dict(FP8_BOXES=False))["FP8_BOXES"]
    for other in (shape(layout="split"), shape(layout="nhd", kv_cache_dtype="fp8_e4m3"),
                  shape(layout="split", kv_cache_dtype="fp8_e4m3", head_size=96)):
        assert not resolve(other, hopper_config(other), dict(FP8_BOXES=True))["FP8_BOXES"], other
    problem = make_problem(SPEC.replace(layout="split", kv_cache_dtype="fp8_e4m3"))
    call = kernel_call(problem, hopper_config(split8), split8)
    k_cache, v_cache_t = call.tensors[1], call.tensors[5]  # the descriptors' first and last
    assert call.constexprs["SCHEDULE"].FP8_BOXES and k_cache.base.data_ptr() == problem.cache.key.data_ptr()
    assert v_cache_t.base.data_ptr() == problem.cache.value.data_ptr()
    # Every other block of a larger cache: the 16-byte copies take it, the boxes' view does not.
    key = problem.cache.key
    wider = torch.empty((2 * key.shape[0], *key.shape[1:]), dtype=key.dtype)[::2]
    wider.copy_(key)
    strided = dataclasses.replace(problem, cache=dataclasses.replace(problem.cache, key=wider))
    assert unfit_reason(strided, hopper_config(split8)) is None
    call = kernel_call(strided, hopper_config(split8), split8)
    assert not call.constexprs["SCHEDULE"].FP8_BOXES and call.constexprs["LAYOUT"].FP8_CACHE
    assert call.tensors[1] is call.tensors[5]  # a placeholder: the keys are copied from cache.key
    assert call.tensors[6].key.data_ptr() == wider.data_ptr() and call.tensors[6].key.dtype == torch.float8_e4m3fn
    # Asked for the boxes anyway (a direct caller of the launch's tensors): refused, naming the cache.
    from pagedprefill_sm80.hopper.launch import call_tensors_of

    with pytest.raises(ValueError, match="FP8_BOXES: key_cache must be contiguous"):
        call_tensors_of(strided, hopper_config(split8), {"FP8_BOXES": True}, (1, 1, 1))


def test_fp8_boxes_compile_for_sm90_with_tma_boxes_instead_of_copies():
    """The split layout's FP8 tile at head sizes 128 and 64 (e5m2) under ``FP8_BOXES``: no spills, no more
    shared memory, and no 16-byte copies left (the cached keys and values come by TMA boxes)."""
    summaries = child_result("compile_fp8_boxes")
    assert sorted(summaries) == ["128", "64"], summaries
    for head_size, (boxes, copies) in summaries.items():
        assert boxes["spill_bytes"] in (0, None) and boxes["wgmma"] > 0, (head_size, boxes)
        assert boxes["shared_bytes"] <= copies["shared_bytes"], head_size
        assert boxes["async_copies"] == 0 < copies["async_copies"], (head_size, boxes, copies)
        assert boxes["tma_copies"] > copies["tma_copies"], (head_size, boxes, copies)


def compile_fp8_boxes() -> dict:
    """Codegen summaries of split FP8 calls with and without ``FP8_BOXES``, by head size."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    for head_size, cache in ((128, "fp8_e4m3"), (64, "fp8_e5m2")):
        problem = make_problem(SPEC.replace(layout="split", head_size=head_size, kv_cache_dtype=cache,
                                            query_lens=(400, 300), context_lens=(500, 0)))
        s = problem_shape(problem)
        config = hopper_config(s)
        out[str(head_size)] = [
            summarize(compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(FP8_BOXES=b)), 90),
                      90).to_dict() for b in (True, False)]
    return out


def test_widen_to_v_applies_to_the_split_layouts_fp8_cache_and_frees_its_vt_ring():
    """``WIDEN_TO_V`` (off in the kernel's own defaults) applies to the split layout's FP8 cache only; without the
    V^T ring a split FP8 tile takes NHD's shared memory, so 128 keys in 2 stages fit on an H200 (they do not beside
    a V^T ring), and the launch's constexprs carry it."""
    assert not DEFAULTS["WIDEN_TO_V"]
    flag, off = dict(WIDEN_TO_V=True), dict(WIDEN_TO_V=False)
    for head_size in (64, 96, 128):
        split8 = shape(layout="split", kv_cache_dtype="fp8_e4m3", head_size=head_size)
        n64 = hopper_config(split8).with_(block_n=64, num_stages=2)
        assert resolve(split8, n64, flag)["WIDEN_TO_V"]
        assert not resolve(split8, n64, off)["WIDEN_TO_V"]
        n128 = n64.with_(block_n=128)
        nhd8 = shape(layout="nhd", kv_cache_dtype="fp8_e4m3", head_size=head_size)
        assert shared_bytes(split8, n128, flag) == shared_bytes(nhd8, n128)
    assert shared_bytes(split8, n128, flag) <= H200.max_shared_mem < shared_bytes(split8, n128, off)
    assert shape_unfit_reason(split8, n128, H200.max_shared_mem) is None  # the policy's flags for the tile
    for other in (shape(layout="split"), shape(layout="nhd", kv_cache_dtype="fp8_e4m3")):
        assert not resolve(other, hopper_config(other), flag)["WIDEN_TO_V"], other
    problem = make_problem(SPEC.replace(layout="split", kv_cache_dtype="fp8_e4m3"))
    s = problem_shape(problem)
    n128 = hopper_config(s).with_(block_n=128, num_stages=2)
    assert kernel_call(problem, n128, s).constexprs["SCHEDULE"].WIDEN_TO_V  # the policy's flags on 128-key tiles
    assert not kernel_call(problem, n128.with_(block_n=64), s).constexprs["SCHEDULE"].WIDEN_TO_V


def test_the_policy_widens_split_fp8_values_into_the_v_ring():
    """The split layout's FP8 cache at head sizes 64 and 128, long calls, takes 128 keys in 2 stages with its
    cached values widened into the V ring, where it measured faster (374.5 vs 365.1 TFLOP/s on the FP8 row against
    64 keys beside a V^T ring); short calls (0.97 x) and head size 96, whose padded head takes the copies, keep 64
    keys beside the V^T ring, as does any tile of 64 keys (a caller's or a table's: 0.94 x there)."""
    from pagedprefill_sm80.policy import hopper_schedule

    for head_size in (64, 96, 128):
        short = shape(layout="split", kv_cache_dtype="fp8_e4m3", head_size=head_size)
        long = dataclasses.replace(short, num_tokens=4096, num_seqs=2, max_query_len=2048)
        assert (short.workload, long.workload) == ("short", "long")
        for s in (short, long):
            config = hopper_config(s)
            full = head_size != 96
            wide = full and s is long
            assert (config.block_n, config.num_stages) == ((128, 2) if wide else (64, 2)), s
            assert shape_unfit_reason(s, config, H200.max_shared_mem) is None
            flags = resolve(s, config)
            assert (flags["FP8_BOXES"], flags["WIDEN_TO_V"]) == (full, wide), s
            assert not hopper_schedule(s, 64).get("WIDEN_TO_V")
            assert hopper_schedule(s, 64).get("FP8_BOXES", False) == full


def test_widen_to_v_compiles_for_sm90_on_128_key_tiles():
    """The split layout's FP8 cache under ``WIDEN_TO_V`` on 128 keys in 2 stages (the tile it makes room for),
    with the page boxes at head size 128 and the copies at head size 96: warpgroup MMAs, the shared memory the
    model counts (within an H200's), and no spills where the boxes bring the tile (the copies' 128-key tile
    spills 40 bytes in the producer)."""
    summaries = child_result("compile_widen_to_v")
    assert sorted(summaries) == ["128", "96"], summaries
    for head_size, summary in summaries.items():
        assert summary["wgmma"] > 0 and summary["shared_bytes"] <= H200.max_shared_mem, (head_size, summary)
        assert summary["model_bytes"] - 1024 <= summary["shared_bytes"] <= summary["model_bytes"], summary
    assert summaries["128"]["spill_bytes"] in (0, None) and summaries["128"]["async_copies"] == 0, summaries


def compile_widen_to_v() -> dict:
    """Codegen summaries (and the shared-memory model's bytes) of split FP8 calls under ``WIDEN_TO_V`` on 128 keys
    in 2 stages, at head sizes 128 (the page boxes) and 96 (the copies)."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    flag = dict(WIDEN_TO_V=True)
    out = {}
    for head_size in (128, 96):
        problem = make_problem(SPEC.replace(layout="split", head_size=head_size, kv_cache_dtype="fp8_e4m3",
                                            query_lens=(400, 300), context_lens=(500, 0)))
        s = problem_shape(problem)
        config = hopper_config(s).with_(block_n=128, num_stages=2)
        compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, flag), 90)
        out[str(head_size)] = {**summarize(compiled, 90).to_dict(), "model_bytes": shared_bytes(s, config, flag)}
    return out


def test_fused_scale_is_on_for_every_route_and_reaches_the_launch():
    """``FUSED_SCALE`` is on in the kernel's defaults and so on every route, both layouts and cache formats (the
    kernel leaves it aside for calls with softcap or ALiBi); a caller can turn it off, and the launch's constexprs
    carry it."""
    assert DEFAULTS["FUSED_SCALE"]
    for layout in ("nhd", "split"):
        for cache in ("auto", "fp8_e4m3"):
            s = shape(layout=layout, kv_cache_dtype=cache)
            assert resolve(s, hopper_config(s))["FUSED_SCALE"], (layout, cache)
            assert not resolve(s, hopper_config(s), dict(FUSED_SCALE=False))["FUSED_SCALE"], (layout, cache)
    problem = make_problem(SPEC)
    s = problem_shape(problem)
    assert kernel_call(problem, hopper_config(s), s).constexprs["SCHEDULE"].FUSED_SCALE
    assert not kernel_call(problem, hopper_config(s), s, dict(FUSED_SCALE=False)).constexprs["SCHEDULE"].FUSED_SCALE


def test_fused_scale_takes_a_multiply_per_key_off_the_softmax():
    """``FUSED_SCALE`` compiled for sm90 at head size 64 (NHD, the policy's 256-key tile; two consumers, 128 keys
    of each row pair per thread): per key, the scale's multiply and the maximum's subtraction become one fused
    multiply-add, so the multiplies and adds together drop by at least one per key and consumer thread; the same
    exponentials, no spills, no more registers. With softcap and ALiBi, which need the scaled scores, the code is
    the same as without the flag."""
    summaries = child_result("compile_fused_scale")
    if summaries is None:
        pytest.skip("this Triton has no bundled nvdisasm to read the sm90 instructions with")
    plain, fused = summaries["plain"], summaries["fused"]
    assert fused["spill_bytes"] in (0, None) and fused["registers"] <= plain["registers"], (plain, fused)
    assert fused["exponentials"] == plain["exponentials"], (plain, fused)
    per_key = plain["multiplies"] + plain["adds"] - fused["multiplies"] - fused["adds"]
    assert per_key >= 2 * 128 and fused["fused"] >= plain["fused"] + 2 * 128, (plain, fused)
    assert summaries["fused-softcap-alibi"] == summaries["plain-softcap-alibi"]


def compile_fused_scale() -> Optional[dict]:
    """Registers, spills and ``MUFU.EX2``, ``FMUL``, ``FADD`` and ``FFMA`` counts of the head-size-64 NHD call's
    sm90 code without and with ``FUSED_SCALE``, and of the same call with softcap and ALiBi without and with it
    (None without a bundled ``nvdisasm``)."""
    import re

    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    for label, features in (("", {}), ("-softcap-alibi", dict(softcap=10.0, alibi=True))):
        problem = make_problem(SPEC.replace(head_size=64, query_lens=(400, 300), context_lens=(500, 0), **features))
        s = problem_shape(problem)
        for name, fused in (("plain", False), ("fused", True)):
            compiled = compile_call(hopper_prefill_kernel,
                                    kernel_call(problem, hopper_config(s), s, dict(FUSED_SCALE=fused)), 90)
            code = sass(compiled)
            if code is None:
                return None
            summary = summarize(compiled, 90).to_dict()
            patterns = dict(exponentials=r"MUFU\.EX2", multiplies=r"\bFMUL\b", adds=r"\bFADD\b", fused=r"\bFFMA\b")
            out[name + label] = dict(registers=summary["registers"], spill_bytes=summary["spill_bytes"],
                                     **{key: len(re.findall(pattern, code)) for key, pattern in patterns.items()})
    return out


def test_256_key_tiles_at_head_size_64_compile_for_sm90_without_spills():
    """Candidates for head size 64 (``hopper_check.py``'s ``pingpong-n256-*`` variants): 256 keys per step in 3
    stages on NHD, and in 2 stages on the split layout with a producer warpgroup (one producer warp spills the
    copy addresses of 256 keys), within the shared-memory model."""
    summaries = child_result("compile_256_key_tiles")
    assert set(summaries) == {"nhd", "split"}
    for layout, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, (layout, summary)
        assert summary["shared_bytes"] <= summary["modelled_shared"] <= H200.max_shared_mem, (layout, summary)


def compile_256_key_tiles() -> dict:
    """Codegen summaries of head size 64 with 256 keys per step, per layout, with the modelled shared memory."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    # The split layout's keys by 16-byte copies, as hopper_check.py's variants run them (the policy's 64-key
    # chunks of loads, which it gives 128-key tiles, spill 100 bytes at 256 keys).
    for layout, stages, schedule in (("nhd", 3, {}), ("split", 2, dict(WIDE_PRODUCER=True, KEY_LOADS=False))):
        problem = make_problem(SPEC.replace(layout=layout, head_size=64))
        s = problem_shape(problem)
        config = hopper_config(s).with_(block_n=256, num_stages=stages)
        call = kernel_call(problem, config, s, schedule)
        out[layout] = {**summarize(compile_call(hopper_prefill_kernel, call, 90), 90).to_dict(),
                       "modelled_shared": shared_bytes(s, config, schedule)}
    return out


def test_schedule_flags_from_the_environment_sit_between_the_policys_and_the_callers(monkeypatch):
    """``PAGEDPREFILL_SM80_SCHEDULE`` overrides the kernel's defaults and the policy's flags for the route, and a
    caller's flags override it."""
    split = shape(layout="split")
    config = hopper_config(split)
    assert route_flags(split, config.block_n)["KEY_LOADS"] and DEFAULTS["HEAVY_FIRST"]
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=0, HEAVY_FIRST=0")
    assert from_environment() == dict(KEY_LOADS=False, HEAVY_FIRST=False)
    flags = resolve(split, config)
    assert not flags["KEY_LOADS"] and not flags["HEAVY_FIRST"]
    assert resolve(split, config, dict(KEY_LOADS=True))["KEY_LOADS"]
    monkeypatch.delenv(SCHEDULE_ENV)
    assert from_environment() == {}
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=yes")
    with pytest.raises(ValueError, match=f"{SCHEDULE_ENV}: schedule: expected NAME=0 or NAME=1 .*got 'KEY_LOADS=yes'"):
        resolve(split, config)


def test_auto_takes_the_split_layouts_head_sizes_96_and_256(monkeypatch):
    """They passed the suites on the H200 and measured faster than the portable kernel."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    for head_size in (96, 256):
        assert choose_kernel(shape(head_size=head_size, layout="split"), H200) == \
            ("hopper", "the Hopper kernel takes this shape and is the faster one"), head_size


def test_auto_picks_it_only_where_it_measured_faster(monkeypatch):
    """With the Hopper kernel the default, ``auto`` takes it for the measured (head size, cache dtype) pairs
    only and says why not elsewhere."""
    import pagedprefill_sm80.policy as policy

    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(policy, "HOPPER_BY_DEFAULT", True)
    monkeypatch.setattr(policy, "HOPPER_WINS", frozenset({(128, "auto")}))
    assert choose_kernel(shape(), H200) == ("hopper", "the Hopper kernel takes this shape and is the faster one")
    for changes in ({"head_size": 64}, {"kv_cache_dtype": "fp8_e4m3"}):
        kernel, why = choose_kernel(shape(**changes), H200)
        assert kernel == "portable" and why.startswith("the Hopper kernel has not measured faster"), (changes, why)


def test_fp8_scores_apply_to_an_fp8_query_on_an_e4m3_cache_holding_every_key():
    """``FP8_SCORES`` (on in the kernel's defaults) applies where both operands of ``Q K^T`` can be e4m3 as they
    are: an FP8 query, an e4m3 cache, every key in it (k = v = None) and a head size that fills the tile; its
    shared-memory model counts the query and the K ring in one byte (and, NHD, no FP8 ring for the keys), and the
    launch's constexprs carry it."""
    assert DEFAULTS["FP8_SCORES"]
    engine = dict(fp8_query=True, kv_cache_dtype="fp8_e4m3", kv_in_cache=True)
    for layout in ("nhd", "split"):
        for head_size in (64, 128):
            s = shape(layout=layout, head_size=head_size, **engine)
            config = hopper_config(s)
            assert resolve(s, config)["FP8_SCORES"], s
            assert not resolve(s, config, dict(FP8_SCORES=False))["FP8_SCORES"]
            d, n, stages = head_size, config.block_n, config.num_stages
            saved = 128 * d + stages * n * d * (2 if layout == "nhd" else 1)  # Q and K in one byte; NHD: no FP8 keys
            assert shared_bytes(s, config, dict(FP8_SCORES=False)) - shared_bytes(s, config) == saved, s
    for changes in (dict(engine, fp8_query=False), dict(engine, kv_in_cache=False), dict(engine, head_size=96),
                    dict(engine, kv_cache_dtype="fp8_e5m2"), dict(engine, kv_cache_dtype="auto")):
        s = shape(**changes)
        assert not resolve(s, hopper_config(s))["FP8_SCORES"], changes
    problem = make_problem(SPEC.replace(**engine))
    s = problem_shape(problem)
    assert kernel_call(problem, hopper_config(s), s).constexprs["SCHEDULE"].FP8_SCORES
    assert not kernel_call(problem, hopper_config(s), s, dict(FP8_SCORES=False)).constexprs["SCHEDULE"].FP8_SCORES


def test_an_fp8_query_folds_its_descale_into_the_logits_scale():
    """An FP8 q's descale given as a number is part of the launch's logit scale (with ``log2(e)``); given as a
    tensor it is read on the device (``SCALE_FROM_TENSOR.Q``) and the number stays the softmax scale's; a 16-bit
    q's call is unchanged."""
    import math

    plain = make_problem(SPEC)
    s = problem_shape(plain)
    base = kernel_call(plain, hopper_config(s), s).scalars[0]
    assert base == pytest.approx(plain.sm_scale * math.log2(math.e))
    quantised = make_problem(SPEC.replace(fp8_query=True))
    q_scale = quantised.options.q_scale
    assert isinstance(q_scale, float) and q_scale != 1.0
    call = kernel_call(quantised, hopper_config(problem_shape(quantised)), problem_shape(quantised))
    assert call.scalars[0] == pytest.approx(base * q_scale) and not call.constexprs["SCALE_FROM_TENSOR"].Q
    as_tensor = make_problem(SPEC.replace(fp8_query=True, scale_as_tensor=True))
    call = kernel_call(as_tensor, hopper_config(problem_shape(as_tensor)), problem_shape(as_tensor))
    assert call.scalars[0] == pytest.approx(base) and call.constexprs["SCALE_FROM_TENSOR"].Q


def test_fp8_queries_compile_for_sm90_with_fp8_scores_where_they_apply():
    """An FP8 query on the Hopper kernel, compiled for sm90: widened as it is loaded beside a 16-bit cache (only
    16-bit warpgroup MMAs), and under ``FP8_SCORES`` on an e4m3 cache holding every key (NHD and split): ``Q K^T``
    on e4m3 MMAs (k32 instructions) and ``P V`` on 16-bit ones, no spills, the shared memory its model counts."""
    summaries = child_result("compile_fp8_queries")
    assert sorted(summaries) == ["nhd-16-bit-cache", "nhd-fp8-scores", "split-fp8-scores"], summaries
    widened = summaries["nhd-16-bit-cache"]
    assert widened["fp8_mmas"] == 0 < widened["wgmma"] and widened["spill_bytes"] in (0, None), widened
    for name in ("nhd-fp8-scores", "split-fp8-scores"):
        summary = summaries[name]
        assert summary["fp8_mmas"] > 0 and summary["bf16_mmas"] > 0, (name, summary)
        assert summary["spill_bytes"] in (0, None), (name, summary)
        assert summary["model_bytes"] - 1024 <= summary["shared_bytes"] <= summary["model_bytes"], (name, summary)


def compile_fp8_queries() -> dict:
    """Codegen summaries of FP8-query calls (with the counts of e4m3 and bf16 warpgroup MMA instructions in the
    PTX and the shared-memory model's bytes)."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    engine = dict(fp8_query=True, kv_cache_dtype="fp8_e4m3", kv_in_cache=True)
    out = {}
    for name, changes in (("nhd-16-bit-cache", dict(fp8_query=True)), ("nhd-fp8-scores", engine),
                          ("split-fp8-scores", dict(engine, layout="split"))):
        problem = make_problem(SPEC.replace(query_lens=(400, 300), context_lens=(500, 0), **changes))
        s = problem_shape(problem)
        config = hopper_config(s)
        compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s), 90)
        ptx = compiled.asm["ptx"]
        out[name] = {**summarize(compiled, 90).to_dict(), "model_bytes": shared_bytes(s, config),
                     "fp8_mmas": ptx.count(".e4m3.e4m3"), "bf16_mmas": ptx.count(".bf16.bf16")}
    return out


def test_idle_half_is_on_where_its_branch_does_not_spill_and_reaches_the_launch():
    """``IDLE_HALF`` (the second consumer idle on tiles whose second half holds no query row) is on for both
    layouts and cache formats at head sizes 96 (with ``HEAD_PANELS``), 128 and 256 and on 128-key tiles at head
    size 64, off on head size 64's 256-key tiles and at head size 96 without ``HEAD_PANELS`` (where its branch
    spills), off without ``PINGPONG`` (one consumer holds every row); a caller can turn it off, and the launch's
    constexprs carry it."""
    assert DEFAULTS["IDLE_HALF"]
    for layout in ("nhd", "split"):
        for cache in ("auto", "fp8_e4m3"):
            for head_size in (64, 96, 128, 256):
                if cache != "auto" and head_size > 128:
                    continue  # no FP8 cache there
                s = shape(layout=layout, kv_cache_dtype=cache, head_size=head_size)
                config = hopper_config(s)
                expected = config.block_n <= 128
                assert resolve(s, config)["IDLE_HALF"] == expected, (layout, cache, head_size, config)
                if head_size == 96:
                    assert not resolve(s, config, dict(HEAD_PANELS=False))["IDLE_HALF"], (layout, cache)
                assert not resolve(s, config, dict(IDLE_HALF=False))["IDLE_HALF"]
                assert not resolve(s, config, dict(PINGPONG=False))["IDLE_HALF"]
    d64 = dataclasses.replace(shape(head_size=64), num_tokens=4096, num_seqs=2, max_query_len=2048)  # a long call
    assert hopper_config(d64).block_n == 256 and not resolve(d64, hopper_config(d64))["IDLE_HALF"]
    problem = make_problem(SPEC)
    s = problem_shape(problem)
    assert kernel_call(problem, hopper_config(s), s).constexprs["SCHEDULE"].IDLE_HALF
    assert not kernel_call(problem, hopper_config(s), s, dict(IDLE_HALF=False)).constexprs["SCHEDULE"].IDLE_HALF


def test_lazy_rescale_compiles_for_sm90_without_spills():
    """``LAZY_RESCALE`` (on by default for the engine's call on a 16-bit NHD cache where ``SOFTMAX_UNDER_PV`` does
    not apply: head size 96, pages of 8) on that call's tile: no spills, no instruction on an in-flight MMA's
    registers, and code of its own (the vote and its branch); where it did not win (the split layout, an FP8
    cache, the new tokens' K/V passed apart, split keys) it resolves off whatever is asked."""
    from pagedprefill_sm80.hopper.schedule import DEFAULTS

    assert DEFAULTS["LAZY_RESCALE"]
    engine = problem_shape(make_problem(SPEC.replace(kv_in_cache=True)))
    assert resolve(engine, hopper_config(engine), dict(SOFTMAX_UNDER_PV=False))["LAZY_RESCALE"]
    for lazy in (SPEC.replace(kv_in_cache=True, head_size=96), SPEC.replace(kv_in_cache=True, block_size=8)):
        s = problem_shape(make_problem(lazy))
        flags = resolve(s, hopper_config(s))
        assert flags["LAZY_RESCALE"] and not flags["SOFTMAX_UNDER_PV"], lazy
    for off in (SPEC.replace(layout="split", kv_in_cache=True), SPEC.replace(kv_cache_dtype="fp8_e4m3",
                                                                              kv_in_cache=True), SPEC):
        shape = problem_shape(make_problem(off))
        assert not resolve(shape, hopper_config(shape), dict(LAZY_RESCALE=True))["LAZY_RESCALE"], off
    split_keys = hopper_config(engine).with_(key_splits=2)
    assert not resolve(engine, split_keys, dict(LAZY_RESCALE=True))["LAZY_RESCALE"]
    summaries = child_result("compile_lazy_rescale")
    for name, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma_hazards"] in (0, None), (name, summary)
    plain, lazy = summaries["nhd/plain"], summaries["nhd/lazy"]
    if plain["barriers"] is not None:
        assert lazy["barriers"] > plain["barriers"], (plain, lazy)


def compile_lazy_rescale() -> dict:
    """Codegen summaries of the long prefill's NHD tile with and without ``LAZY_RESCALE``, with SASS barriers."""
    import re

    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    problem = make_problem(SPEC.replace(layout="nhd", kv_in_cache=True))
    s = problem_shape(problem)
    for name, lazy in (("plain", False), ("lazy", True)):
        compiled = compile_call(hopper_prefill_kernel,
                                kernel_call(problem, hopper_config(s), s,
                                            dict(LAZY_RESCALE=lazy, SOFTMAX_UNDER_PV=False)), 90)
        code = sass(compiled)
        out[f"nhd/{name}"] = {**summarize(compiled, 90).to_dict(),
                              "barriers": None if code is None else len(re.findall(r"\bBAR\.", code))}
    return out


def test_head_panels_cover_a_padded_heads_columns_without_spills():
    """``HEAD_PANELS`` (on by default) applies to head size 96 alone, and lets ``IDLE_HALF`` on there. Compiled for
    sm90 (both layouts, the engine's call with split keys too) its ``P V`` has MMAs of 32 columns beside those of
    64, which the tile-wide accumulator's code has none of, and it neither spills nor touches an in-flight MMA's
    registers."""
    assert DEFAULTS["HEAD_PANELS"]
    for head_size in (64, 128, 256):
        s = shape(head_size=head_size)
        assert not resolve(s, hopper_config(s), dict(HEAD_PANELS=True))["HEAD_PANELS"], head_size
    for layout in ("nhd", "split"):
        d96 = shape(head_size=96, layout=layout)
        panels = resolve(d96, hopper_config(d96))
        assert panels["HEAD_PANELS"] and panels["IDLE_HALF"], layout
        assert not resolve(d96, hopper_config(d96), dict(HEAD_PANELS=False))["IDLE_HALF"], layout
    summaries = child_result("compile_head_panels")
    for name, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma_hazards"] in (0, None), (name, summary)
        if summary["narrow_mmas"] is not None:
            assert (summary["narrow_mmas"] > 0) == name.endswith("/panels"), (name, summary)


def compile_head_panels() -> dict:
    """Codegen summaries of head size 96's tiles with and without ``HEAD_PANELS``, with the SASS's MMAs of 32
    columns (``HGMMA.64x32``)."""
    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    calls = {"nhd": (SPEC.replace(head_size=96, kv_in_cache=True), {}),
             "split": (SPEC.replace(head_size=96, layout="split"), {}),
             "nhd-split-keys": (SPEC.replace(head_size=96, kv_in_cache=True, query_lens=(1,) * 4,
                                             context_lens=(4000,) * 4), dict(key_splits=2))}
    for name, (spec, tile_changes) in calls.items():
        problem = make_problem(spec)
        s = problem_shape(problem)
        config = hopper_config(s).with_(**tile_changes)
        for label, on in (("plain", False), ("panels", True)):
            compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(HEAD_PANELS=on)), 90)
            code = sass(compiled)
            out[f"{name}/{label}"] = {**summarize(compiled, 90).to_dict(),
                                      "narrow_mmas": None if code is None else code.count("HGMMA.64x32x16")}
    return out


def test_wide_boxes_load_a_padded_heads_pages_through_the_2d_view_without_spills():
    """``WIDE_BOXES`` (built, not yet timed on a GPU: off) applies to head size 96's NHD calls under
    ``HEAD_PANELS`` alone. Its descriptors are the 2-D views ``[rows, heads x 96]`` with boxes of the tile's 128
    columns (cached pages and new tokens), and compiled for sm90 (an FP8 cache with the new tokens apart, and the
    engine's call with split keys) its copies are 2-D TMA boxes only, without spills or instructions on an
    in-flight MMA's registers."""
    assert not DEFAULTS["WIDE_BOXES"]
    d96 = shape(head_size=96)
    assert resolve(d96, hopper_config(d96), dict(WIDE_BOXES=True))["WIDE_BOXES"]
    assert not resolve(d96, hopper_config(d96), dict(WIDE_BOXES=True, HEAD_PANELS=False))["WIDE_BOXES"]
    for other in (shape(head_size=96, layout="split"), shape(head_size=128)):
        assert not resolve(other, hopper_config(other), dict(WIDE_BOXES=True))["WIDE_BOXES"], other
    problem = make_problem(SPEC.replace(head_size=96))
    s = problem_shape(problem)
    config = hopper_config(s)
    for on in (False, True):
        call = kernel_call(problem, config, s, dict(WIDE_BOXES=on))
        assert call.constexprs["SCHEDULE"].WIDE_BOXES == on
        for desc in call.tensors[1:5]:  # the cache's K and V, the new tokens' K and V
            if on:
                assert list(desc.block_shape[1:]) == [128] and desc.shape[1] == SPEC.num_kv_heads * 96, desc.shape
            else:
                assert list(desc.block_shape[1:]) == [1, 128] and list(desc.shape[1:]) == [SPEC.num_kv_heads, 96]
    for name, summary in child_result("compile_wide_boxes").items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma_hazards"] in (0, None), (name, summary)
        if summary["boxes_2d"] is not None:
            assert summary["boxes_2d"] > 0 and summary["boxes_3d"] == 0, (name, summary)


def compile_wide_boxes() -> dict:
    """Codegen summaries of head size 96's NHD tiles under ``WIDE_BOXES``, with the PTX's 2-D and 3-D TMA copies."""
    import re

    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    calls = {"fp8-new-tokens": (SPEC.replace(head_size=96, kv_cache_dtype="fp8_e4m3"), {}),
             "engine-split-keys": (SPEC.replace(head_size=96, kv_in_cache=True, query_lens=(1,) * 4,
                                                context_lens=(4000,) * 4), dict(key_splits=2))}
    for name, (spec, tile_changes) in calls.items():
        problem = make_problem(spec)
        s = problem_shape(problem)
        config = hopper_config(s).with_(**tile_changes)
        compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(WIDE_BOXES=True)), 90)
        ptx = compiled.asm.get("ptx")
        out[name] = {**summarize(compiled, 90).to_dict(),
                     "boxes_2d": None if ptx is None else len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)),
                     "boxes_3d": None if ptx is None else len(re.findall(r"cp\.async\.bulk\.tensor\.3d", ptx))}
    return out


def test_softmax_under_pv_keeps_p_v_in_flight_over_the_softmax_without_spills():
    """``SOFTMAX_UNDER_PV`` (on by default) applies to the NHD layout's 16-bit
    tiles of up to 128 keys at head sizes 128 and 256 with pages of at least 16 tokens, and turns
    ``LAZY_RESCALE`` off there.
    Compiled for sm90 (the engine's call, and the classic one with its new tokens' tiles) each consumer waits for
    the scores with ``P V`` still in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), without spills or instructions
    on an in-flight MMA's registers."""
    assert DEFAULTS["SOFTMAX_UNDER_PV"]
    engine = problem_shape(make_problem(SPEC.replace(kv_in_cache=True)))
    flags = resolve(engine, hopper_config(engine), dict(SOFTMAX_UNDER_PV=True))
    assert flags["SOFTMAX_UNDER_PV"] and not flags["LAZY_RESCALE"]
    assert resolve(engine, hopper_config(engine), dict(SOFTMAX_UNDER_PV=False))["LAZY_RESCALE"]
    for on in (shape(), shape(head_size=256)):
        assert resolve(on, hopper_config(on), dict(SOFTMAX_UNDER_PV=True))["SOFTMAX_UNDER_PV"], on
    d64 = dataclasses.replace(shape(head_size=64), num_tokens=4096, num_seqs=2, max_query_len=2048)  # 256 keys
    for other in (shape(layout="split"), shape(kv_cache_dtype="fp8_e4m3"), shape(head_size=96), shape(block_size=8),
                  shape(head_size=64), d64):
        assert not resolve(other, hopper_config(other), dict(SOFTMAX_UNDER_PV=True))["SOFTMAX_UNDER_PV"], other
    for name, summary in child_result("compile_softmax_under_pv").items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma_hazards"] in (0, None), (name, summary)
        if summary["waits_with_p_v_in_flight"] is not None:
            assert summary["waits_with_p_v_in_flight"] > 0, (name, summary)


def compile_softmax_under_pv() -> dict:
    """Codegen summaries of the engine's call and the classic one at head size 128 under ``SOFTMAX_UNDER_PV``,
    with the SASS's MMA waits that leave ``P V``'s group in flight."""
    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    out = {}
    for name, spec in (("engine", SPEC.replace(kv_in_cache=True)), ("classic", SPEC)):
        problem = make_problem(spec)
        s = problem_shape(problem)
        call = kernel_call(problem, hopper_config(s), s, dict(SOFTMAX_UNDER_PV=True))
        compiled = compile_call(hopper_prefill_kernel, call, 90)
        code = sass(compiled)
        out[name] = {**summarize(compiled, 90).to_dict(), "waits_with_p_v_in_flight":
                     None if code is None else code.count("WARPGROUP.DEPBAR.LE gsb0, 0x1")}
    return out


def test_split_keys_merge_in_the_kernel_itself():
    """With split keys the Hopper kernel is the call's only launch: its plan binds no combine, a launch gets
    zeroed arrival counters (one per tile, head chunk and consumer of the grid; kept per stream on a GPU, fresh
    here), and the sm90 code counts arrivals with an atomic, without spills or instructions on an in-flight
    MMA's registers."""
    from pagedprefill_sm80.hopper.launch import split_arrivals

    problem = make_problem(SPEC.replace(query_lens=(1, 1, 1, 1), context_lens=(4000, 3000, 2000, 4000)))
    s = problem_shape(problem)
    config = hopper_config(s).with_(key_splits=4)
    call = kernel_call(problem, config, s)
    arrivals = call.tensors[-1]
    assert arrivals.dtype == torch.int32 and arrivals.shape == (call.grid[0] * call.grid[1] * 2,)
    assert not arrivals.any()
    assert split_arrivals(problem, config, call.grid).data_ptr() != arrivals.data_ptr()
    assert split_arrivals(problem, config.with_(key_splits=1), call.grid) is problem.q  # unread placeholder
    summary = child_result("compile_split_merge")
    assert summary["spill_bytes"] in (0, None) and summary["wgmma_hazards"] in (0, None), summary
    assert summary["atomics"] is None or summary["atomics"] >= 1, summary


def compile_split_merge() -> dict:
    """Codegen summary of a decode batch's plan with its keys split 4 ways, with the SASS's atomics."""
    import re

    from pagedprefill.triton.codegen import compile_call, sass, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    problem = make_problem(SPEC.replace(query_lens=(1, 1, 1, 1), context_lens=(4000, 3000, 2000, 4000)))
    s = problem_shape(problem)
    compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, hopper_config(s).with_(key_splits=4), s), 90)
    code = sass(compiled)
    return {**summarize(compiled, 90).to_dict(), "atomics": None if code is None else len(re.findall(r"\bATOMG?\.",
                                                                                                      code))}


def test_the_steps_of_a_model_share_one_compiled_kernel_per_tile():
    """The Hopper kernel is not specialised on a call's extents (sequences, token rows, cache blocks, table
    columns), which change with every step of a serving engine: steps of one sequence or many, of 1, 16 or 37
    tokens, bind it the same way (Triton's binder, no GPU), so they share one compiled kernel per tile."""
    from pagedprefill.triton.arguments import VARYING_EXTENTS
    from pagedprefill.triton.codegen import argument_specialization
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    steps = [((1,), (5,)), ((1,) * 16, tuple(range(3, 19))), ((35, 1, 1), (0, 40, 9)), ((16,), (240,))]
    answers = []
    for query_lens, context_lens in steps:
        problem = make_problem(SPEC.replace(query_lens=query_lens, context_lens=context_lens, kv_in_cache=True))
        s = problem_shape(problem)
        answers.append(argument_specialization(hopper_prefill_kernel, kernel_call(problem, hopper_config(s), s)))
    for name in VARYING_EXTENTS:
        assert len({answer[name] for answer in answers}) == 1, (name, [answer[name] for answer in answers])
