"""Memory safety with unvalidated metadata: the check behind the guarantee of ``validate="basic"``.

Whatever the metadata (block numbers far past the cache or negative, decreasing or negative starts, lengths
past the block table, ``seq_len < ctx_len``, ``INT32_MAX`` lengths), a backend reads only inside ``q``, ``k``,
``v``, the caches, the metadata, ``alibi_slopes``/``sinks`` and writes only inside ``out``. Rows whose metadata
is invalid may hold any value.

:func:`check_corrupt_metadata` proves it for one backend on one device: every tensor the kernel gets is a view
into the middle of a larger buffer whose guard regions hold NaN (floating point) or a sentinel (integers).
After each corrupt variant, run with ``validate="basic"``:

* every input buffer, guards included, is bit-identical to before (nothing was written);
* ``out``'s guards are untouched (nothing was written outside it);
* every element of ``out`` is finite: the output started as a finite sentinel and every input element is
  finite N(0, 1) data, so a NaN in ``out`` means a guard was read;
* in Triton's CPU interpreter, no NaN entered any arithmetic (numpy's "invalid value" warning): a guard read
  for a row that is then not written leaves ``out`` finite, and shows only there;
* ``validate="full"`` rejects the variant with a ``ValueError``.

A backend that reads the metadata on the host anyway (``reads_metadata_on_host``: the reference) gets the
``"full"`` value checks from dispatch with ``"basic"`` too: there each variant must raise that ``ValueError``.

Afterwards the device still works: a valid call on the same backend matches the reference (on a GPU a fault
would have poisoned the CUDA context, and this call would raise).

The conformance suite runs it for every backend (:class:`~pagedprefill.testing.ConformanceSuite`, so in the
interpreter on the CPU and on GPUs), and ``packages/core/tests/gpu`` runs it for every Triton backend the GPU
offers. Lengths still cost time: the kernel walks every key a corrupt length claims, so the variants keep the
lengths that set loop trip counts bounded, except ``INT32_MAX`` sequence lengths with causal attention, where
each row stops at its own position.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch

from ..device import DeviceInfo
from ..features import check_runnable
from ..registry import Backend
from ..types import BatchMetadata, PrefillProblem
from ..validation import validate_problem
from ..workloads import BatchSpec, make_problem
from .cases import DEFAULT_TOLERANCES, assert_matches_reference

#: Elements of guard before and after every tensor.
GUARD = 512
#: Guard value of integer buffers (a valid-looking but wrong int32 block number / length would not show).
INT_SENTINEL = 0x3C3C3C3C
#: Finite value ``out`` starts with; a NaN in ``out`` afterwards was read from a guard.
OUT_SENTINEL = 2.0

#: Batches of the check: ``(name, spec)``. Three sequences (one without context, one long); block sizes
#: that divide the key tile (page-wise addressing), that do not (a table read per key) and that hold several
#: key tiles; a window; and the optional features, spread over the geometries so each runs once.
SMALL = BatchSpec(query_lens=(5, 9, 3), context_lens=(7, 0, 20), num_heads=4, num_kv_heads=2, head_size=16,
                  block_size=4, dtype=torch.float16, spare_blocks=3, seed=5)
SPECS: dict[str, BatchSpec] = {
    "nhd_bs4": SMALL,
    "split_bs5_window": SMALL.replace(layout="split", block_size=5, sliding_window=3, alibi=True, sinks=True),
    "nhd_bs128_out_scale_skip_decode": SMALL.replace(block_size=128, query_lens=(5, 1, 3), fp8_out_scale=0.05,
                                                   skip_decode=True),
    "split_x1_kv_in_cache_non_causal": SMALL.replace(layout="split", x=1, kv_in_cache=True, causal=False),
    "nhd_bs4_context_from_starts": SMALL.replace(context_from_starts=True),
}
#: A GPU-sized batch: head size 128, block size 16, contexts spanning many key tiles, GQA 4.
LARGE = BatchSpec(query_lens=(70, 1, 200), context_lens=(300, 0, 1000), num_heads=8, num_kv_heads=2,
                  head_size=128, block_size=16, dtype=torch.float16, spare_blocks=5, seed=6, sliding_window=500)


def corrupt_variants(p: PrefillProblem) -> dict[str, dict]:
    """Name -> the :class:`BatchMetadata` fields to replace: corrupt metadata of every kind.

    Loop lengths stay bounded (the kernel walks every key a length claims), but for ``seq_len_huge`` which
    only a causal problem with its context lengths given gets (each row then stops at its own position).
    """
    b = p.batch
    device = b.seq_lens.device
    B = b.num_seqs
    T = p.num_tokens
    g = torch.Generator().manual_seed(99)
    i32 = torch.iinfo(torch.int32)
    width, bs, nb = b.block_table.shape[1], p.cache.block_size, p.cache.num_blocks
    table = b.block_table.to("cpu", torch.int64)
    seq = b.seq_lens.to("cpu", torch.int64)
    ctx = b.context_lengths().to("cpu", torch.int64)
    start = b.query_start.to("cpu", torch.int64)
    q_lens = seq - ctx
    wild = torch.randint(i32.min, i32.max, tuple(table.shape), generator=g, dtype=torch.int64)
    wild[0, 0], wild[-1, -1] = i32.max, i32.min
    steps = torch.arange(1, B + 1)

    def t(values, like=b.seq_lens):
        return torch.as_tensor(values, dtype=torch.int64).clamp(i32.min, i32.max).to(device=device, dtype=like.dtype)

    past_table = width * bs + 37 * steps
    variants = {
        "pages_far_past_cache": dict(block_table=t(table + nb + 1_000_000, b.block_table)),
        "pages_just_past_cache": dict(block_table=t(table * 0 + nb, b.block_table)),
        "pages_negative": dict(block_table=t(-table - 1, b.block_table)),
        "pages_int32_extremes": dict(block_table=t(wild, b.block_table)),
        "context_past_table": dict(context_lens=t(past_table), seq_lens=t(past_table + q_lens)),
        "context_negative": dict(context_lens=t(-5 * steps), seq_lens=t(-5 * steps + q_lens)),
        "seq_below_context": dict(seq_lens=t(ctx - 3 * steps)),
        "queries_past_tokens": dict(seq_lens=t(seq + T + 40)),
        "starts_negative": dict(query_start=t(start - 7 * (B + 1), b.query_start)),
        "starts_decreasing": dict(query_start=t(start.flip(0), b.query_start)),
        "starts_past_tokens": dict(query_start=t(start + T + 100, b.query_start)),
        "starts_int32_extremes": dict(query_start=t([i32.max - 5, i32.min] * (start.numel() // 2 + 1),
                                                    b.query_start)[:start.numel()]),
        "everything": dict(block_table=t(wild, b.block_table), context_lens=t(past_table),
                           seq_lens=t(past_table + 5 * steps), query_start=t(start.flip(0) - 2, b.query_start)),
    }
    # Where the context lengths are derived from seq_lens, a huge seq_len is a huge context, every key of which the
    # kernel walks: the other variants corrupt them within bounds.
    if p.options.causal and b.context_lens is not None:
        variants["seq_len_huge"] = dict(seq_lens=t([i32.max] * B))
    return variants


def _guarded(t: Optional[torch.Tensor]):
    """``t`` copied into the middle of a guard-filled buffer: ``(view, buffer)`` (None, None for None)."""
    if t is None:
        return None, None
    fill = float("nan") if t.is_floating_point() else INT_SENTINEL
    buf = torch.full((2 * GUARD + t.numel(),), fill, dtype=t.dtype, device=t.device)
    view = buf[GUARD:GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two 1-D contiguous buffers (NaN guards included)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an illegal access surfaces here (and poisons the context)


def check_corrupt_metadata(backend: Backend, info: DeviceInfo, device: torch.device, spec: BatchSpec,
                           label: str = "") -> list[str]:
    """Run every :func:`corrupt_variants` of ``spec``'s batch on ``backend`` with ``validate="basic"`` and
    check the guarantee (see the module docstring); then a valid call. Returns the variants checked.

    Raises AssertionError naming the variant and the buffer at the first violation.
    """
    label = label or f"{backend.name}/{spec.describe()}"
    p = make_problem(spec, device)
    bufs: dict[str, torch.Tensor] = {}

    def guard(name, tensor):
        view, buf = _guarded(tensor)
        if buf is not None:
            bufs[name] = buf
        return view

    q, k, v = guard("q", p.q), guard("k", p.k), guard("v", p.v)
    key, value = guard("k_cache", p.cache.key), guard("v_cache", p.cache.value)
    cache = dataclasses.replace(p.cache, key=key, value=value)
    if isinstance(cache.k_scale, torch.Tensor):
        cache = dataclasses.replace(cache, k_scale=guard("k_scale", cache.k_scale),
                                    v_scale=guard("v_scale", cache.v_scale))
    o = p.options
    options = dataclasses.replace(o, alibi_slopes=guard("alibi_slopes", o.alibi_slopes),
                                  sinks=guard("sinks", o.sinks))
    out_view, out_buf = _guarded(torch.full(p.out.shape, OUT_SENTINEL, dtype=p.out.dtype, device=device))
    checked = []
    for name, change in corrupt_variants(p).items():
        if p.batch.context_lens is None:  # no context lengths to corrupt: the corrupt seq_lens and starts imply them
            change = {field: t for field, t in change.items() if field != "context_lens"}
        meta = {field: guard(f"{name}.{field}", getattr(p.batch, field) if field not in change else change[field])
                for field in ("query_start", "seq_lens", "context_lens", "block_table")}
        batch = BatchMetadata(meta["query_start"], meta["seq_lens"], meta["context_lens"], meta["block_table"],
                              p.batch.max_query_len)
        problem = dataclasses.replace(p, q=q, k=k, v=v, cache=cache, options=options, batch=batch, out=out_view)
        out_view.fill_(OUT_SENTINEL)
        snapshot = {n: buf.clone() for n, buf in bufs.items()}
        out_guards = out_buf.clone()
        validate_problem(problem, "basic")  # what the default lets through
        if backend.reads_metadata_on_host:
            # Such a backend (the reference) gets the full value checks from dispatch even with "basic":
            # the call raises, naming an argument, and runs nothing.
            from ..api import dispatch

            try:
                dispatch(problem, backend=backend, validate="basic")
            except ValueError as exc:
                assert "validate='full'" in str(exc), f"{label}: {name}: {exc}"
            else:
                raise AssertionError(f"{label}: {name}: backend {backend.name!r} computed corrupt metadata")
        else:
            check_runnable(backend, problem, info)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                backend.run(problem, info)
            nan_math = [str(w.message) for w in caught if "invalid value" in str(w.message)]
            assert not nan_math, f"{label}: {name}: NaN entered the kernel's arithmetic ({nan_math[0]}): a guard " \
                                 f"outside an input was read for rows that were not written"
        _synchronize(device)
        for buf_name, buf in bufs.items():
            assert _same_bits(buf, snapshot[buf_name]), f"{label}: {name}: {buf_name} (or its guard) was written"
        assert _same_bits(out_buf[:GUARD], out_guards[:GUARD]) and _same_bits(out_buf[-GUARD:], out_guards[-GUARD:]), \
            f"{label}: {name}: written outside out"
        bad = int((~torch.isfinite(out_view.float())).sum())
        assert bad == 0, f"{label}: {name}: {bad} elements of out are not finite: a guard outside an input was read"
        try:
            validate_problem(problem, "full")
        except ValueError:
            pass
        else:
            raise AssertionError(f"{label}: {name}: validate='full' accepted corrupt metadata")
        checked.append(name)
    # The device still works: a valid call on the same backend gives the right result.
    valid = make_problem(spec, device)
    check_runnable(backend, valid, info)
    backend.run(valid, info)
    _synchronize(device)
    atol, rtol = DEFAULT_TOLERANCES[spec.dtype]
    assert_matches_reference(valid.out, valid, atol, rtol, label=f"{label}: valid call after the corrupt ones")
    return checked
