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

The engine suite (``--suite engine``, :func:`run_engine_suite`), and the models suite (``--suite models``: one
GPU's heads of common models at tensor-parallel degrees 1-8) timed the same way, time each workload the way a
serving engine calls attention: ``pagedprefill.vllm.context_attention_fwd`` with k = v = None on an NHD cache
that holds every token (the new tokens' keys and values written into it first), beside the classic drop-in on
each layout asked for, all on the same data, in alternating rounds; its peer is FlashAttention-4 (:mod:`.fa4`)
whenever ``flash_attn.cute`` imports.
Every column's output is compared with the float32 reference before it is timed, and a wrong one is reported
and not timed. Memory-bound rows also get GB/s of the K/V bytes the call must read
(:func:`~pagedprefill.workloads.kv_bytes`).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import accelerator
from ..cache import gather_kv
from ..errors import DeviceUnavailableError
from ..features import check_runnable
from ..timing import alternating_rounds
from ..types import PrefillProblem
from ..workloads import (
    SUITES,
    BatchSpec,
    Workload,
    classic_twin,
    flops,
    fresh_output,
    kv_bytes,
    make_problem,
    with_output,
)
from . import fa4 as fa4_peer


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
    for i, (s, c) in enumerate(zip(b.seq_lens.tolist(), b.context_lengths().tolist())):
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


@dataclass(frozen=True)
class Column:
    """One column of the engine suite on one workload.

    ``run`` computes the workload once and returns the output it wrote (None with ``refused``: why the column
    does not run); ``fields`` go into its row (backend, call, layout, kernel). ``ours``: one of our backends,
    whose exceptions are bugs and propagate (a peer's are reported). ``checked``: compared with the reference
    before it is timed (all but the reference itself).
    """

    label: str
    run: Optional[Callable[[], torch.Tensor]]
    fields: dict = field(default_factory=dict)
    ours: bool = False
    checked: bool = True
    refused: Optional[str] = None


def engine_call(problem: PrefillProblem, backend: str) -> Callable[[], torch.Tensor]:
    """The serving engine's call of ``problem`` (k = v = None, every key and value in the cache):
    ``pagedprefill.vllm.context_attention_fwd`` with vLLM's arguments; returns the output it writes."""
    from .. import vllm

    c, b, p = problem.cache, problem.batch, problem
    max_seq, max_query = int(b.seq_lens.max()), int(b.query_start.diff().max())

    def run() -> torch.Tensor:
        vllm.context_attention_fwd(p.q, None, None, p.out, str(c.dtype), c.key, c.value, b.block_table,
                                   b.query_start, b.seq_lens, max_seq, max_query, c.k_scale, c.v_scale,
                                   sm_scale=p.options.sm_scale, q_scale=p.options.q_scale, backend=backend)
        return p.out

    return run


def classic_call(problem: PrefillProblem, backend: str) -> Callable[[], torch.Tensor]:
    """The classic call of ``problem`` (the new tokens' keys and values passed separately): the drop-in
    ``pagedprefill.context_attention_fwd``; returns the output it writes."""
    from .. import api

    c, b, p = problem.cache, problem.batch, problem
    max_query = int(b.query_start.diff().max())

    def run() -> torch.Tensor:
        api.context_attention_fwd(p.q, p.k, p.v, p.out, str(c.dtype), c.key, c.value, b.block_table, b.query_start,
                                  b.seq_lens, b.context_lens, max_query, c.k_scale, c.v_scale,
                                  sm_scale=p.options.sm_scale, q_scale=p.options.q_scale, backend=backend)
        return p.out

    return run


def check_plain(workload: Workload) -> None:
    """Refuse a workload with options: the engine suite passes both drop-ins the arguments they take alike,
    which cover plain causal attention (with any scale and cache dtype) only."""
    s = workload.spec
    options = {"alibi": s.alibi, "sinks": s.sinks, "softcap": bool(s.softcap), "sliding_window": bool(s.sliding_window),
               "causal=False": not s.causal, "skip_decode": s.skip_decode, "fp8_out_scale": s.fp8_out_scale is not None}
    used = [name for name, on in options.items() if on]
    if used:
        raise ValueError(f"workload {workload.name!r}: the engine suite times plain causal attention, the call both "
                         f"drop-ins take alike; this one sets {', '.join(used)}")


def engine_forms(engine: PrefillProblem, layouts) -> list[tuple[str, str, PrefillProblem]]:
    """``(call, layout, problem)`` for each of our columns: the engine's call where NHD is asked for (vLLM's
    layout), then the classic call on each layout (NHD first, beside the engine's), all holding the same data."""
    forms = [("engine", "nhd", engine)] if "nhd" in layouts else []
    ordered = sorted(layouts, key=lambda layout: layout != "nhd")
    return forms + [("classic", layout, classic_twin(engine, layout)) for layout in ordered]


def _column_label(backend: str, call: str, layout: str, backends) -> str:
    name = "engine" if call == "engine" else layout
    return f"{backend} {name}" if len(backends) > 1 else name


def our_columns(backends: list[str], forms, info) -> list[Column]:
    """A column per backend and form, each writing its own NaN-poisoned output; a form the backend refuses
    is a column that says why."""
    from ..api import get_registry

    columns = []
    for name in backends:
        backend = get_registry().get(name)
        for call, layout, form in forms:
            problem = fresh_output(form)
            label = _column_label(name, call, layout, backends)
            fields = {"backend": name, "call": call, "layout": layout}
            try:
                check_runnable(backend, problem, info)
            except Exception as exc:  # said in the table and the JSON, not silently left out
                columns.append(Column(label, None, fields, ours=True, refused=one_line_reason(exc)))
                continue
            run = engine_call(problem, name) if call == "engine" else classic_call(problem, name)
            columns.append(Column(label, run, {**fields, "kernel": backend.kernel_for(problem, info)}, ours=True))
    return columns


def peer_columns(engine: PrefillProblem, fa4, with_reference: bool, info) -> list[Column]:
    """The reference (unless left out) and, with ``fa4`` (the imported ``flash_attn.cute``), FA4's two
    columns, all on the engine's problem."""
    from ..api import get_registry

    columns = []
    if with_reference:
        problem = fresh_output(engine)

        def reference() -> torch.Tensor:
            get_registry().get("reference").run(problem, info)
            return problem.out

        columns.append(Column("reference", reference, {"call": "reference", "layout": "nhd"}, checked=False))
    if fa4 is not None:
        refused = fa4_peer.unsupported(engine)
        for label, make in (("fa4", fa4_peer.paged_call), ("fa4 contig", fa4_peer.contiguous_call)):
            run = make(fa4, engine) if refused is None else None
            columns.append(Column(label, run, {"call": "peer", "layout": "nhd"}, refused=refused))
    return columns


def reference_output(problem: PrefillProblem) -> torch.Tensor:
    """``problem``'s reference output, computed and kept in float32 (not rounded to the output dtype)."""
    from ..reference_impl import reference_prefill

    expect = torch.full(problem.out.shape, float("nan"), dtype=torch.float32, device=problem.device)
    return reference_prefill(with_output(problem, expect))


def output_error(out: torch.Tensor, expected: torch.Tensor) -> dict:
    """How far ``out`` is from the float32 ``expected``: ``max_abs_err``, ``rel_l2``, and ``within_tolerance``
    (finite, and every element within the conformance suite's tolerance for ``out``'s dtype)."""
    from ..testing.cases import DEFAULT_TOLERANCES

    if tuple(out.shape) != tuple(expected.shape):
        return {"within_tolerance": False, "shape": list(out.shape)}
    atol, rtol = DEFAULT_TOLERANCES.get(out.dtype, DEFAULT_TOLERANCES[torch.bfloat16])
    got = out.float()
    diff = (got - expected).abs()
    finite = bool(torch.isfinite(got).all())
    within = finite and bool((diff <= atol + rtol * expected.abs()).all())
    rel_l2 = float(diff.norm() / expected.norm().clamp_min(torch.finfo(torch.float32).tiny))
    return {"max_abs_err": float(diff.max()), "rel_l2": rel_l2, "within_tolerance": within}


def _peak_extra_mib(run: Callable[[], object], device: torch.device) -> Optional[float]:
    """MiB that one call allocates beyond what is held before it (None on the CPU, which keeps no count)."""
    if device.type == "cpu":
        return None
    accelerator.synchronize(device)
    accelerator.reset_peak_memory_stats(device)
    base = accelerator.memory_allocated(device)
    run()
    accelerator.synchronize(device)
    return (accelerator.max_memory_allocated(device) - base) / 2**20


def check_column(workload: Workload, column: Column, expected: torch.Tensor, device: torch.device) -> dict:
    """The row of ``column`` on ``workload`` before it is timed: its first call (compile included), its output
    checked against ``expected`` and the memory one call allocates. A column that is refused, fails (a peer) or
    computes a wrong output gets a ``status`` and a ``reason`` and is not timed."""
    row = {"workload": workload.name, "impl": column.label, "note": workload.note,
           "memory_bound": workload.memory_bound, **column.fields}
    if column.refused is not None:
        return {**row, "status": "not run", "reason": column.refused}
    started = time.perf_counter()
    try:
        out = column.run()
        accelerator.synchronize(device)
    except Exception as exc:
        if column.ours:
            raise
        return {**row, "status": "failed", "reason": one_line_reason(exc)}
    row["first_call_s"] = time.perf_counter() - started
    if column.checked:
        row.update(output_error(out, expected))
        if not row["within_tolerance"]:
            return {**row, "status": "wrong output", "reason": _wrong_reason(row)}
    row["peak_extra_mib"] = _peak_extra_mib(column.run, device)
    return row


def time_columns(workload: Workload, checked: list[tuple[dict, Column]], reps: int, rounds: int,
                 time_ms: Callable[[Callable[[], object], int], float]) -> None:
    """Time every checked column of ``workload`` (``(row, column)`` pairs from :func:`check_column`, those with a
    ``status`` left out) in ``rounds`` rounds that alternate their order, so that a change of the GPU's clocks
    during the workload (heat after the reference's float32 pass, a compile's idle seconds) falls on every column
    alike; each row gets the median of its rounds (``ms``, its TFLOP/s and, memory-bound, GB/s) and the rounds."""
    timed = [(row, column) for row, column in checked if "status" not in row]
    # The reference is slow: a few repetitions, as run_suite takes.
    calls = [functools.partial(time_ms, column.run, 10 if column.fields.get("call") == "reference" else reps)
             for _, column in timed]
    rounds_ms = alternating_rounds(calls, rounds, lambda call: call())
    for (row, _), times in zip(timed, rounds_ms):
        ms = statistics.median(times)
        row.update(ms=ms, tflops=flops(workload.spec) / ms / 1e9, rounds_ms=times)
        if workload.memory_bound:
            row["gbps"] = kv_bytes(workload.spec) / ms / 1e6


def _wrong_reason(row: dict) -> str:
    if "shape" in row:
        return f"output of shape {row['shape']}, not the queries' [tokens, heads, head size]"
    return (f"max abs error {row['max_abs_err']:.3g}, relative L2 {row['rel_l2']:.3g} against the float32 "
            f"reference (beyond the conformance tolerance); not timed")


def one_line_reason(exc: BaseException) -> str:
    """An exception as one line for a table's reason: its type and its message's first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def progress_line(row: dict) -> str:
    """The line printed as a column of a workload finishes."""
    label = f"    {row['impl']:<16}"
    if "status" in row:
        return f"{label} {row['status']}: {row['reason']}"
    line = f"{label} {row['ms']:9.3f} ms {row['tflops']:8.1f} TFLOP/s"
    if "gbps" in row:
        line += f" {row['gbps']:8.1f} GB/s"
    if "kernel" in row:
        line += f"  first call {row['first_call_s']:.1f} s, {row['kernel']} kernel"
    if "max_abs_err" in row:
        line += f", max abs error {row['max_abs_err']:.1e}"
    return line


def _runnable(backends: list[str], info, say: Callable[[str], None]) -> list[str]:
    """The backends that can run on the device; each other one is named with its reasons."""
    from ..api import get_registry

    kept = []
    for name in backends:
        reasons = get_registry().get(name).supports(info)
        if reasons:
            say(f"{name}: not run on {info.name}: {'; '.join(reasons)}")
        else:
            kept.append(name)
    return kept


def run_engine_suite(backends: list[str], workloads: list[Workload], device: torch.device, reps: int = 100,
                     with_reference: bool = True, progress: Optional[Callable[[str], None]] = None,
                     layouts=("split", "nhd"), fa4=None,
                     time_ms: Optional[Callable[[Callable[[], object], int], float]] = None,
                     rounds: int = 3) -> list[dict]:
    """Time every workload the engine's way and the classic way for each backend, and its peers; one row per
    (workload, column).

    Each workload is built once in the engine's form (NHD, k = v = None) and its classic twins are read off it
    (:func:`~pagedprefill.workloads.classic_twin`), so that every column computes the same attention; the
    float32 reference of it checks every column's output before the columns are timed, in ``rounds``
    alternating rounds (:func:`time_columns`). ``fa4``: the imported ``flash_attn.cute`` (see :func:`.fa4.load`),
    or None for no FA4 columns. ``time_ms(run, reps)``: the median milliseconds of ``run`` (default:
    ``triton.testing.do_bench``, device events).
    """
    from ..device import DeviceInfo

    info = DeviceInfo.detect(device)
    say = progress or (lambda message: None)
    time_ms = time_ms or _median_ms
    runnable = _runnable(backends, info, say)
    rows = []
    for i, workload in enumerate(workloads):
        say(f"[{i + 1}/{len(workloads)}] {workload.name}")
        check_plain(workload)
        engine = make_problem(workload.spec.replace(layout="nhd", kv_in_cache=True), device)
        expected = reference_output(engine)
        columns = (our_columns(runnable, engine_forms(engine, layouts), info)
                   + peer_columns(engine, fa4, with_reference, info))
        checked = [(check_column(workload, column, expected, device), column) for column in columns]
        time_columns(workload, checked, reps, rounds, time_ms)
        for row, _ in checked:
            rows.append(row)
            say(progress_line(row))
        del engine, expected, columns
        accelerator.empty_cache(device)
    return rows


def host_overhead(device: torch.device, backend: str, layout: str = "split", calls: int = 2000,
                  rounds: int = 7) -> dict:
    """Microseconds per call on a tiny batch, host-bound: the two drop-in signatures (the classic one, and the
    serving engine's, whose kernels derive the context lengths), and a bare launch of core's kernel.

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


def format_table(rows: list[dict], field: str = "tflops", fmt: str = "{:.1f}", show_status: bool = False) -> str:
    """A Markdown table: one line per workload, one column per implementation that has ``field``. With
    ``show_status``, a row that was not timed (a ``status``: not run, failed, wrong output) shows its status
    in its cell, and its implementation has a column even if no row of it has ``field``."""
    shown = [r for r in rows if field in r or (show_status and "status" in r)]
    impls = list(dict.fromkeys(r["impl"] for r in shown))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["workload"], r["impl"]): r for r in rows}

    def text(row: dict) -> str:
        if field in row:
            return fmt.format(row[field])
        return row["status"] if show_status and "status" in row else "-"

    head = "| workload | " + " | ".join(impls) + " |"
    lines = [head, "| --- |" + " ---: |" * len(impls)]
    for w in workloads:
        vals = [text(cell.get((w, i), {})) for i in impls]
        lines.append(f"| {w} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def format_ratios(rows: list[dict], over: str = "fa4") -> Optional[str]:
    """A Markdown table of each engine column's TFLOP/s over ``over``'s, per workload (None when ``over``
    timed no row)."""
    peer = {r["workload"]: r["tflops"] for r in rows if r["impl"] == over and "tflops" in r}
    if not peer:
        return None
    ratios = [{**r, "ratio": r["tflops"] / peer[r["workload"]], "impl": f"{r['impl']} / {over}"}
              for r in rows if r.get("call") == "engine" and "tflops" in r and r["workload"] in peer]
    return format_table(ratios, "ratio", "{:.2f}")


def format_suite(workloads: list[Workload]) -> str:
    """The workloads of a suite as a Markdown table, from their specs alone (nothing is allocated)."""
    lines = ["| workload | sequences | new tokens | context | heads | head size | block | dtype | TFLOP | K/V MB "
             "| memory-bound (GB/s too) |", "| --- |" + " ---: |" * 6 + " --- |" + " ---: |" * 2 + " --- |"]
    for w in workloads:
        s = w.spec
        low, high = min(s.context_lens), max(s.context_lens)
        ctx = f"{low}..{high}" if low != high else f"{low}"
        dtype = str(s.dtype).removeprefix("torch.") + ("" if s.kv_cache_dtype == "auto" else f", {s.kv_cache_dtype}")
        lines.append(f"| {w.name} | {len(s.query_lens)} | {sum(s.query_lens)} | {ctx} | {s.num_heads}/{s.num_kv_heads} "
                     f"| {s.head_size} | {s.block_size} | {dtype} | {flops(s) / 1e12:.3f} | {kv_bytes(s) / 1e6:.0f} "
                     f"| {'yes' if w.memory_bound else ''} |")
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


def chart_panels(rows: list[dict]) -> list[dict]:
    """The chart's panels: TFLOP/s of the compute-bound workloads, then (when the suite has memory-bound ones)
    GB/s of those. Each panel: ``ylabel``, ``workloads``, ``impls`` and ``values`` (impl -> one value per
    workload, 0 where the row was not timed). The reference is left out (it would flatten the bars)."""
    timed = [r for r in rows if r["impl"] != "reference"]
    panels = []
    for ylabel, key, memory_bound in (("TFLOP/s", "tflops", False), ("GB/s of K/V read", "gbps", True)):
        part = [r for r in timed if bool(r.get("memory_bound")) == memory_bound]
        workloads = list(dict.fromkeys(r["workload"] for r in part))
        impls = list(dict.fromkeys(r["impl"] for r in part if key in r))
        if not workloads or not impls:
            continue
        cell = {(r["workload"], r["impl"]): r[key] for r in part if key in r}
        values = {i: [cell.get((w, i), 0.0) for w in workloads] for i in impls}
        panels.append({"ylabel": ylabel, "workloads": workloads, "impls": impls, "values": values})
    return panels


def plot(rows: list[dict], path: str, title: str) -> Optional[str]:
    """A grouped bar chart per :func:`chart_panels` panel (None if matplotlib is missing or nothing was
    timed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = chart_panels(rows)
    if not panels:
        return None
    widest = max(len(p["workloads"]) for p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.3 * widest), 4.5 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        workloads, impls = panel["workloads"], panel["impls"]
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            ax.bar([i + j * width for i in range(len(workloads))], panel["values"][impl], width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
        ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(panel["ylabel"])
        ax.legend(fontsize=8)
    axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def selected_suite(args) -> list[Workload]:
    """The workloads of ``--suite``, narrowed by ``--only``; an ``--only`` that matches none is an error."""
    suite = SUITES[args.suite]()
    if args.only:
        suite = [w for w in suite if any(s.lower() in w.name.lower() for s in args.only)]
        if not suite:
            raise ValueError(f"argument --only: no workload of the {args.suite} suite has a name containing "
                             f"{' or '.join(map(repr, args.only))} ('pagedprefill bench --suite {args.suite} --list' "
                             f"shows them)")
    return suite


def print_tables(rows: list[dict], engine: bool) -> None:
    """The run's tables on standard output: TFLOP/s; for the engine suite also GB/s of the memory-bound rows,
    the engine's call over FA4, each column's error against the reference and what was not timed and why;
    then the kernels and first calls."""
    print("\nTFLOP/s (median):\n")
    print(format_table(rows, show_status=engine))
    if engine:
        memory = [r for r in rows if r.get("memory_bound")]
        if memory:
            print("\nGB/s of the K/V bytes each call must read (memory-bound rows, median):\n")
            print(format_table(memory, "gbps", "{:.0f}", show_status=True))
        ratios = format_ratios(rows)
        if ratios:
            print("\nThe engine's call over FA4 on the paged cache (TFLOP/s ratio; above 1 is faster):\n")
            print(ratios)
        print("\nLargest absolute error against the float32 reference (every column checked before it is "
              "timed):\n")
        print(format_table(rows, "max_abs_err", "{:.1e}", show_status=True))
        untimed = [r for r in rows if "status" in r]
        if untimed:
            print("\nNot timed:\n")
            print("\n".join(f"- {r['workload']}, {r['impl']}: {r['status']}: {r['reason']}" for r in untimed))
    print("\nKernel that ran each of our rows:\n")
    print(format_table(rows, "kernel", "{}"))
    print("\nFirst call per workload (s, includes compiling unless cached):\n")
    print(format_table(rows, "first_call_s", "{:.1f}"))


#: Suites timed the engine's way and the classic way, with FA4 beside them (:func:`run_engine_suite`).
ENGINE_FORM_SUITES = ("engine", "models")


def cmd_bench(args) -> int:
    from ..api import select_backend
    from ..device import DeviceInfo, current_accelerator_type

    suite = selected_suite(args)
    if args.list:  # the specs alone: nothing is allocated, no device needed
        print(format_suite(suite))
        return 0
    accel = current_accelerator_type()
    if accel is None:
        raise DeviceUnavailableError(
            f"needs a GPU (or another accelerator torch {torch.__version__} can use): its timings are the device's "
            f"events, and none is visible; 'pagedprefill bench --suite {args.suite} --list' shows the workloads "
            f"without one, and 'pagedprefill info' what this machine has")
    device = torch.device(args.device or accel)
    info = DeviceInfo.detect(device)
    backends = args.backend or [select_backend(info).name]
    start = time.time()
    layouts = ("split", "nhd") if args.layout == "both" else (args.layout,)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    engine = args.suite in ENGINE_FORM_SUITES
    peers = {}
    if engine:
        module, peers["fa4"] = fa4_peer.load()
        say(peers["fa4"])
        rows = run_engine_suite(backends, suite, device, reps=args.reps, with_reference=not args.no_reference,
                                progress=say, layouts=layouts, fa4=module, rounds=args.rounds)
    else:
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
    if peers:
        meta["peers"] = peers
    print(f"\n{meta['device']}, torch {meta['torch']}, {meta['date']}, commit {args.commit or '?'}")
    for line in peers.values():
        print(line)
    print_tables(rows, engine)
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
