"""How many query heads of a KV group each tile should hold, per model shape (GPU, alternating rounds).

For each row of a bench suite (``--suite``; by default the models suite, ``pagedprefill bench --suite models
--list``), built once in the serving engine's form (k = v = None, every key and value in the NHD cache), the sm80
backend binds the engine's call with the policy's tile and with the same tile holding other packings of the group
(``--packings``: ``policy``, a number of heads, ``group`` for the whole group, ``half`` for half of it); where a
packing changes the number of programs, the key splits are the policy's rule for it. Beside them: the classic call
on the same data (the new tokens' keys and values passed separately, NHD) and, when ``flash_attn.cute`` imports,
FlashAttention-4 on the paged cache. Every column's output is checked against the float32 reference before it is
timed; the times are medians of ``do_bench`` medians over alternating rounds.

Usage: python ci/gpu/heads_sweep.py [--suite models|default|engine|context] [--only NAME ...]
       [--packings policy,1,2,group] [--tiles 64x64w4s3 ...] [--rounds 3] [--reps 50] [--json PATH]
       [--png PATH] [--compile-only] [--no-fa4]
       python ci/gpu/heads_sweep.py --replot JSON --png PATH      (the chart of a written JSON, no GPU)
Rows in the order of ``--only`` (each row once); one line per row: TFLOP/s (GB/s too for memory-bound rows) of
each column; the JSON is written after every row, the chart (``--png``: a panel of TFLOP/s, one of GB/s for
memory-bound rows, a bar per column) at the end. Exit status 1 when a column misses the conformance tolerance.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch
import triton.testing
from pagedprefill.api import get_registry
from pagedprefill.cli import fa4 as fa4_peer
from pagedprefill.cli.bench import check_plain, classic_call, output_error, plot, reference_output
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import key_splits_for, problem_shape, settle
from pagedprefill.timing import alternating_rounds
from pagedprefill.workloads import SUITES, classic_twin, flops, fresh_output, kv_bytes, make_problem


def packings(spec: str, group: int, policy: int) -> list[int]:
    """The head counts ``spec`` names for a group of ``group`` heads whose policy packs ``policy``, without
    repeats, the policy's first."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        heads = {"policy": policy, "group": group, "half": max(1, group // 2)}.get(item)
        heads = int(item) if heads is None else heads
        if 1 <= heads <= group and heads not in out:
            out.append(heads)
    return out


TILE_SPEC = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)$")


def tile_spec(text: str) -> dict:
    """A tile written ``128x64w8s3`` (rows x keys, warps, stages) as the TileConfig fields it sets."""
    match = TILE_SPEC.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"--tiles: expected ROWSxKEYSwWARPSsSTAGES (e.g. 64x64w4s3), got {text!r}")
    rows, keys, warps, stages = map(int, match.groups())
    return dict(block_m=rows, block_n=keys, num_warps=warps, num_stages=stages)


def forced(backend, problem, info, heads: int, tile: dict = None):
    """The backend's plan for the engine's call of ``problem`` with its policy's tile holding ``heads`` heads
    of each group (key splits re-chosen for the packing), or ``tile``'s rows, keys, warps and stages with the
    policy's kernel, and that tile."""
    shape = problem_shape(problem)
    policy = backend.tile_config(shape, info)
    config = settle(policy.with_(heads_per_tile=heads, key_splits=1, **(tile or {})), shape)
    config = config.with_(key_splits=key_splits_for(shape, config, info) if policy.key_splits > 1 else 1)
    backend.tile_config = lambda shape, device: config
    try:
        return backend.bind(problem, info), config
    finally:
        del backend.tile_config  # the class's memoised policy again


