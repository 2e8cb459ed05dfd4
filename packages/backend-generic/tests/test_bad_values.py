"""Bad values that validation lets through, on the generic backend (Triton's interpreter on the CPU) and on the
reference:

* NaN/Inf in the inputs propagate to the output rows whose softmax includes them, and nowhere else; no crash;
* an empty batch (no sequences, or no new tokens) launches nothing and leaves the output untouched;
* garbage metadata with ``validate="basic"`` gives wrong numbers but no out-of-bounds access (the general check
  runs in every backend's conformance suite; here: metadata with zero extents);
* strided (non-contiguous) tensors are computed correctly, except the known gaps marked ``xfail`` below.

Data is N(0, 1). Rows are (token, query head) pairs; heads ``2g`` and ``2g + 1`` share KV head ``g``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pagedprefill as pp
import pytest
import torch
from pagedprefill.testing import BatchSpec, assert_matches_reference, fresh_output, make_problem, with_output
from pagedprefill.triton import launch as triton_launch

# B = 3 sequences, T = 17 new tokens (starts 0, 5, 14), H = 4, Hkv = 2, D = 16, block_size 4.
BASE = BatchSpec(query_lens=(5, 9, 3), context_lens=(7, 0, 20), num_heads=4, num_kv_heads=2, head_size=16,
                 block_size=4, dtype=torch.float32, spare_blocks=3, seed=5)
STARTS = (0, 5, 14)
T, H, D = 17, 4, 16
BACKENDS = ("generic", "reference")


def run(problem: pp.PrefillProblem, backend: str, validate: str = "basic") -> torch.Tensor:
    return pp.dispatch(fresh_output(problem), backend=backend, validate=validate).clone()


@pytest.fixture
def device(pagedprefill_device):
    """The device of the run (``--pagedprefill-device``; the CPU in the nox ``tests`` session)."""
    return pagedprefill_device


def usable(backend: str, device: torch.device) -> None:
    reasons = pp.get_registry().get(backend).supports(pp.DeviceInfo.detect(device))
    if reasons:
        pytest.skip(f"backend {backend!r} cannot run on {device}: {'; '.join(reasons)}")


def cache_index(cache: pp.PagedKVCache, which: str, block: int, slot: int, head: int):
    """Index of all D elements of one cached token's key or value (either layout)."""
    if cache.layout is pp.KVLayout.NHD:
        return (block, slot, head)
    if which == "key":  # [blocks, Hkv, D // x, block_size, x]
        return (block, head, slice(None), slot, slice(None))
    return (block, head, slice(None), slot)  # value: [blocks, Hkv, D, block_size]


