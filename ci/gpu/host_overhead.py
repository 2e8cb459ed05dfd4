"""Host overhead per call on a tiny batch (GPU): 2000 launches without synchronisation, CPU-bound.

Compares the public drop-in (``context_attention_fwd``, default validation), the library's launcher alone,
and a bare Triton launch of the same kernel with its arguments prepared once (what a hand-written launch
of a seed-style kernel costs); then the drop-ins on the same batch with a 256-page block table, whose keys
the policy splits (on sm90 one launch of the Hopper kernel, which merges its splits itself; elsewhere the
portable kernel and the combine after it). Prints microseconds per call.

Usage: python ci/gpu/host_overhead.py [nhd|split]   (the cache layout; split by default)
"""

import argparse
import os
import statistics
import time

import pagedprefill as pp
import torch
from pagedprefill.api import select_backend
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.device import DeviceInfo
from pagedprefill.plans import call_signature, forget, remember
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.triton.kernel import prefix_prefill_kernel
from pagedprefill.triton.launch import bind_launch, call_tensors, kernel_call, launch_prefill
from pagedprefill.validation import DROP_IN_NAMES
from pagedprefill.vllm import context_attention_fwd as vllm_context_attention_fwd


def per_call_us(fns: dict, calls: int = 2000, rounds: int = 7) -> dict:
    """Median microseconds per call of each of ``fns``, timed in ``rounds`` rounds that alternate between them
    (a shared host's speed moves from one measurement to the next), with the fastest and slowest round."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples = {name: [] for name in fns}
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - t0) / per_round * 1e6)
    return {name: (statistics.median(v), min(v), max(v)) for name, v in samples.items()}


def hopper_rows(p, backend, info, drop_in) -> dict:
    """sm80's Hopper kernel (sm90): its launch plan with the TMA descriptors encoded once per address, against
    the same plan with Triton's launcher encoding them on every launch, on the same tensors and with the new
    tokens' keys and values moving every call (as a serving engine's activations may), and the drop-in."""
    import dataclasses

    from pagedprefill_sm80.hopper.encoded import EncodedLauncher
    from pagedprefill_sm80.hopper.launch import bind_hopper
    from pagedprefill_sm80.policy import KERNEL_ENV

    os.environ[KERNEL_ENV] = "hopper"
    forget()
    shape = problem_shape(p)
    config = backend.tile_config(shape, info)
    encoded = bind_hopper(p, config, shape)
    encoded_of = EncodedLauncher.of
    EncodedLauncher.of = classmethod(lambda cls, compiled, positions: None)
    try:
        triton_encoding = bind_hopper(p, config, shape)
    finally:
        EncodedLauncher.of = encoded_of
    moved = dataclasses.replace(p, k=p.k.clone(), v=p.v.clone())

    def alternating(plan):
        turn = [p, moved]

        def call():
            turn.reverse()
            plan(turn[0])
        return call

    rows = per_call_us({
        "Hopper plan": lambda: encoded(p),
        "Hopper plan, Triton's encoding": lambda: triton_encoding(p),
        "Hopper plan, k/v moving": alternating(encoded),
        "Hopper plan, k/v moving, Triton's": alternating(triton_encoding),
        "context_attention_fwd, Hopper": drop_in,
    })
    del os.environ[KERNEL_ENV]
    forget()
    return rows


def split_rows(spec, backend, info) -> dict:
    """The same tiny batch with a block table as wide as a serving engine's (256 pages: 4096 keys per
    sequence), on which the policy splits the keys, and what of it goes to allocating the partial rows and, on
    sm90, to finding the Hopper kernel's kept arrival counters."""
    from pagedprefill.triton.launch import partial_rows
    from pagedprefill_sm80.hopper.launch import arrival_counters

    wide = make_problem(spec.replace(extra_columns=256 - 1), "cuda")
    shape = problem_shape(wide)
    splits = backend.tile_config(shape, info).key_splits
    c, b = wide.cache, wide.batch

    def drop_in():
        pp.context_attention_fwd(wide.q, wide.k, wide.v, wide.out, "auto", c.key, c.value, b.block_table,
                                 b.query_start, b.seq_lens, b.context_lens, 4)

    def vllm_drop_in():
        vllm_context_attention_fwd(wide.q, wide.k, wide.v, wide.out, "auto", c.key, c.value, b.block_table,
                                   b.query_start, b.seq_lens, None, 4, 1.0, 1.0)

    forget()
    rows = per_call_us({
        f"context_attention_fwd, 256 pages, {splits} splits": drop_in,
        f"vllm.context_attention_fwd, 256 pages, {splits} splits": vllm_drop_in,
        f"partial rows' allocation, {splits} splits": lambda: partial_rows(wide.q, max(2, splits)),
        **({"arrival counters (kept per stream)": lambda: arrival_counters(wide.q.device, 1024)}
           if info.capability[0] == 9 else {}),
    })
    forget()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", nargs="?", choices=("nhd", "split"), default="split", help="the cache layout")
    args = parser.parse_args(argv)
    spec = BatchSpec(query_lens=(4, 3), context_lens=(16, 9), num_heads=32, num_kv_heads=8, head_size=128,
                     block_size=16, dtype=torch.bfloat16, layout=args.layout)
    p = make_problem(spec, "cuda")
    info = DeviceInfo.detect(p.device)
    backend = select_backend(info)
    cfg = backend.portable_tile(problem_shape(p), info)  # core's kernel, launched bare below
    call = kernel_call(p, cfg)
    bound = bind_launch(p, cfg)
    plans = {}

    def signature(pr):  # what the dispatch keys its plans on
        return call_signature(pr, backend, None)

    plans[signature(p)] = bound

    def planned():
        plans[signature(p)](call_tensors(p))
    c, b = p.cache, p.batch
    drop_in = lambda: pp.context_attention_fwd(p.q, p.k, p.v, p.out, "auto", c.key, c.value, b.block_table,  # noqa: E731
                                               b.query_start, b.seq_lens, b.context_lens, 4)
    # The serving engine's signature: the kernels derive the context lengths from b_start_loc's B + 1 entries.
    vllm_drop_in = lambda: vllm_context_attention_fwd(  # noqa: E731
        p.q, p.k, p.v, p.out, "auto", c.key, c.value, b.block_table, b.query_start, b.seq_lens, None, 4, 1.0, 1.0)
    fns = {
        "context_attention_fwd": drop_in,
        "vllm.context_attention_fwd": vllm_drop_in,
        f"{backend.name} backend.run": lambda: backend.run(p, info),
        "launch_prefill": lambda: launch_prefill(p, cfg),
        "bare Triton launch": lambda: prefix_prefill_kernel[call.grid](*call.args, **call.kwargs),
        "BoundLaunch": lambda: bound(call_tensors(p)),
        "signature+lookup+BoundLaunch": planned,
    }
    rows = per_call_us(fns)
    # The drop-in's own work: the same call with the launch plan replaced by one that launches nothing.
    drop_in()
    remember(call_signature(p, None, DROP_IN_NAMES), lambda problem: True)
    rows.update(per_call_us({"context_attention_fwd, no launch": drop_in}))
    forget()
    if info.capability[0] == 9:
        rows.update(hopper_rows(p, backend, info, drop_in))
    rows.update(split_rows(spec, backend, info))
    for name, (us, low, high) in rows.items():
        print(f"host overhead {spec.layout:<5} {name:<52} {us:7.1f} us/call (rounds {low:.1f}-{high:.1f})")


if __name__ == "__main__":
    main()
