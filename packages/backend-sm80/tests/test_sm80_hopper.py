"""The Hopper kernel without a GPU: which calls the policy routes to it and why, what it refuses, and what it
compiles to for sm90 (warp specialisation, TMA, warpgroup MMA, register split, no spills).

Its results are checked on an sm90 GPU by ``test_sm80_hopper_conformance.py``: Gluon kernels do not run in
Triton's CPU interpreter.
"""

import dataclasses
from typing import Optional

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.tiling import ProblemShape
from pagedprefill.workloads import BatchSpec, make_problem
from pagedprefill_sm80 import Sm80Backend
from pagedprefill_sm80.hopper.launch import SCHEDULE_ENV, kernel_call, unfit_reason
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


#: Calls compiled for sm90 by :func:`test_compiles_for_sm90_warp_specialised_with_tma_and_wgmma`.
COMPILED = {
    "d128": {}, "d64": {"head_size": 64}, "d256": {"head_size": 256},
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
    "heavy-first": dict(HEAVY_FIRST=True, PINGPONG=False, TURNS=False),
    "in-order": dict(HEAVY_FIRST=False, PINGPONG=False, TURNS=False),
    "pingpong": dict(HEAVY_FIRST=True, PINGPONG=True, TURNS=False),
    "pingpong-turns": dict(HEAVY_FIRST=True, PINGPONG=True, TURNS=True),
    "pingpong-overlap-turns": dict(HEAVY_FIRST=True, PINGPONG=True, TURNS=True, OVERLAP=True),
    "pingpong-vt-copies": dict(HEAVY_FIRST=True, PINGPONG=True, VT_COPIES=True),
    "pingpong-wide-producer": dict(HEAVY_FIRST=True, PINGPONG=True, WIDE_PRODUCER=True),
    "pingpong-producer-widens": dict(HEAVY_FIRST=True, PINGPONG=True, PRODUCER_WIDENS=True),
    "pingpong-consumers-widen": dict(HEAVY_FIRST=True, PINGPONG=True, PRODUCER_WIDENS=False),
    "pingpong-key-loads": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True),
    "pingpong-key-loads-values-first": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True),
    "pingpong-key-loads-early-keys": dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True,
                                          EARLY_KEYS=True),
}


#: The flags the policy sets per route (:func:`pagedprefill_sm80.policy.hopper_schedule`), off unless a schedule
#: of :data:`SCHEDULES` names them.
POLICY_FLAGS_OFF = dict(KEY_LOADS=False, VALUES_FIRST=False, WIDE_KEY_CHUNKS=False, EARLY_KEYS=False,
                        FP8_BOXES=False, WIDEN_TO_V=False)


