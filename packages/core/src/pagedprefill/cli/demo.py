"""``pagedprefill demo``: a realistic paged batch on the selected backend, checked and timed."""

from __future__ import annotations

import time

import torch

from ..api import select_backend
from ..backends.triton_base import TritonBackend
from ..device import DeviceInfo, interpreter_enabled
from ..testing.cases import DEFAULT_TOLERANCES
from ..validation import dtype_name
from ..workloads import BatchSpec, fresh_output, make_problem
from .commands import INTERPRETER_REPEATS, REPEATS


def demo_spec(device: torch.device) -> BatchSpec:
    """The demo's batch: Llama-style GQA with ragged prefixes, decode rows and a fresh prompt."""
    if device.type == "cpu":
        return BatchSpec(query_lens=(96, 1, 160, 33), context_lens=(512, 700, 0, 257), num_heads=8,
                         num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float32, seed=7)
    return BatchSpec(query_lens=(1024, 1, 512, 2048, 7), context_lens=(3072, 4000, 0, 1000, 513), num_heads=32,
                     num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16, seed=7)


def cmd_demo(args) -> int:
    """Run a realistic paged batch on the selected backend, check it against an independent float64
    computation, time it."""
    device = args.device or DeviceInfo.detect().torch_device
    info = DeviceInfo.detect(device)
    backend = select_backend(info, args.backend)
    spec = demo_spec(device)
    problem = make_problem(spec, device)
    interpreted = runs_in_interpreter(backend, device)
    repeats = args.repeats or (INTERPRETER_REPEATS if interpreted else REPEATS)
    print(f"device:  {info.describe()}")
    print(f"backend: {backend.name}")
    print(f"batch:   {len(spec.query_lens)} sequences, new tokens {list(spec.query_lens)}, cached "
          f"{list(spec.context_lens)}; q {tuple(problem.q.shape)}, heads {spec.num_heads}/{spec.num_kv_heads}, "
          f"block size {spec.block_size}, {dtype_name(spec.dtype)}")
    if interpreted:
        # Seconds per run here: say what is running, so that a quiet terminal is not taken for a hang.
        chosen = "" if args.repeats else " (the default under the interpreter: --repeats N for more)"
        print(f"Triton's CPU interpreter runs the kernels, several seconds a run: a checked warm-up run, then "
              f"{repeats} timed run{'s' if repeats > 1 else ''}{chosen}", flush=True)
    from ..api import dispatch

    t0 = time.perf_counter()
    dispatch(problem, backend=backend, validate="full")  # warm-up (compiles kernels), checked below
    if interpreted:
        print(f"warm-up run: {time.perf_counter() - t0:.1f} s", flush=True)
    times = []
    for i in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dispatch(fresh_output(problem), backend=backend)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if interpreted:
            print(f"timed run {i + 1} of {repeats}: {times[-1]:.1f} s", flush=True)
    out = problem.out.double()
    from ..testing.sdpa import sdpa_float64

    # Not the reference backend: on a machine without a GPU the demo runs that backend, which would then be
    # compared with itself. PyTorch's own attention in float64 is independent of every backend.
    expected = sdpa_float64(problem)
    err = (out - expected).abs().max().item() if out.numel() else 0.0
    atol, _ = DEFAULT_TOLERANCES[spec.dtype]
    ok = bool(torch.isfinite(out).all()) and err <= atol * 4
    times.sort()
    print(f"max abs error vs float64 torch scaled_dot_product_attention (independent of the backends): "
          f"{err:.3e} (tolerance {atol * 4:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    note = " (Triton's CPU interpreter: a correctness run, not a speed figure)" if (
        device.type == "cpu" and backend.name != "reference") else ""
    median = times[len(times) // 2] * 1e3
    timed = f"{median:.2f} ms, one run" if len(times) == 1 else f"median {median:.2f} ms over {len(times)} runs"
    print(f"time: {timed} (host clock, synchronised){note}")
    return 0 if ok else 1


def runs_in_interpreter(backend, device: torch.device) -> bool:
    """Whether ``backend`` runs Triton's kernels in the CPU interpreter for tensors on ``device`` (seconds a run)."""
    return device.type == "cpu" and interpreter_enabled() and isinstance(backend, TritonBackend)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
