"""``pagedprefill bench``: a workload suite timed on the current device, with peers measured in the same run.

For each workload the selected backends run through the public dispatch, on each cache layout asked for
(``split``: the classic 5-D K / 4-D V; ``nhd``), and the peers run on the same data: the reference, and
torch's scaled_dot_product_attention (each of its fused backends that accepts the call: flash, cuDNN,
efficient) on the cached K/V gathered into contiguous tensors beforehand (the gather is not timed). Times are
medians of repeated device-event timings. FLOPs are ``4 * D * H * attended (query, key) pairs``, with the
causal and window parts counted exactly. Each backend's first call per workload and layout is timed on its
own (it includes compiling the kernel's specialisation unless Triton's cache already holds it).

The host-overhead row times 2000 calls on a tiny batch without synchronising (so the host is the limit):
the public drop-in ``context_attention_fwd``, against a bare Triton launch of core's kernel with its
arguments prepared once (what a hand-written launch of such a kernel costs; a backend's own kernel, such as
sm80's Hopper kernel, takes a launch of the same kind).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from .. import accelerator
from ..cache import gather_kv
from ..features import check_runnable
from ..types import PrefillProblem
from ..workloads import SUITES, BatchSpec, Workload, flops, fresh_output, make_problem
from .arguments import data_device, positive_int


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=max(50, reps), return_mode="median"))


def sdpa_peers(problem: PrefillProblem) -> dict[str, Callable[[], object]]:
    """Callables running torch SDPA per sequence on contiguous K/V, one per fused backend that accepts it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    p = problem
    b = p.batch
    group = p.num_heads // p.num_kv_heads
    seqs = []
    for i, (s, c) in enumerate(zip(b.seq_lens.tolist(), b.context_lens.tolist())):
        n = s - c
        if n == 0:
            continue
        s0 = int(b.query_start[i])
        kc, vc = gather_kv(p.cache, b.block_table[i], c, p.q.dtype)
        k = torch.cat([kc, p.k[s0:s0 + n]]).transpose(0, 1).unsqueeze(0).contiguous()
        v = torch.cat([vc, p.v[s0:s0 + n]]).transpose(0, 1).unsqueeze(0).contiguous()
        q = p.q[s0:s0 + n].transpose(0, 1).unsqueeze(0).contiguous()
        mask = causal_lower_right(n, s)
        seqs.append((q, k, v, mask))
    o = p.options
    if o.sliding_window is not None or o.alibi_slopes is not None or o.softcap or o.sinks is not None:
        return {}  # SDPA's fused kernels have no window/ALiBi/softcap/sinks: no like-for-like peer

    def run_all():
        for q, k, v, mask in seqs:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.sm_scale,
                                                             enable_gqa=group > 1)

    peers = {}
    for label, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                run_all()
        try:
            call()
            accelerator.synchronize(p.q.device)
        except Exception:
            continue  # this fused backend does not accept the call (dtype, head size, mask, GQA)
        peers[label] = call
    return peers


def _layouts_label(name: str, layout: str, layouts) -> str:
    return f"{name} {layout}" if len(layouts) > 1 else name


def run_suite(backends: list[str], workloads: list[Workload], device: torch.device, reps: int = 100,
              with_reference: bool = True, progress=None, layouts=("split", "nhd")) -> list[dict]:
    """Time every backend (on every layout) and peer on every workload; one row per (workload, implementation)."""
    from ..api import dispatch, get_registry
    from ..device import DeviceInfo

    info = DeviceInfo.detect(device)
    rows = []
    total = len(workloads)
    for i, wl in enumerate(workloads):
        if progress:
            progress(f"[{i + 1}/{total}] {wl.name}")
        f = flops(wl.spec)
        for j, layout in enumerate(layouts):
            problem = make_problem(wl.spec.replace(layout=layout), device)
            impls: dict[str, Callable[[], object]] = {}
            kernels: dict[str, str] = {}
            for name in backends:
                backend = get_registry().get(name)
                if backend.supports(info):
                    continue
                try:
                    check_runnable(backend, problem, info)
                except Exception as exc:  # said, not silently left out of the table
                    if progress:
                        progress(f"    {_layouts_label(name, layout, layouts):<20} not run: {exc}")
                    continue
                label = _layouts_label(name, layout, layouts)
                impls[label] = lambda n=name, pr=problem: dispatch(pr, backend=n)
                kernels[label] = backend.kernel_for(problem, info)
            ours = dict(impls)
            if j == 0:  # the peers do not read the paged cache: once per workload
                if with_reference:
                    impls["reference"] = lambda pr=problem: get_registry().get("reference").run(pr, info)
                impls.update(sdpa_peers(problem))
            for label, fn in impls.items():
                started = time.perf_counter()
                fn()  # warm-up (and compile), then one call alone for peak memory (do_bench has its own buffers)
                accelerator.synchronize(device)
                first_call_s = time.perf_counter() - started
                accelerator.reset_peak_memory_stats(device)
                base_mem = accelerator.memory_allocated(device)
                fn()
                accelerator.synchronize(device)
                peak = accelerator.max_memory_allocated(device) - base_mem
                ms = _median_ms(fn, reps if label != "reference" else 10)
                row = {"workload": wl.name, "impl": label, "ms": ms, "tflops": f / ms / 1e9,
                       "peak_extra_mib": peak / 2**20, "note": wl.note}
                if label in ours:
                    row["kernel"] = kernels[label]
                    row["first_call_s"] = first_call_s
                    check = fresh_output(problem)
                    dispatch(check, backend=label.split()[0])
                    expect = fresh_output(problem)
                    get_registry().get("reference").run(expect, info)
                    row["max_abs_err"] = float((check.out.float() - expect.out.float()).abs().max())
                rows.append(row)
                if progress:
                    first = f"  first call {first_call_s:.1f} s, {kernels[label]} kernel" if label in ours else ""
                    progress(f"    {label:<16} {ms:9.3f} ms {row['tflops']:8.1f} TFLOP/s{first}")
            del problem
            accelerator.empty_cache(device)
    return rows