def compile_summaries() -> dict:
    """Codegen summary of each :data:`COMPILED` call under each of :data:`SCHEDULES`, with the launch's warps."""
    from dataclasses import replace

    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel
    from pagedprefill_sm80.hopper.launch import shared_bytes

    out = {}
    for name, changes in COMPILED.items():
        problem = make_problem(SPEC.replace(**changes))
        s = problem_shape(problem)
        for label, schedule in SCHEDULES.items():
            # Each label names the whole schedule: the policy's own flags for a route do not reach it.
            schedule = {**POLICY_FLAGS_OFF, **schedule}
            config = hopper_config(s)
            if shared_bytes(s, config, schedule) > H200.max_shared_mem:
                # A schedule that cannot hold the policy's tile (an FP8 cache with each consumer widening its
                # own copy: 360 KiB for 128 keys; the split layout's FP8 cache beside a V^T ring: 289 KiB) is
                # compiled with the 64 keys it held before.
                config = replace(config, block_n=64)
            if s.layout == "split" and s.workload == "short" and config.block_n > 64:
                # The split layout's short calls at head size 128 take 128-key tiles since run 12, where the
                # schedules that are off spill (OVERLAP 32 bytes, 320 with TURNS; VT_COPIES 4): the schedules are
                # compared here on the 64-key tiles those calls took before. The policy's 128-key tile of these
                # calls is compiled by test_wide_key_chunks_compile_for_sm90_without_spills.
                config = replace(config, block_n=64, num_stages=3)
            call = kernel_call(problem, config, s, schedule=schedule)
            summary = summarize(compile_call(hopper_prefill_kernel, call, 90), 90).to_dict()
            out[f"{name}/{label}"] = {**summary, "launch_warps": call.options["num_warps"],
                                      "tile_warps": call.constexprs["NUM_WARPS"], "block_n": config.block_n,
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
        # TMA boxes for every call but a split one whose values are copied and whose new K/V are in the cache.
        assert summary["tma_copies"] > 0 or (name.startswith("split-vllm") and name.endswith("vt-copies")), name
        # Split-layout keys have no TMA view: 16-byte asynchronous copies by the producer warp (under key-loads,
        # loads and stores; an FP8 cache's values are copies still).
        copied = name.startswith("split") and ("fp8" in name or "/pingpong-key-loads" not in name)
        assert (summary["async_copies"] > 0) == copied, name
        assert summary["spill_bytes"] in (0, None), name
        assert summary["shared_bytes"] <= H200.max_shared_mem, name
        # The policy's shared-memory model (for the default, ping-pong schedule) bounds what Triton allocated,
        # and is exact but for its 1 KiB allowance for the barriers under that schedule.
        if summary["shared_bytes"] is not None:
            assert summary["shared_bytes"] <= summary["modelled_shared"], name
            if name.endswith(("/pingpong", "/pingpong-producer-widens")):
                assert summary["modelled_shared"] - summary["shared_bytes"] <= 1024, name
        # No instruction touches registers an asynchronous warpgroup MMA still owns (P of an in-flight P V).
        assert summary["wgmma_hazards"] in (0, None), name
    for call in COMPILED:
        plain, pingpong = summaries[f"{call}/heavy-first"], summaries[f"{call}/pingpong"]
        copies = summaries[f"{call}/pingpong-vt-copies"]
        wide = summaries[f"{call}/pingpong-wide-producer"]
        fp8 = "kv_cache_dtype" in COMPILED[call]
        if call.startswith("split") and fp8:
            # An FP8 cache's values come by 16-byte copies already, widened by a producer warpgroup, into a
            # V^T ring of their own: those two schedules change nothing.
            assert copies == pingpong == wide, call
        elif call.startswith("split"):  # the cached values by 16-byte copies too, and no value box left
            assert copies["tma_copies"] < pingpong["tma_copies"], call
            if COMPILED[call].get("head_size", 128) <= 128:
                assert copies["async_copies"] == 2 * pingpong["async_copies"], call
                # Four producer warps: each thread issues a quarter of the key copies.
                assert 4 * wide["async_copies"] == pingpong["async_copies"], call
            else:  # head size 256: the producer is a warpgroup already (a [256, 32] V^T tile copies by rows)
                assert copies["async_copies"] > pingpong["async_copies"], call
                assert wide == pingpong, call
        else:  # nothing to copy differently in the NHD layout
            assert copies == pingpong == wide, call
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
        widened = summaries[f"{call}/pingpong-producer-widens"]
        own_copies = summaries[f"{call}/pingpong-consumers-widen"]
        assert widened == pingpong, call  # the default schedule
        if call.startswith("split") and fp8:  # widened by the producer under every schedule
            assert own_copies == pingpong, call
        elif fp8:
            # Widened once by the producer warpgroup: no consumer copies, a third less shared memory for a tile,
            # or room for twice the keys per step.
            if widened["block_n"] == own_copies["block_n"]:
                assert widened["shared_bytes"] < own_copies["shared_bytes"], call
                assert widened["wgmma"] <= own_copies["wgmma"], call
            else:
                assert own_copies["block_n"] < widened["block_n"], call
        else:  # nothing to widen
            assert own_copies == pingpong, call
        if plain["tile_warps"] == 8:
            # Two consumer partitions of one warpgroup each, each with its own MMAs; the launch is the first's.
            assert pingpong["launch_warps"] == 4 and pingpong["wgmma"] == 2 * plain["wgmma"], call
            assert summaries[f"{call}/pingpong-turns"]["wgmma"] == pingpong["wgmma"], call
            overlapped = summaries[f"{call}/pingpong-overlap-turns"]
            if fp8:  # FP8 tiles are widened before their MMAs: no OVERLAP
                assert overlapped == summaries[f"{call}/pingpong-turns"], call
            else:  # the spare Q K^T of the overlapped loop's prologue: one more MMA per consumer
                assert overlapped["wgmma"] > pingpong["wgmma"], call
        else:  # one warpgroup holds the whole tile: nothing to split, no one to take turns with
            assert pingpong == plain == summaries[f"{call}/pingpong-turns"], call
            assert summaries[f"{call}/pingpong-overlap-turns"]["wgmma"] > plain["wgmma"], call


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
        assert len(rows) == 20, proc.stdout  # ten bench workloads, two layouts
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


def check_rebuilt_arguments():
    import dataclasses

    from pagedprefill_sm80.hopper.launch import DESCRIPTORS, _Arguments, call_tensors, resolve_schedule

    # An FP8 cache is described through views of its bytes as FP8: rebuilt with that type, not the bytes'
    # (under FP8_BOXES the split layout's key cache too).
    for changes, flags in (({"layout": "nhd"}, {}), ({"layout": "split"}, {}),
                           ({"layout": "nhd", "kv_cache_dtype": "fp8_e4m3", "scale_as_tensor": True}, {}),
                           ({"layout": "split", "kv_cache_dtype": "fp8_e4m3"}, {"FP8_BOXES": True}),
                           ({"layout": "nhd", "head_size": 96}, {})):
        first = make_problem(SPEC.replace(**changes))
        config = hopper_config(problem_shape(first))
        schedule = resolve_schedule(problem_shape(first), config, flags)
        arguments = _Arguments(first, call_tensors(first, config, schedule))
        later = make_problem(SPEC.replace(**changes, seed=7))
        got, want = arguments(later), call_tensors(later, config, schedule)
        assert len(got) == len(want)
        for g, w in zip(got[DESCRIPTORS], want[DESCRIPTORS]):
            assert (g.base.data_ptr(), g.base.dtype, g.shape, g.strides, g.block_shape, g.layout) == \
                (w.base.data_ptr(), w.base.dtype, w.shape, w.strides, w.block_shape, w.layout)
        # The plain tensors as a fresh launch passes them (an FP8 split cache: a fresh view of the same bytes).
        assert all((g.data_ptr(), g.dtype, g.shape, g.stride()) == (w.data_ptr(), w.dtype, w.shape, w.stride())
                   for i, (g, w) in enumerate(zip(got, want)) if i not in range(2, 7))
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
    """Whether two launches' flat argument lists agree (tensors by address, shape, strides and dtype)."""
    def key(a):
        return (a.data_ptr(), a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
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
        arguments = _Arguments(first, call.tensors, encoded)
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
        # Where the launcher is built otherwise, the plan keeps Triton's path.
        assert EncodedLauncher.of(compiled, range(1, 6)) is None
        for changed in ({"global_scratch_size": 128}, {"launch": lambda *a: None}):
            assert EncodedLauncher.of(types.SimpleNamespace(run=types.SimpleNamespace(**{**vars(run), **changed})),
                                      positions) is None


def test_schedule_flags_parse_by_name():
    from pagedprefill_sm80.hopper.launch import SCHEDULE, parse_schedule

    assert parse_schedule("") == {}
    assert parse_schedule("PINGPONG=1, TURNS=0") == {"PINGPONG": True, "TURNS": False}
    assert set(parse_schedule(",".join(f"{name}=1" for name in SCHEDULE))) == set(SCHEDULE)
    for bad in ("PINGPONG", "PINGPONG=yes", "PING=1"):
        with pytest.raises(ValueError, match=f"schedule: expected NAME=0 or NAME=1 .*got '{bad}'"):
            parse_schedule(bad)


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
    """It passed the suites on the H200 and measured faster than the portable kernel (run 9)."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert choose_kernel(shape(kv_cache_dtype="fp8_e4m3", layout="split"), H200) == \
        ("hopper", "the Hopper kernel takes this shape and is the faster one")


def test_flags_that_do_not_apply_to_a_call_are_dropped_for_the_launch_and_the_memory_model():
    """``resolve_schedule`` is what the launch compiles and what ``shared_bytes`` counts: the split layout's
    FP8 cache is widened by the producer under every schedule, and not overlapped."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule, shared_bytes

    split_fp8 = shape(kv_cache_dtype="fp8_e4m3", layout="split")
    config = hopper_config(split_fp8)
    odd = dict(PRODUCER_WIDENS=False, OVERLAP=True)
    flags = resolve_schedule(split_fp8, config, odd)
    assert (flags["PRODUCER_WIDENS"], flags["OVERLAP"]) == (True, False)
    assert shared_bytes(split_fp8, config, odd) == shared_bytes(split_fp8, config)
    assert resolve_schedule(shape(layout="split"), config, odd)["OVERLAP"]  # a 16-bit cache takes it


def test_key_loads_apply_to_split_tiles_of_at_least_32_keys_with_a_warpgroups_registers(monkeypatch):
    """``KEY_LOADS`` reads split keys 32 at a time through a producer warpgroup: dropped for NHD and for
    narrower tiles, and the launch gives that warpgroup the registers of one that widens FP8 tiles."""
    from dataclasses import replace

    from pagedprefill_sm80.hopper.launch import (
        WIDENING_CONSUMER_REGS,
        WIDENING_PRODUCER_REGS,
        resolve_schedule,
    )

    split = shape(layout="split")
    config = hopper_config(split).with_(block_n=64, num_stages=3)  # one 32-key chunk's registers
    asked = dict(KEY_LOADS=True)
    assert resolve_schedule(split, config, asked)["KEY_LOADS"]
    assert not resolve_schedule(shape(), hopper_config(shape()), asked)["KEY_LOADS"]
    assert not resolve_schedule(split, replace(config, block_n=16), asked)["KEY_LOADS"]
    assert not resolve_schedule(split, config, dict(KEY_LOADS=False))["KEY_LOADS"]
    # Value boxes first: with key loads only, and only where the values are boxes.
    first = dict(KEY_LOADS=True, VALUES_FIRST=True)
    assert resolve_schedule(split, config, first)["VALUES_FIRST"]
    assert not resolve_schedule(split, config, dict(KEY_LOADS=False, VALUES_FIRST=True))["VALUES_FIRST"]
    assert not resolve_schedule(split, config, dict(first, VT_COPIES=True))["VALUES_FIRST"]
    split_fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve_schedule(split_fp8, hopper_config(split_fp8), first)["VALUES_FIRST"]
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split, asked)
    assert call.constexprs["KEY_LOADS"]
    assert (call.constexprs["PRODUCER_REGS"], call.constexprs["CONSUMER_REGS"]) == \
        (WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS)


def test_the_policy_reads_split_16_bit_caches_with_key_loads(monkeypatch):
    """Where they measured faster (runs 10-11): ``KEY_LOADS`` and ``VALUES_FIRST`` on the split layout's 16-bit
    cache at head sizes 128 and 256 on every tile, and at head sizes 64 and 96 on tiles of more than 64 keys
    (every split tile of theirs since run 13), the copies elsewhere; the environment and a caller's flags
    override the policy's, and ``info``'s reason names the flags."""
    from pagedprefill_sm80.hopper.launch import SCHEDULE, resolve_schedule
    from pagedprefill_sm80.policy import hopper_schedule

    assert not SCHEDULE["KEY_LOADS"] and not SCHEDULE["VALUES_FIRST"]  # the kernel's own defaults stay off
    for head_size in (64, 96, 128, 256):
        for layout, cache in (("split", "auto"), ("split", "fp8_e4m3"), ("nhd", "auto")):
            if cache != "auto" and head_size > 128:
                continue  # the Hopper kernel reads FP8 caches up to head size 128
            s = shape(layout=layout, head_size=head_size, kv_cache_dtype=cache)
            flags = resolve_schedule(s, hopper_config(s))
            taken = layout == "split" and cache == "auto"
            assert (flags["KEY_LOADS"], flags["VALUES_FIRST"]) == (taken, taken), (layout, head_size, cache)
            assert bool(hopper_schedule(s).get("KEY_LOADS")) == taken
            # 64-key tiles: the copies at head sizes 64 and 96, the loads at 128 and 256.
            assert bool(hopper_schedule(s, block_n=64).get("KEY_LOADS")) == (taken and head_size in (128, 256))
            kernel, why = Sm80Backend().kernel_choice(s, H200)
            flags_named = "KEY_LOADS+VALUES_FIRST" + "+WIDE_KEY_CHUNKS+EARLY_KEYS" * (head_size <= 128)
            assert why.endswith(f"; schedule {flags_named}") == taken, why
            # (an FP8 cache's page boxes: test_fp8_boxes_apply_to_the_split_layouts_fp8_cache_at_full_head_sizes;
            # short calls' 64-key tiles keep the V^T ring: test_the_policy_widens_split_fp8_values_into_the_v_ring)
            boxes = layout == "split" and cache != "auto" and head_size != 96
            if cache != "auto":
                assert hopper_schedule(s) == ({"FP8_BOXES": True} if boxes else {}), (layout, head_size)
            assert why.endswith("; schedule FP8_BOXES") == (boxes and kernel == "hopper"), why
            assert kernel == "hopper" or not taken
    split = shape(layout="split")
    config = hopper_config(split)
    assert not resolve_schedule(split, config, dict(VALUES_FIRST=False))["VALUES_FIRST"]
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=0")
    assert not resolve_schedule(split, config)["KEY_LOADS"]
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split)
    assert not call.constexprs["KEY_LOADS"] and not call.constexprs["VALUES_FIRST"]
    monkeypatch.delenv(SCHEDULE_ENV)
    call = kernel_call(make_problem(SPEC.replace(layout="split")), config, split)
    assert call.constexprs["KEY_LOADS"] and call.constexprs["VALUES_FIRST"]


