"""``pagedprefill tune``: measure a backend's declared tile search space on the present GPU, write a table.

For each (head size, dtype, workload) key, every candidate :class:`TileConfig` from the backend's
``search_space(shape, device)`` (tiles of the kernel its policy chooses for that key; each entry names its
kernel) is run through the backend's ``run_tile``, first checked against the reference on a small ragged batch (a wrong
candidate is dropped, never timed), then timed on a representative batch: every candidate once per round, in
alternating order over ``--rounds`` rounds (a single pass favoured whichever ran once the GPU's clocks had risen
after the compiles), the median round counting. The fastest candidate
per key goes into the table at :func:`pagedprefill.tuning.user_table_path`, which the backend's policy reads
on the next run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from ..errors import DeviceUnavailableError
from ..testing.cases import DEFAULT_TOLERANCES, assert_matches_reference
from ..timing import alternating_rounds
from ..workloads import BatchSpec, fresh_output, make_problem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def representative_spec(head_size: int, dtype: torch.dtype, workload: str, layout: str = "nhd") -> BatchSpec:
    base = BatchSpec(num_heads=32, num_kv_heads=8, head_size=head_size, block_size=16, dtype=dtype, spare_blocks=0,
                     layout=layout)
    if workload == "short":
        return base.replace(query_lens=(64,) * 32, context_lens=tuple(1024 + 32 * i for i in range(32)))
    return base.replace(query_lens=(1024,) * 4, context_lens=(4096, 2048, 6144, 0))


def check_spec(head_size: int, dtype: torch.dtype, layout: str = "nhd") -> BatchSpec:
    return BatchSpec(query_lens=(77, 1, 130, 5), context_lens=(300, 45, 0, 17), num_heads=8, num_kv_heads=2,
                     head_size=head_size, block_size=16, dtype=dtype, seed=3, layout=layout)


def tune(backend_name: str, head_sizes, dtypes, workloads, device: torch.device, log=print,
         on_key=None, layouts=("nhd",), rounds: int = 3) -> dict:
    import triton.testing

    from ..api import get_registry
    from ..backends.triton_base import problem_shape
    from ..device import DeviceInfo
    from ..tuning import table_key

    info = DeviceInfo.detect(device)
    backend = get_registry().get(backend_name)
    entries, report = {}, []
    keys = [(d, t, w, lay) for d in head_sizes for t in dtypes for w in workloads for lay in layouts]
    started = time.time()
    for i, (d, dt, wl, layout) in enumerate(keys):
        dtype = DTYPES[dt]
        problem = make_problem(representative_spec(d, dtype, wl, layout), device)
        check = make_problem(check_spec(d, dtype, layout), device)
        shape = problem_shape(problem)
        key = table_key(shape, info)
        candidates = backend.search_space(shape, info)
        if not candidates:
            raise ValueError(f"--backend: backend {backend_name!r} offers no tiles to measure for {key} (its "
                             "search_space() is empty), so there is nothing to tune; choose a backend that "
                             "declares a search space (sm80)")
        elapsed = time.time() - started
        eta = f", about {elapsed / i * (len(keys) - i):.0f} s left" if i else ""
        log(f"[{i + 1}/{len(keys)}] {key}: {len(candidates)} candidates ({elapsed:.0f} s so far{eta})")
        runnable = []
        for j, cfg in enumerate(candidates):
            try:
                out = fresh_output(check)
                backend.run_tile(out, cfg, info)
                atol, rtol = DEFAULT_TOLERANCES[dtype]
                assert_matches_reference(out.out, out, atol, rtol, label=str(cfg))
                backend.run_tile(problem, cfg, info)  # compiled for the timed batch too, before any timing
            except Exception as exc:  # compile failure (resources) or wrong result: drop the candidate
                log(f"    {j + 1:3d}/{len(candidates)} {cfg.to_dict()} rejected: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:100]}")
                continue
            runnable.append(cfg)
        times = alternating_rounds(
            [lambda c=cfg, pr=problem: backend.run_tile(pr, c, info) for cfg in runnable], rounds,
            lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")))
        best = None
        medians = []
        for cfg, samples in zip(runnable, times):
            ms = statistics.median(samples)
            medians.append(ms)
            log(f"    {cfg.to_dict()} {ms:.3f} ms (rounds {min(samples):.3f}-{max(samples):.3f})")
            if best is None or ms < best[0]:
                best = (ms, cfg, samples)
        if best is not None:
            ms, cfg, samples = best
            runner_up = sorted(medians)[1] if len(medians) > 1 else None
            # The winner's own rounds spread wider than its lead over the next tile: the pick is the fastest
            # median, but the measurement could not tell the two apart.
            separable = runner_up is None or max(samples) - min(samples) < runner_up - ms
            if not separable:
                log(f"    {key}: the fastest tile's rounds spread {max(samples) - min(samples):.3f} ms, more than "
                    f"its lead of {runner_up - ms:.3f} ms over the next; more --rounds would separate them")
            entries[key] = cfg
            report.append((key, ms, cfg, separable))
            if on_key is not None:
                on_key(key, best[1])  # saved as soon as a key is done: an interrupted sweep keeps its results
        del problem, check
    return {"entries": entries, "report": report}


def cmd_tune(args) -> int:
    from ..device import DeviceInfo, current_accelerator_type
    from ..tuning import load_table, save_table, user_table_path

    accel = current_accelerator_type()
    if accel is None:
        raise DeviceUnavailableError(
            f"needs a GPU (or another accelerator torch {torch.__version__} can use) to time the tiles on, and none "
            f"is visible; 'pagedprefill info' shows what this machine has")
    device = torch.device(args.device or accel)
    info = DeviceInfo.detect(device)
    t0 = time.time()
    path = user_table_path(args.backend, info) if args.out is None else Path(args.out)

    def save(key, config):
        merged = {**load_table(path), key: config}
        save_table(path, info, merged, {"backend": args.backend, "date": time.strftime("%Y-%m-%d")})

    result = tune(args.backend, args.head_size, args.dtype, args.workload, device,
                  log=lambda m: print(m, file=sys.stderr, flush=True), on_key=save, layouts=args.layout,
                  rounds=args.rounds)
    print(f"\ntuned {len(result['entries'])} keys in {time.time() - t0:.0f} s on {info.describe()}")
    for key, ms, cfg, separable in result["report"]:
        print(f"  {key:<32} {ms:8.3f} ms  {cfg.to_dict()}{'' if separable else '  (within the rounds spread)'}")
    print(f"table written to {path}")
    return 0