def chart(payload: dict, path: str):
    """The chart of a run's JSON (``payload``: its ``device`` and ``rows``) at ``path``, by the bench's
    :func:`~pagedprefill.cli.bench.plot`: each column of a row one bar; None when matplotlib is missing or no row
    was timed."""
    def impl(label: str) -> str:  # the policy's packing is one bar colour whatever its head count
        return "engine (policy)" if label.startswith("engine h") and label.endswith("(policy)") else label

    rows = [dict(workload=row["workload"], impl=impl(label), memory_bound=row["memory_bound"],
                 tflops=cell["tflops"], **({"gbps": cell["gbps"]} if row["memory_bound"] else {}))
            for row in payload["rows"] for label, cell in row["columns"].items()]
    device = payload["device"].split(" (")[0]
    return plot(rows, path, f"the engine's call beside the classic call and FA4, by head packing ({device})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="models", help="the suite whose rows are timed")
    parser.add_argument("--only", action="append", default=[], help="rows whose name contains this (repeatable)")
    parser.add_argument("--packings", default="policy,1,2,group", help="head counts per tile to time")
    parser.add_argument("--tiles", type=tile_spec, nargs="*", default=[], metavar="TILE",
                        help="more columns: the engine's call on these tiles (ROWSxKEYSwWARPSsSTAGES, e.g. 64x64w4s3) "
                             "with the policy's kernel and packing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50, help="do_bench budget per timing, ms")
    parser.add_argument("--json", default="")
    parser.add_argument("--png", default="", help="draw the run's chart here when it ends (needs matplotlib)")
    parser.add_argument("--replot", default="", metavar="JSON",
                        help="draw the chart (--png) of a JSON an earlier run wrote, and stop: no GPU needed")
    parser.add_argument("--no-fa4", action="store_true", help="leave FlashAttention-4 out even if it imports")
    parser.add_argument("--compile-only", action="store_true",
                        help="bind each plan once, check and time nothing (to fill Triton's cache from several "
                             "processes before the timing run)")
    args = parser.parse_args(argv)
    if args.replot:
        if not args.png:
            parser.error("--replot: name the chart's file with --png")
        with open(args.replot) as fh:
            drawn = chart(json.load(fh), args.png)
        print(f"chart: {drawn}" if drawn else "no chart: matplotlib is not installed or no row was timed")
        return 0 if drawn else 1
    # In the order of --only, so that a run cut short has timed the rows named first.
    suite = SUITES[args.suite]()
    rows = suite if not args.only else list({wl.name: wl for part in args.only for wl in suite
                                             if part in wl.name}.values())
    if not rows:
        parser.error(f"--only {args.only}: no row of the {args.suite} suite matches")
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().get("sm80")
    fa4 = None
    if not (args.no_fa4 or args.compile_only):
        fa4, line = fa4_peer.load()
        print(line, flush=True)
    results, ok = [], True
    for wl in rows:
        engine = make_problem(wl.spec.replace(layout="nhd", kv_in_cache=True), "cuda")
        shape = problem_shape(engine)
        policy = backend.tile_config(shape, info).heads_per_tile
        columns = {}
        for heads in packings(args.packings, shape.group_size, policy):
            problem = fresh_output(engine)
            plan, config = forced(backend, problem, info, heads)
            label = f"engine h{heads}" + (" (policy)" if heads == policy else "")
            columns[label] = (lambda p=plan, q=problem: (p(q), q.out)[1], config)
        for tile in args.tiles:
            problem = fresh_output(engine)
            label = f"engine {tile['block_m']}x{tile['block_n']}w{tile['num_warps']}s{tile['num_stages']}"
            try:
                plan, config = forced(backend, problem, info, policy, tile)
            except (ValueError, RuntimeError) as why:  # a tile this row's shape cannot take
                print(f"{wl.name}: no column {label}: {why}", flush=True)
                continue
            columns[label] = (lambda p=plan, q=problem: (p(q), q.out)[1], config)
        try:  # the classic drop-in's call covers plain causal attention only (no window, softcap, ...)
            check_plain(wl)
        except ValueError as why:
            print(f"{wl.name}: no classic column: {why}", flush=True)
        else:
            classic = classic_twin(engine, "nhd")
            columns["nhd (policy)"] = (classic_call(classic, "sm80"),
                                       backend.tile_config(problem_shape(classic), info))
        if args.compile_only:
            for run, _ in columns.values():
                run()
            torch.cuda.synchronize()
            print(f"compiled {wl.name}", flush=True)
            continue
        if fa4 is not None and fa4_peer.unsupported(engine) is None:
            columns["fa4"] = (fa4_peer.paged_call(fa4, engine), None)
        expect = reference_output(engine)
        errors = {}
        for label, (run, _) in columns.items():
            error = output_error(run(), expect)
            errors[label] = error.get("max_abs_err", float("nan"))
            if not error["within_tolerance"]:
                ok = False
                print(f"FAIL {wl.name} {label}: {error}", flush=True)
        labels = list(columns)
        times = alternating_rounds([columns[label][0] for label in labels], args.rounds,
                                   lambda fn: triton.testing.do_bench(fn, warmup=25, rep=args.reps,
                                                                      return_mode="median"))
        f, nbytes = flops(wl.spec), kv_bytes(wl.spec)
        row = dict(workload=wl.name, group=shape.group_size, memory_bound=wl.memory_bound, columns={})
        cells = []
        for label, t in zip(labels, times):
            ms = statistics.median(t)
            config = columns[label][1]
            row["columns"][label] = dict(ms=ms, tflops=f / ms / 1e9, gbps=nbytes / ms / 1e6, rounds_ms=t,
                                         max_abs_err=errors[label],
                                         config=None if config is None else config.to_dict())
            cells.append(f"{label} {f / ms / 1e9:.1f}" + (f" ({nbytes / ms / 1e6:.0f} GB/s)" if wl.memory_bound
                                                          else ""))
        print(f"{wl.name}: " + " | ".join(cells), flush=True)
        results.append(row)
        if args.json:  # after every row: a run cut short keeps what it timed
            with open(args.json, "w") as fh:
                json.dump(dict(device=info.describe(), packings=args.packings, rows=results), fh, indent=1)
        del engine, columns, expect
        torch.cuda.empty_cache()
    if args.png and results:
        print(f"chart: {chart(dict(device=info.describe(), rows=results), args.png)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