def test_the_policy_reads_128_key_split_tiles_with_64_key_chunks_at_head_sizes_64_to_256():
    """Run 11: long calls of the split layout's 16-bit cache (128-key tiles) take ``KEY_LOADS``,
    ``VALUES_FIRST`` and ``WIDE_KEY_CHUNKS`` at head sizes 64, 96 and 128; head size 256 (32-key tiles) keeps
    32-key chunks, an FP8 cache the copies, NHD none of them; ``info`` names what the tile takes."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule
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
            flags = resolve_schedule(s, config)
            split16 = layout == "split" and cache == "auto"
            expected = (split16, split16, split16 and head_size <= 128, split16 and head_size <= 128)
            assert tuple(flags[n] for n in names) == expected, (layout, head_size, cache, config)
            assert tuple(bool(hopper_schedule(s, config.block_n).get(n)) for n in names) == expected
            why = Sm80Backend().kernel_choice(s, H200)[1]
            taken = "+".join(n for n, on in zip(names, expected) if on) or "FP8_BOXES+WIDEN_TO_V" * (cache != "auto")
            assert why.endswith(f"; schedule {taken}") if taken else "schedule" not in why, why
    # A tile of 64 keys at head size 64 (a caller's, or a table's) gets neither the loads nor their chunks.
    s64 = dataclasses.replace(shape(layout="split", head_size=64), num_tokens=4096, num_seqs=2, max_query_len=2048)
    assert hopper_schedule(s64, 64) == {} and hopper_schedule(s64)["WIDE_KEY_CHUNKS"]


def test_split_short_calls_take_128_key_tiles_at_head_sizes_64_to_128():
    """Runs 12-13: the split layout's short calls of a 16-bit cache at head sizes 64, 96 and 128 take 128 keys in
    a 2-deep ring, with 64-key chunks of loads issued early (many short at head size 128: 379.8 vs 367.6 TFLOP/s
    on 64-key tiles; 64: 284.6 vs 244.9; 96: 323.5 vs 278.2); an FP8 cache keeps its 64-key tiles (128 keys with
    its values widened into the V ring were 0.97 x in run 15); the tile fits an sm90 GPU."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule, shape_unfit_reason

    for head_size, cache, expected in ((128, "auto", (128, 2)), (64, "auto", (128, 2)), (96, "auto", (128, 2)),
                                       (128, "fp8_e4m3", (64, 2))):
        s = shape(layout="split", head_size=head_size, kv_cache_dtype=cache)
        assert s.workload == "short"
        config = Sm80Backend().tile_config(s, H200)
        assert (config.kernel, config.block_n, config.num_stages) == ("hopper", *expected), (head_size, cache)
        assert shape_unfit_reason(s, config, H200.max_shared_mem) is None
        if cache == "auto":
            flags = resolve_schedule(s, config)
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
    """Run 11: 256 keys per step in a 3-deep ring at head size 64 (NHD, long calls), 1.07 x over 128 keys; the
    shipped table's tuned entry agrees, and ``pagedprefill tune`` offers the tile."""
    from pagedprefill_sm80.hopper.launch import shape_unfit_reason
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
    from pagedprefill_sm80.hopper.launch import (
        WIDE_CHUNK_CONSUMER_REGS,
        WIDE_CHUNK_PRODUCER_REGS,
        resolve_schedule,
    )

    split = shape(layout="split")
    n128 = hopper_config(split).with_(block_n=128, num_stages=2)
    wide = dict(WIDE_KEY_CHUNKS=True)
    assert resolve_schedule(split, n128, wide)["WIDE_KEY_CHUNKS"]
    assert not resolve_schedule(split, n128, dict(wide, KEY_LOADS=False))["WIDE_KEY_CHUNKS"]
    assert not resolve_schedule(split, n128.with_(block_n=64, num_stages=3), wide)["WIDE_KEY_CHUNKS"]
    split_fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve_schedule(split_fp8, n128, dict(wide, KEY_LOADS=True))["WIDE_KEY_CHUNKS"]
    problem = make_problem(SPEC.replace(layout="split"))
    call = kernel_call(problem, n128, split, wide)
    assert call.constexprs["KEY_LOADS"] == 64 and "WIDE_KEY_CHUNKS" not in call.constexprs
    assert (call.constexprs["PRODUCER_REGS"], call.constexprs["CONSUMER_REGS"]) == \
        (WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS)
    assert kernel_call(problem, n128, split).constexprs["KEY_LOADS"] == 64  # the policy's, on 128-key tiles
    assert kernel_call(problem, n128, split, dict(WIDE_KEY_CHUNKS=False)).constexprs["KEY_LOADS"] == 32


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
    from pagedprefill_sm80.hopper.launch import WIDE_CHUNK_CONSUMER_REGS, WIDE_CHUNK_PRODUCER_REGS

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
    from pagedprefill_sm80.hopper.launch import resolve_schedule

    early = dict(EARLY_KEYS=True)
    split = shape(layout="split")
    n128 = hopper_config(split).with_(block_n=128, num_stages=2)
    n64 = hopper_config(split).with_(block_n=64, num_stages=3)
    assert resolve_schedule(split, n128, early)["EARLY_KEYS"]  # the policy's 64-key chunks
    assert resolve_schedule(split, n64, early)["EARLY_KEYS"]  # two chunks of 32
    assert not resolve_schedule(split, n128, dict(early, WIDE_KEY_CHUNKS=False))["EARLY_KEYS"]  # four of 32
    assert not resolve_schedule(split, n128, dict(early, KEY_LOADS=False))["EARLY_KEYS"]
    d256 = shape(layout="split", head_size=256)
    assert resolve_schedule(d256, hopper_config(d256), early)["EARLY_KEYS"]
    fp8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert not resolve_schedule(fp8, hopper_config(fp8), dict(early, KEY_LOADS=True))["EARLY_KEYS"]
    assert not resolve_schedule(shape(), hopper_config(shape()), early)["EARLY_KEYS"]
    assert not resolve_schedule(split, n128, dict(EARLY_KEYS=False))["EARLY_KEYS"]  # a caller turns it off