def position_of(problem: pp.PrefillProblem, seq: int, pos: int) -> tuple[int, int]:
    bs = problem.cache.block_size
    return int(problem.batch.block_table[seq, pos // bs]), pos % bs


def rows(tokens, heads) -> torch.Tensor:
    mask = torch.zeros(T, H, dtype=torch.bool)
    for t in tokens:
        mask[t, list(heads)] = True
    return mask


# name -> (poison(problem), rows that must be all NaN, rows that may be all NaN or unchanged, unused). Every
# backend, the reference included, propagates NaN to exactly the rows whose softmax sees it.
def _poison_q_nan(p):
    p.q[STARTS[1] + 4, 3, 5] = float("nan")


def _poison_q_inf(p):
    p.q[2, 0, 0] = float("inf")


def _poison_k_nan(p):
    p.k[STARTS[1] + 3, 1, 0] = float("nan")


def _poison_v_nan(p):
    p.v[STARTS[1] + 3, 0, :] = float("nan")


def _poison_cache(which, seq, pos, head):
    def apply(p):
        block, slot = position_of(p, seq, pos)
        tensor = p.cache.key if which == "key" else p.cache.value
        tensor[cache_index(p.cache, which, block, slot, head)] = float("nan")
    return apply


def _poison_unused_blocks(p):
    """Every block no sequence uses, and every slot past each sequence's context in its last block."""
    bs = p.cache.block_size
    used = set()
    for seq, ctx in enumerate(p.batch.context_lens.tolist()):
        num_used = (ctx + bs - 1) // bs
        used.update(int(b) for b in p.batch.block_table[seq, :num_used])
        if ctx % bs:
            block = int(p.batch.block_table[seq, ctx // bs])
            for slot in range(ctx % bs, bs):
                for head in range(p.num_kv_heads):
                    for which in ("key", "value"):
                        tensor = p.cache.key if which == "key" else p.cache.value
                        tensor[cache_index(p.cache, which, block, slot, head)] = float("nan")
    unused = [b for b in range(p.cache.num_blocks) if b not in used]
    assert unused, "the base batch has spare blocks"
    p.cache.key[unused] = float("nan")
    p.cache.value[unused] = float("nan")


NONE = torch.zeros(T, H, dtype=torch.bool)
POISONS = {
    # one query element: only its own row
    "q_nan": (_poison_q_nan, rows([STARTS[1] + 4], [3]), NONE, "nan"),
    "q_inf": (_poison_q_inf, rows([2], [0]), NONE, "nan"),
    # one key element of new token 3 of sequence 1, KV head 1: the rows that see that key (causal)
    "k_nan": (_poison_k_nan, rows(range(STARTS[1] + 3, STARTS[2]), [2, 3]), NONE, "nan"),
    # the value of that token, KV head 0: the rows that see it; earlier rows of the sequence may get it too
    # (a masked key still multiplies its value by a zero probability, and 0 * NaN is NaN)
    "v_nan": (_poison_v_nan, rows(range(STARTS[1] + 3, STARTS[2]), [0, 1]),
              rows(range(STARTS[1], STARTS[1] + 3), [0, 1]), "nan"),
    # cached position 5 of sequence 2 (every new token sees the whole prefix)
    "k_cache_nan": (_poison_cache("key", 2, 5, 0), rows(range(STARTS[2], T), [0, 1]), NONE, "nan"),
    "v_cache_nan": (_poison_cache("value", 2, 13, 1), rows(range(STARTS[2], T), [2, 3]), NONE, "nan"),
    # cache memory no sequence may read: nothing changes
    "unused_cache_nan": (_poison_unused_blocks, NONE, NONE, "nan"),
}


#: (layout, block size): block size 4 divides the kernel's key tile (keys addressed page by page), 5 does not
#: (one block-table read per key), 128 holds several key tiles per page.
GEOMETRIES = [("nhd", 4), ("split", 5), ("nhd", 128)]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the NaN itself
@pytest.mark.parametrize("layout, block_size", GEOMETRIES[:2], ids=lambda x: str(x))
@pytest.mark.parametrize("name", sorted(POISONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_reach_exactly_the_rows_that_see_them(backend, name, layout, block_size, device):
    usable(backend, device)
    poison, must, may, _ = POISONS[name]
    problem = make_problem(BASE.replace(layout=layout, block_size=block_size), device)
    clean = run(problem, backend, "full")
    assert torch.isfinite(clean).all()
    poison(problem)
    out = run(problem, backend, "full")  # validation does not read data values: the call goes through
    nan_rows = torch.isnan(out).all(dim=-1).cpu()
    same_rows = (out == clean).all(dim=-1).cpu()
    assert nan_rows[must].all(), f"rows that see the bad value are not all NaN: {(must & ~nan_rows).nonzero()}"
    assert (nan_rows | same_rows)[may].all(), "rows of the same tile are either NaN or unchanged"
    others = ~(must | may)
    assert same_rows[others].all(), f"rows that cannot see the bad value changed: {(others & ~same_rows).nonzero()}"
    print(f"{backend}/{name}/{layout}/bs={block_size}: {int(nan_rows.sum())} rows of {T * H} affected")


# -- empty batches --------------------------------------------------------------------------------------------

class LaunchRecorder:
    """Stands in for the Triton kernel and records every launch (a launch with no kernel behind it)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(grid)
        return launch


def empty_problem(query_lens, context_lens, num_tokens, device):
    """A problem with ``num_tokens`` rows of q/k/v (trailing rows belong to no sequence)."""
    p = make_problem(BASE.replace(query_lens=query_lens, context_lens=context_lens), device)
    g = torch.Generator().manual_seed(11)

    def rows_of(n):
        return torch.randn(num_tokens, n, D, generator=g).to(device=device, dtype=p.q.dtype)

    sentinel = torch.full((num_tokens, H, D), 7.25, dtype=p.q.dtype, device=device)
    return dataclasses.replace(p, q=rows_of(H), k=rows_of(2), v=rows_of(2), out=sentinel)


@pytest.mark.parametrize("validate", ["basic", "full"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_lens, context_lens, num_tokens", [
    ((), (), 0),            # no sequences, no tokens
    ((), (), 6),            # no sequences; q/k/v have rows (padding)
    ((0, 0), (9, 0), 0),    # sequences without new tokens, no tokens
], ids=["no_seqs_no_tokens", "no_seqs_padding", "no_new_tokens"])
def test_empty_batches_launch_nothing_and_leave_out_untouched(query_lens, context_lens, num_tokens, backend,
                                                              validate, device, monkeypatch):
    usable(backend, device)
    problem = empty_problem(query_lens, context_lens, num_tokens, device)
    recorder = LaunchRecorder()
    monkeypatch.setattr(triton_launch, "prefix_prefill_kernel", recorder)
    before = problem.out.clone()
    for api in ("native", "drop_in"):
        out = problem.out
        if api == "native":
            result = pp.prefill_attention(problem.q, problem.k, problem.v, problem.cache, problem.batch, out=out,
                                          backend=backend, validate=validate)
        else:
            b, c = problem.batch, problem.cache
            result = pp.context_attention_fwd(problem.q, problem.k, problem.v, out, "auto", c.key, c.value,
                                              b.block_table, b.query_start, b.seq_lens, b.context_lens, None,
                                              backend=backend, validate=validate)
        assert result is out
        assert torch.equal(out, before), "an empty batch wrote its output"
    assert recorder.launches == []
    if backend != "reference":  # the recorder does see a launch: a batch with tokens makes one
        full = make_problem(BASE, device)
        pp.prefill_attention(full.q, full.k, full.v, full.cache, full.batch, out=full.out, backend=backend,
                             validate=validate)
        assert len(recorder.launches) == 1
    print(f"{backend}: B={len(query_lens)} T={num_tokens}: nothing launched, output untouched")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_without_new_tokens_write_nothing(backend, device):
    """Sequences that bring no new token, with padding rows in q: the kernel launches (the grid comes from
    shapes) but every program exits; the output is untouched."""
    usable(backend, device)
    problem = empty_problem((0, 0, 0), (9, 0, 4), 5, device)
    before = problem.out.clone()
    for validate in ("basic", "full"):
        result = pp.prefill_attention(problem.q, problem.k, problem.v, problem.cache, problem.batch,
                                      out=problem.out, backend=backend, validate=validate)
        assert result is problem.out and torch.equal(result, before)


# -- corrupt metadata with validate="basic": wrong numbers, no out-of-bounds access ---------------------------
# The check itself (guard regions around every tensor, a valid call afterwards) is in the conformance suite,
# ``test_corrupt_metadata_stays_in_bounds``, so every backend runs it: pagedprefill.testing.memory_safety.

# Metadata with a zero extent: a table without columns or a cache without blocks means no cached phase at all.
# Run in a subprocess, so that a regression (a null-pointer read) cannot take the test process down.
ZERO_EXTENT = textwrap.dedent("""
    import dataclasses, torch
    import pagedprefill as pp
    from pagedprefill.testing import BatchSpec, make_problem
    p = make_problem(BatchSpec(query_lens=(3,), context_lens=(5,), num_heads=2, num_kv_heads=1, head_size=16,
                               block_size=4, dtype=torch.float32))
    if "{case}" == "table_without_columns":
        p = dataclasses.replace(p, batch=dataclasses.replace(p.batch, block_table=p.batch.block_table[:, :0]))
    else:
        c = p.cache
        p = dataclasses.replace(p, cache=dataclasses.replace(c, key=c.key[:0], value=c.value[:0]))
    out = pp.dispatch(p, backend="generic", validate="basic")
    assert torch.isfinite(out).all()
    print("bounded")
""")


@pytest.mark.parametrize("case", ["table_without_columns", "cache_without_blocks"])
def test_zero_extent_metadata_stays_in_bounds(case, device):
    if device.type != "cpu":
        pytest.skip("reads a null pointer: run only in the CPU interpreter, in a subprocess")
    usable("generic", device)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", ZERO_EXTENT.format(case=case)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "bounded" in proc.stdout, f"exit status {proc.returncode}: {proc.stderr[-500:]}"


# -- strides ----------------------------------------------------------------------------------------------------

def strided_problem(p: pp.PrefillProblem) -> pp.PrefillProblem:
    """The same problem through non-contiguous views: q/k/v from one packed tensor, out a slice of a wider one,
    the cache every other block of a larger one, the block table a column slice, metadata as int64."""
    Hkv = p.num_kv_heads
    qkv = torch.full((T, H + 2 * Hkv, D), float("nan"), dtype=p.q.dtype, device=p.device)
    qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:] = p.q, p.k, p.v

    def every_other_block(t):
        junk = float("nan") if t.is_floating_point() else 127
        big = torch.full((2 * t.shape[0], *t.shape[1:]), junk, dtype=t.dtype, device=t.device)
        big[::2] = t
        return big[::2]

    table = torch.full((p.batch.num_seqs, 3 * p.batch.block_table.shape[1]), -1, dtype=torch.int64, device=p.device)
    table[:, :p.batch.block_table.shape[1]] = p.batch.block_table
    b = p.batch
    batch = pp.BatchMetadata(b.query_start.long(), b.seq_lens.long(), b.context_lens.long(),
                             table[:, :b.block_table.shape[1]], b.max_query_len)
    wide_out = torch.full((T, 2 * H, D), float("nan"), dtype=p.q.dtype, device=p.device)
    cache = dataclasses.replace(p.cache, key=every_other_block(p.cache.key), value=every_other_block(p.cache.value))
    return dataclasses.replace(p, q=qkv[:, :H], k=qkv[:, H:H + Hkv], v=qkv[:, H + Hkv:], out=wide_out[:, ::2],
                               cache=cache, batch=batch)


@pytest.mark.parametrize("spec", [BASE, BASE.replace(layout="split", dtype=torch.float16, alibi=True, sinks=True),
                                  BASE.replace(kv_cache_dtype="fp8_e4m3", layout="split", dtype=torch.float16)],
                         ids=["nhd_f32", "split_f16_features", "split_fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_tensors_are_computed_correctly(spec, backend, device):
    usable(backend, device)
    p = make_problem(spec, device)
    s = strided_problem(p)
    assert not (s.q.is_contiguous() or s.out.is_contiguous() or s.cache.key.is_contiguous()
                or s.batch.block_table.is_contiguous())
    want = run(p, backend, "full")
    got = pp.dispatch(s, backend=backend, validate="full")
    assert got.data_ptr() == s.out.data_ptr()
    assert torch.equal(got, want), "strided views change the result"
    assert_matches_reference(got.contiguous(), with_output(p, torch.empty_like(p.q)), 4e-3, 4e-3, "strided")


def _spread(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a stride-2 view (every other element of a buffer whose other elements are junk)."""
    junk = 1000 if not t.is_floating_point() else float("nan")
    buf = torch.full((t.shape[0], 2), junk, dtype=t.dtype, device=t.device)
    buf[:, 0] = t
    return buf[:, 0]


STRIDED_1D = {
    "seq_lens": lambda p: dataclasses.replace(
        p, batch=dataclasses.replace(p.batch, seq_lens=_spread(p.batch.seq_lens))),
    "query_start": lambda p: dataclasses.replace(
        p, batch=dataclasses.replace(p.batch, query_start=_spread(p.batch.query_start))),
    "alibi_slopes": lambda p: dataclasses.replace(
        p, options=dataclasses.replace(p.options, alibi_slopes=_spread(p.options.alibi_slopes))),
}


@pytest.mark.parametrize("name", sorted(STRIDED_1D))
def test_strided_1d_tensors_are_refused_by_name(name, device):
    """1-D tensors the kernels index directly must have stride 1: a strided view is refused, naming it."""
    p = make_problem(BASE.replace(alibi=True), device)
    s = STRIDED_1D[name](p)
    arg = name  # dispatch validates with the native names, as prefill_attention and the operators do
    for mode in ("basic", "full"):
        with pytest.raises(ValueError, match=rf"^{arg}: expected a contiguous 1-D tensor \(stride 1\), got stride 2"):
            pp.dispatch(s, backend="reference", validate=mode)