def host_overhead(device: torch.device, backend: str, layout: str = "split", calls: int = 2000,
                  rounds: int = 7) -> dict:
    """Microseconds per call on a tiny batch, host-bound: the two drop-in signatures (the classic one, and the
    serving engine's, which computes the context lengths on the device first), and a bare launch of core's kernel.

    The bare launch exists only for backends built on core's Triton kernel (None otherwise). Each is timed in
    ``rounds`` rounds of ``calls / rounds`` calls without synchronising, all of them alternating round by round so
    that they see the same state of the host, and the median round is reported (a shared host's speed moves
    between one measurement and the next: single runs of 2000 calls differed by 1.7 x on the same machine).
    """
    from .. import api, vllm
    from ..api import get_registry
    from ..backends.triton_base import TritonBackend, problem_shape
    from ..device import DeviceInfo

    spec = BatchSpec(query_lens=(4, 3), context_lens=(16, 9), num_heads=32, num_kv_heads=8, head_size=128,
                     block_size=16, dtype=torch.bfloat16, layout=layout)
    p = make_problem(spec, device)
    c, b = p.cache, p.batch

    def drop_in():
        api.context_attention_fwd(p.q, p.k, p.v, p.out, "auto", c.key, c.value, b.block_table, b.query_start,
                                  b.seq_lens, b.context_lens, 4, backend=backend)

    def vllm_drop_in():
        vllm.context_attention_fwd(p.q, p.k, p.v, p.out, "auto", c.key, c.value, b.block_table, b.query_start,
                                   b.seq_lens, None, 4, 1.0, 1.0, backend=backend)

    timed = {"drop_in_us": drop_in, "vllm_drop_in_us": vllm_drop_in}
    chosen = get_registry().get(backend)
    if isinstance(chosen, TritonBackend):
        from ..triton.kernel import prefix_prefill_kernel
        from ..triton.launch import kernel_call

        info = DeviceInfo.detect(device)
        call = kernel_call(p, chosen.portable_tile(problem_shape(p), info))
        timed["bare_launch_us"] = lambda: prefix_prefill_kernel[call.grid](*call.args, **call.kwargs)
    per_round = max(1, calls // rounds)
    samples = {name: [] for name in timed}
    for fn in timed.values():  # warm-up: compile, and build the launch plan
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in timed.items():
            accelerator.synchronize(device)
            started = time.perf_counter()
            for _ in range(per_round):
                fn()
            accelerator.synchronize(device)
            samples[name].append((time.perf_counter() - started) / per_round * 1e6)
    result = {"backend": backend, "layout": layout, "calls": per_round * rounds, "drop_in_us": None,
              "vllm_drop_in_us": None, "bare_launch_us": None}
    result.update({name: statistics.median(values) for name, values in samples.items()})
    result["spread_us"] = {name: [round(min(values), 1), round(max(values), 1)] for name, values in samples.items()}
    return result


def format_table(rows: list[dict], field: str = "tflops", fmt: str = "{:.1f}") -> str:
    """A Markdown table: one line per workload, one column per implementation that has ``field``."""
    impls = list(dict.fromkeys(r["impl"] for r in rows if field in r))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["workload"], r["impl"]): r for r in rows}
    head = "| workload | " + " | ".join(impls) + " |"
    lines = [head, "| --- |" + " ---: |" * len(impls)]
    for w in workloads:
        vals = [fmt.format(cell[(w, i)][field]) if field in cell.get((w, i), {}) else "-" for i in impls]
        lines.append(f"| {w} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def format_overhead(results: list[dict]) -> str:
    """The host-overhead table: the median round of each, with the fastest and slowest rounds."""
    lines = ["| backend | layout | drop-in context_attention_fwd | vllm.context_attention_fwd | bare Triton launch, "
             "core's kernel |",
             "| --- | --- | ---: | ---: | ---: |"]

    def cell(r: dict, name: str) -> str:
        if r.get(name) is None:
            return "-"
        low_high = r.get("spread_us", {}).get(name)
        return f"{r[name]:.1f}" + (f" ({low_high[0]:.1f}-{low_high[1]:.1f})" if low_high else "")

    for r in results:
        lines.append(f"| {r['backend']} | {r['layout']} | {cell(r, 'drop_in_us')} | {cell(r, 'vllm_drop_in_us')} | "
                     f"{cell(r, 'bare_launch_us')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> Optional[str]:
    """A grouped bar chart of TFLOP/s per workload and implementation (None if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "reference"))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["workload"], r["impl"]): r["tflops"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads)), 4.5))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs = [i + j * width for i in range(len(workloads))]
        ax.bar(xs, [cell.get((w, impl), 0.0) for w in workloads], width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def cmd_bench(args) -> int:
    from ..api import select_backend
    from ..device import DeviceInfo, current_accelerator_type

    accel = current_accelerator_type()
    if accel is None:
        print("pagedprefill bench: needs an accelerator (timings use its device events); none is visible",
              file=sys.stderr)
        return 2
    device = torch.device(args.device or accel)
    info = DeviceInfo.detect(device)
    backends = args.backend or [select_backend(info).name]
    suite = SUITES[args.suite]()
    if args.only:
        suite = [w for w in suite if any(s.lower() in w.name.lower() for s in args.only)]
    start = time.time()
    layouts = ("split", "nhd") if args.layout == "both" else (args.layout,)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = run_suite(backends, suite, device, reps=args.reps, with_reference=not args.no_reference,
                     progress=say, layouts=layouts)
    overhead = []
    if not args.no_host_overhead:
        for name in backends:
            for layout in layouts:
                say(f"host overhead: {name} {layout}")
                overhead.append(host_overhead(device, name, layout))
    meta = {"device": info.describe(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "suite": args.suite, "backends": backends, "layouts": list(layouts), "commit": args.commit,
            "seconds": round(time.time() - start, 1)}
    print(f"\n{meta['device']}, torch {meta['torch']}, {meta['date']}, commit {args.commit or '?'}")
    print("\nTFLOP/s (median):\n")
    print(format_table(rows))
    print("\nKernel that ran each of our rows:\n")
    print(format_table(rows, "kernel", "{}"))
    print("\nFirst call per workload (s, includes compiling unless cached):\n")
    print(format_table(rows, "first_call_s", "{:.1f}"))
    if overhead:
        print("\nHost overhead, tiny batch, us per call (no synchronisation; median of 7 rounds of 285 calls, "
              "alternating, with the fastest and slowest round):\n")
        print(format_overhead(overhead))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "host_overhead": overhead}, fh, indent=1)
    if args.png:
        plot(rows, args.png, f"pagedprefill bench: {info.name}, {meta['date']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="time the workload suite for backends and peers (GPU)")
    p.add_argument("--backend", action="append", help="backend to time (repeatable; default: the selected one)")
    p.add_argument("--device", type=data_device, default=None, help="CUDA device to time on (default: the current)")
    p.add_argument("--suite", choices=sorted(SUITES), default="default",
                   help="workloads to time: the performance table's (default) or context scaling, 2 x 1024 new "
                        "tokens on 8k, 32k and 128k cached (context)")
    p.add_argument("--only", action="append", help="run workloads whose name contains this (repeatable)")
    p.add_argument("--reps", type=positive_int, default=200, help="do_bench repetition budget in ms (default 200)")
    p.add_argument("--layout", choices=["split", "nhd", "both"], default="both",
                   help="cache layout(s) the backends read (default: %(default)s)")
    p.add_argument("--no-reference", action="store_true", help="skip timing the reference implementation")
    p.add_argument("--no-host-overhead", action="store_true", help="skip the host-overhead row")
    p.add_argument("--json", default="bench.json", help="write rows here (default bench.json)")
    p.add_argument("--png", default="bench.png", help="write a chart here (default bench.png)")
    p.add_argument("--commit", default=None, help="commit id to record with the results")
    p.set_defaults(func=cmd_bench)