def test_the_policy_loads_split_keys_early_up_to_head_size_128():
    """Run 12: the split layout's key loads of a 16-bit cache are issued before their buffer is free at head
    sizes 64, 96 and 128, on long (128-key) and short (64-key) tiles; not at head size 256 (0.985 x), not with
    an FP8 cache or in the NHD layout; the environment turns it off."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule
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
                early = resolve_schedule(s, config)["EARLY_KEYS"]
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
    float16 (one packed conversion from FP8 already), a 16-bit cache, or the consumers' own widening; on unless
    asked off (run 13: 1.50 x NHD, 1.26 x split on the FP8 row), and in the launch's constexprs."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule

    f32 = dict(F32_WIDENING=True)
    for layout in ("nhd", "split"):
        fp8 = shape(layout=layout, kv_cache_dtype="fp8_e4m3")
        config = hopper_config(fp8)
        assert resolve_schedule(fp8, config)["F32_WIDENING"], layout  # on by default since run 13
        assert not resolve_schedule(fp8, config, dict(F32_WIDENING=False))["F32_WIDENING"], layout
        half = shape(layout=layout, kv_cache_dtype="fp8_e4m3", dtype=torch.float16)
        assert not resolve_schedule(half, hopper_config(half), f32)["F32_WIDENING"], layout
        assert not resolve_schedule(shape(layout=layout), hopper_config(shape(layout=layout)), f32)["F32_WIDENING"]
    fp8 = shape(kv_cache_dtype="fp8_e4m3")
    assert not resolve_schedule(fp8, hopper_config(fp8), dict(f32, PRODUCER_WIDENS=False))["F32_WIDENING"]
    problem = make_problem(SPEC.replace(kv_cache_dtype="fp8_e4m3"))
    assert kernel_call(problem, hopper_config(fp8), fp8).constexprs["F32_WIDENING"]
    assert not kernel_call(problem, hopper_config(fp8), fp8, dict(F32_WIDENING=False)).constexprs["F32_WIDENING"]


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


def test_new_values_transposed_apply_to_the_split_layouts_16_bit_cache_and_free_its_third_ring(monkeypatch):
    """``NEW_VALUES_T`` (off: run 14 measured it) applies to the split layout's 16-bit cache only (not NHD or an
    FP8 cache); without the new tokens' V ring a split tile takes NHD's shared memory, so head
    size 256 fits 64 keys in 2 stages and head size 128 fits 128 keys in 3 on an H200; the launch's constexprs
    carry it, and a token stride the producer's 32-bit offsets cannot span is refused by name."""
    from pagedprefill_sm80.hopper.launch import SCHEDULE, resolve_schedule, shape_unfit_reason, shared_bytes

    assert not SCHEDULE["NEW_VALUES_T"]
    flag = dict(NEW_VALUES_T=True)
    split = shape(layout="split")
    assert resolve_schedule(split, hopper_config(split), flag)["NEW_VALUES_T"]
    assert not resolve_schedule(split, hopper_config(split))["NEW_VALUES_T"]
    for other in (shape(layout="nhd"), shape(layout="split", kv_cache_dtype="fp8_e4m3")):
        assert not resolve_schedule(other, hopper_config(other), flag)["NEW_VALUES_T"]
    for head_size, tile in ((256, dict(block_n=64, num_stages=2)), (128, dict(block_n=128, num_stages=3))):
        s = shape(layout="split", head_size=head_size)
        config = hopper_config(s).with_(**tile)
        assert shared_bytes(s, config, flag) == shared_bytes(shape(layout="nhd", head_size=head_size), config)
        assert shared_bytes(s, config, flag) <= H200.max_shared_mem < shared_bytes(s, config), (head_size, tile)
    s256 = shape(layout="split", head_size=256)
    n64 = hopper_config(s256).with_(block_n=64, num_stages=2)
    assert "up to 32 keys per step" in shape_unfit_reason(s256, n64, H200.max_shared_mem)
    monkeypatch.setenv(SCHEDULE_ENV, "NEW_VALUES_T=1")
    assert shape_unfit_reason(s256, n64, H200.max_shared_mem) is None
    monkeypatch.delenv(SCHEDULE_ENV)
    problem = make_problem(SPEC.replace(layout="split"))
    assert kernel_call(problem, hopper_config(split), split, flag).constexprs["NEW_VALUES_T"]
    # Head size 256's 64-key tile: the producer holds a chunk of new values beside the next one's loads.
    from pagedprefill_sm80.hopper.launch import NEW_VALUES_CONSUMER_REGS, NEW_VALUES_PRODUCER_REGS

    p256 = make_problem(SPEC.replace(layout="split", head_size=256))
    call = kernel_call(p256, n64, problem_shape(p256), flag)
    assert (call.constexprs["PRODUCER_REGS"], call.constexprs["CONSUMER_REGS"]) == \
        (NEW_VALUES_PRODUCER_REGS, NEW_VALUES_CONSUMER_REGS)
    assert 128 * NEW_VALUES_PRODUCER_REGS + 256 * NEW_VALUES_CONSUMER_REGS <= 65536
    # One token of v whose token stride times the tile's keys passes 2**31 (no storage behind the stride).
    v = problem.v
    wide = torch.empty_strided((1, *v.shape[1:]), (2**31 // 64, v.stride(1), v.stride(2)), dtype=v.dtype)
    one = dataclasses.replace(make_problem(SPEC.replace(layout="split", query_lens=(1,), context_lens=(90,))),
                              v=wide)
    with pytest.raises(ValueError, match="NEW_VALUES_T: v's token stride"):
        kernel_call(one, hopper_config(split), problem_shape(one), flag)


def test_new_values_transposed_compile_for_sm90_with_two_rings():
    """The split layout's head size 256 on 64 keys in 2 stages under ``NEW_VALUES_T`` (the tile it makes room
    for; 32 keys beside three rings otherwise) and head size 64 on the policy's tile: warpgroup MMAs, no spills,
    and the shared memory the model counts without a V ring."""
    summaries = child_result("compile_new_values_transposed")
    assert sorted(summaries) == ["256", "64"], summaries
    for head_size, summary in summaries.items():
        assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, (head_size, summary)
        assert summary["model_bytes"] - 1024 <= summary["shared_bytes"] <= summary["model_bytes"], summary


def compile_new_values_transposed() -> dict:
    """Codegen summaries (and the shared-memory model's bytes) of split calls under ``NEW_VALUES_T``: head size
    256 on 64 keys in 2 stages, head size 64 on the policy's tile."""
    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel
    from pagedprefill_sm80.hopper.launch import shared_bytes

    flag = dict(NEW_VALUES_T=True)
    out = {}
    for head_size, tile in ((256, dict(block_n=64, num_stages=2)), (64, {})):
        problem = make_problem(SPEC.replace(layout="split", head_size=head_size, query_lens=(400, 300),
                                            context_lens=(500, 0)))
        s = problem_shape(problem)
        config = hopper_config(s).with_(**tile)
        compiled = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, flag), 90)
        out[str(head_size)] = {**summarize(compiled, 90).to_dict(), "model_bytes": shared_bytes(s, config, flag)}
    return out


def test_fp8_boxes_apply_to_the_split_layouts_fp8_cache_at_full_head_sizes():
    """``FP8_BOXES`` (the policy's since run 14, off in the kernel's own defaults) applies to the split layout's
    FP8 cache at head sizes that fill the tile (not 96, whose padded columns the boxes would leave unwritten), and
    the launch's constexprs carry it; a key cache the boxes cannot describe (not contiguous from its block
    dimension in) takes the 16-byte copies, and building its descriptors with the boxes is refused by name."""
    from pagedprefill_sm80.hopper.launch import SCHEDULE, call_tensors, resolve_schedule

    assert not SCHEDULE["FP8_BOXES"]
    split8 = shape(layout="split", kv_cache_dtype="fp8_e4m3")
    assert resolve_schedule(split8, hopper_config(split8))["FP8_BOXES"]
    assert not resolve_schedule(split8, hopper_config(split8), dict(FP8_BOXES=False))["FP8_BOXES"]
    for other in (shape(layout="split"), shape(layout="nhd", kv_cache_dtype="fp8_e4m3"),
                  shape(layout="split", kv_cache_dtype="fp8_e4m3", head_size=96)):
        assert not resolve_schedule(other, hopper_config(other), dict(FP8_BOXES=True))["FP8_BOXES"], other
    problem = make_problem(SPEC.replace(layout="split", kv_cache_dtype="fp8_e4m3"))
    assert kernel_call(problem, hopper_config(split8), split8).constexprs["FP8_BOXES"]
    # Every other block of a larger cache: the 16-byte copies take it, the boxes' view does not.
    key = problem.cache.key
    wider = torch.empty((2 * key.shape[0], *key.shape[1:]), dtype=key.dtype)[::2]
    wider.copy_(key)
    strided = dataclasses.replace(problem, cache=dataclasses.replace(problem.cache, key=wider))
    assert unfit_reason(strided, hopper_config(split8)) is None
    call = kernel_call(strided, hopper_config(split8), split8)
    assert not call.constexprs["FP8_BOXES"] and call.constexprs["FP8_CACHE"]
    boxes = resolve_schedule(split8, hopper_config(split8))
    with pytest.raises(ValueError, match="FP8_BOXES: key_cache must be contiguous"):
        call_tensors(strided, hopper_config(split8), boxes)


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
    from pagedprefill_sm80.hopper.launch import SCHEDULE, resolve_schedule, shape_unfit_reason, shared_bytes

    assert not SCHEDULE["WIDEN_TO_V"]
    flag, off = dict(WIDEN_TO_V=True), dict(WIDEN_TO_V=False)
    for head_size in (64, 96, 128):
        split8 = shape(layout="split", kv_cache_dtype="fp8_e4m3", head_size=head_size)
        n64 = hopper_config(split8).with_(block_n=64, num_stages=2)
        assert resolve_schedule(split8, n64, flag)["WIDEN_TO_V"]
        assert not resolve_schedule(split8, n64, off)["WIDEN_TO_V"]
        n128 = n64.with_(block_n=128)
        nhd8 = shape(layout="nhd", kv_cache_dtype="fp8_e4m3", head_size=head_size)
        assert shared_bytes(split8, n128, flag) == shared_bytes(nhd8, n128)
    assert shared_bytes(split8, n128, flag) <= H200.max_shared_mem < shared_bytes(split8, n128, off)
    assert shape_unfit_reason(split8, n128, H200.max_shared_mem) is None  # the policy's flags for the tile
    for other in (shape(layout="split"), shape(layout="nhd", kv_cache_dtype="fp8_e4m3")):
        assert not resolve_schedule(other, hopper_config(other), flag)["WIDEN_TO_V"], other
    problem = make_problem(SPEC.replace(layout="split", kv_cache_dtype="fp8_e4m3"))
    s = problem_shape(problem)
    n128 = hopper_config(s).with_(block_n=128, num_stages=2)
    assert kernel_call(problem, n128, s).constexprs["WIDEN_TO_V"]  # the policy's flags on 128-key tiles
    assert not kernel_call(problem, n128.with_(block_n=64), s).constexprs["WIDEN_TO_V"]


def test_the_policy_widens_split_fp8_values_into_the_v_ring():
    """Run 15: the split layout's FP8 cache at head sizes 64 and 128, long calls, takes 128 keys in 2 stages with
    its cached values widened into the V ring (374.5 vs 365.1 TFLOP/s on the FP8 row against 64 keys beside a
    V^T ring); short calls (0.97 x) and head size 96, whose padded head takes the copies, keep 64 keys beside the
    V^T ring, as does any tile of 64 keys (a caller's or a table's: 0.94 x there)."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule, shape_unfit_reason
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
            flags = resolve_schedule(s, config)
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
    from pagedprefill_sm80.hopper.launch import shared_bytes

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


def assert_off_by_default_and_on_every_route_when_asked(name: str) -> None:
    """The schedule flag ``name`` is off in the kernel's defaults and the policy's, and on for both layouts and
    cache formats when a caller asks for it."""
    from pagedprefill_sm80.hopper.launch import SCHEDULE, resolve_schedule

    assert not SCHEDULE[name]
    for layout in ("nhd", "split"):
        for cache in ("auto", "fp8_e4m3"):
            s = shape(layout=layout, kv_cache_dtype=cache)
            assert resolve_schedule(s, hopper_config(s), {name: True})[name], (name, layout, cache)
            assert not resolve_schedule(s, hopper_config(s))[name], (name, layout, cache)


def test_fused_scale_is_on_for_every_route_and_reaches_the_launch():
    """``FUSED_SCALE`` is on in the kernel's defaults and so on every route, both layouts and cache formats (the
    kernel leaves it aside for calls with softcap or ALiBi); a caller can turn it off, and the launch's constexprs
    carry it."""
    from pagedprefill_sm80.hopper.launch import SCHEDULE, resolve_schedule

    assert SCHEDULE["FUSED_SCALE"]
    for layout in ("nhd", "split"):
        for cache in ("auto", "fp8_e4m3"):
            s = shape(layout=layout, kv_cache_dtype=cache)
            assert resolve_schedule(s, hopper_config(s))["FUSED_SCALE"], (layout, cache)
            assert not resolve_schedule(s, hopper_config(s), dict(FUSED_SCALE=False))["FUSED_SCALE"], (layout, cache)
    problem = make_problem(SPEC)
    s = problem_shape(problem)
    assert kernel_call(problem, hopper_config(s), s).constexprs["FUSED_SCALE"]
    assert not kernel_call(problem, hopper_config(s), s, dict(FUSED_SCALE=False)).constexprs["FUSED_SCALE"]


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


def test_thread_arrivals_apply_where_the_consumers_hand_back_after_their_mmas():
    """``THREAD_ARRIVALS`` (off by default: level in run 13) applies on both layouts, 16-bit and FP8 caches that
    the producer widens; not where each consumer widens its own FP8 copies (their hand-back follows the barrier
    the widening needs), and the launch's constexprs carry it."""
    from pagedprefill_sm80.hopper.launch import resolve_schedule

    assert_off_by_default_and_on_every_route_when_asked("THREAD_ARRIVALS")
    arrivals = dict(THREAD_ARRIVALS=True)
    fp8 = shape(kv_cache_dtype="fp8_e4m3")
    assert not resolve_schedule(fp8, hopper_config(fp8), dict(arrivals, PRODUCER_WIDENS=False))["THREAD_ARRIVALS"]
    problem = make_problem(SPEC)
    assert kernel_call(problem, hopper_config(shape()), shape(), arrivals).constexprs["THREAD_ARRIVALS"]


def test_thread_arrivals_compile_for_sm90_with_one_barrier_less_per_consumer():
    """Per-thread hand-backs on the policy's NHD tile: no spills, an asynchronous-copy arrival in each of the
    two consumers instead of their one-thread arrival, and one warp barrier less in each."""
    summary = child_result("compile_thread_arrivals")
    assert summary["spill_bytes"] in (0, None) and summary["wgmma"] > 0, summary
    assert (summary["thread_arrivals"], summary["one_thread_arrivals"]) == (2, 0), summary
    assert (summary["default_thread_arrivals"], summary["default_one_thread_arrivals"]) == (0, 2), summary
    assert summary["barriers"] == summary["default_barriers"] - 2, summary


def compile_thread_arrivals() -> dict:
    """Codegen summary of the policy's NHD call under ``THREAD_ARRIVALS``, with the PTX's counts of warp barriers,
    per-thread (asynchronous-copy) arrivals and one-thread arrivals, under it and under the default."""
    import re

    from pagedprefill.triton.codegen import compile_call, summarize
    from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

    def counts(compiled, prefix=""):
        code = "\n".join(ptx_code(compiled))
        return {prefix + "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", code)),
                prefix + "thread_arrivals": len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", code)),
                prefix + "one_thread_arrivals": len(re.findall(r"mbarrier\.arrive\.shared::cta", code))}

    problem = make_problem(SPEC)
    s = problem_shape(problem)
    config = hopper_config(s)
    per_thread = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(THREAD_ARRIVALS=True)), 90)
    default = compile_call(hopper_prefill_kernel, kernel_call(problem, config, s, dict(THREAD_ARRIVALS=False)), 90)
    return {**summarize(per_thread, 90).to_dict(), **counts(per_thread), **counts(default, "default_")}


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
    from pagedprefill_sm80.hopper.launch import shared_bytes

    out = {}
    # The split layout's keys by 16-byte copies, as timed in run 11 (the policy's 64-key chunks of loads, which
    # it gives 128-key tiles, spill 100 bytes at 256 keys).
    for layout, stages, schedule in (("nhd", 3, {}), ("split", 2, dict(WIDE_PRODUCER=True, KEY_LOADS=False))):
        problem = make_problem(SPEC.replace(layout=layout, head_size=64))
        s = problem_shape(problem)
        config = hopper_config(s).with_(block_n=256, num_stages=stages)
        call = kernel_call(problem, config, s, schedule)
        out[layout] = {**summarize(compile_call(hopper_prefill_kernel, call, 90), 90).to_dict(),
                       "modelled_shared": shared_bytes(s, config, schedule)}
    return out


def test_schedule_flags_from_the_environment_sit_between_the_default_and_the_callers(monkeypatch):
    from pagedprefill_sm80.hopper.launch import resolve_schedule

    split = shape(layout="split")
    config = hopper_config(split)
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=1, HEAVY_FIRST=0")
    flags = resolve_schedule(split, config)
    assert flags["KEY_LOADS"] and not flags["HEAVY_FIRST"]
    assert not resolve_schedule(split, config, dict(KEY_LOADS=False))["KEY_LOADS"]
    monkeypatch.setenv(SCHEDULE_ENV, "KEY_LOADS=yes")
    with pytest.raises(ValueError, match=f"{SCHEDULE_ENV}: schedule: expected NAME=0 or NAME=1 .*got 'KEY_LOADS=yes'"):
        resolve_schedule(split, config)


def test_auto_takes_the_split_layouts_head_sizes_96_and_256(monkeypatch):
    """They passed the suites on the H200 and measured faster than the portable kernel (run 8)."""
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
