"""Determinism on one GPU: the same inputs give the same bits on every run, and on one tile a sequence's output
does not depend on the other sequences of its batch (the kernel computes each (sequence, tile) on its own: tiles
start at each sequence's first token, and a row's keys are visited in the same order whatever else is in the
batch, split keys included, whose partial rows are merged in split order).

The tile the policy picks depends on the batch's shape: its workload class (short or long queries) and, for
launches too small to fill the GPU, the number of splits of each tile's keys. The batch-composition test runs
each sequence alone on its batch's tile; ``test_tile_choice_follows_the_batch_shape`` reports what holds when a
sequence alone gets another tile from the policy.
"""

from __future__ import annotations

import dataclasses

import pagedprefill as pp
import pytest
import torch
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.testing import DEFAULT_TOLERANCES, BatchSpec, assert_matches_reference, make_problem

RUNS = 20

SPECS = {
    "fp16_gqa_window": BatchSpec(query_lens=(200, 1, 77, 0, 250, 3), context_lens=(1000, 300, 0, 5, 64, 2047),
                                 num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.float16,
                                 sliding_window=256, seed=21),
    "bf16_fp8_split_features": BatchSpec(query_lens=(33, 129, 1, 8), context_lens=(17, 0, 4000, 511),
                                         num_heads=12, num_kv_heads=2, head_size=80, block_size=64,
                                         dtype=torch.bfloat16, kv_cache_dtype="fp8_e5m2", layout="split",
                                         alibi=True, sinks=True, softcap=15.0, seed=22),
    "fp32_head_256_mqa": BatchSpec(query_lens=(40, 2, 90), context_lens=(60, 700, 3), num_heads=8, num_kv_heads=1,
                                   head_size=256, block_size=7, dtype=torch.float32, seed=23),
}


def run(problem: pp.PrefillProblem) -> torch.Tensor:
    out = torch.full_like(problem.q, float("nan"))
    return pp.dispatch(dataclasses.replace(problem, out=out), validate="basic")


def sequence_alone(problem: pp.PrefillProblem, i: int) -> pp.PrefillProblem:
    """Sequence ``i`` of ``problem`` as a batch of its own (same cache, same block-table row)."""
    b = problem.batch
    start = int(b.query_start[i])
    n = int(b.seq_lens[i] - b.context_lens[i])
    dev = problem.device
    batch = pp.BatchMetadata(query_start=torch.tensor([0, n], dtype=torch.int32, device=dev),
                             seq_lens=b.seq_lens[i:i + 1].clone(), context_lens=b.context_lens[i:i + 1].clone(),
                             block_table=b.block_table[i:i + 1].clone(), max_query_len=n)
    rows = slice(start, start + n)
    return dataclasses.replace(problem, q=problem.q[rows].clone(), k=problem.k[rows].clone(),
                               v=problem.v[rows].clone(), out=torch.empty_like(problem.q[rows]), batch=batch)


def reversed_batch(problem: pp.PrefillProblem) -> tuple[pp.PrefillProblem, list[slice], list[slice]]:
    """The batch with its sequences in reverse order; returns it and each sequence's rows in both batches."""
    b = problem.batch
    starts = b.query_start.tolist()
    lens = (b.seq_lens - b.context_lens).tolist()
    order = list(range(b.num_seqs))[::-1]
    old_rows = [slice(starts[i], starts[i] + lens[i]) for i in range(b.num_seqs)]
    new_rows, at = [None] * b.num_seqs, 0
    for i in order:
        new_rows[i] = slice(at, at + lens[i])
        at += lens[i]
    perm = torch.cat([torch.arange(r.start, r.stop) for r in (old_rows[i] for i in order)]).to(problem.device)
    new_starts = [new_rows[i].start for i in order] + [at]
    idx = torch.tensor(order, device=problem.device)
    batch = pp.BatchMetadata(torch.tensor(new_starts, dtype=torch.int32, device=problem.device),
                             b.seq_lens[idx], b.context_lens[idx], b.block_table[idx], b.max_query_len)
    flipped = dataclasses.replace(problem, q=problem.q[perm], k=problem.k[perm], v=problem.v[perm],
                                  out=torch.empty_like(problem.q), batch=batch)
    return flipped, old_rows, new_rows


def tile_config(backend: pp.Backend, problem: pp.PrefillProblem):
    return backend.policy(problem_shape(problem), pp.DeviceInfo.detect(problem.device))


def run_on_tile(backend: pp.Backend, problem: pp.PrefillProblem, config) -> torch.Tensor:
    """``problem`` on ``backend`` with the tile ``config``, whatever the policy would pick for its shape."""
    problem = dataclasses.replace(problem, out=torch.full_like(problem.q, float("nan")))
    backend.run_tile(problem, config, pp.DeviceInfo.detect(problem.device))
    return problem.out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_same_inputs_give_the_same_bits_every_run(name, gpu, gpu_backend):
    problem = make_problem(SPECS[name], gpu)
    first = run(problem)
    for i in range(1, RUNS):
        again = run(problem)
        assert torch.equal(again, first), f"run {i} differs from run 0"
    atol, rtol = DEFAULT_TOLERANCES[problem.q.dtype]
    assert_matches_reference(first, problem, atol, rtol, label=name)
    print(f"{gpu_backend.name}/{name}: {RUNS} runs bit-identical")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(name, gpu, gpu_backend):
    problem = make_problem(SPECS[name], gpu)
    full = run(problem)
    config = tile_config(gpu_backend, problem)
    b = problem.batch
    checked = 0
    for i in range(b.num_seqs):
        alone = sequence_alone(problem, i)
        if alone.num_tokens == 0:
            continue
        start = int(b.query_start[i])
        assert torch.equal(run_on_tile(gpu_backend, alone, config), full[start:start + alone.num_tokens]), \
            f"sequence {i} alone on the batch's tile {config} differs"
        checked += 1
    flipped, old_rows, new_rows = reversed_batch(problem)
    assert tile_config(gpu_backend, flipped) == tile_config(gpu_backend, problem)
    out = run(flipped)
    for i in range(b.num_seqs):
        assert torch.equal(out[new_rows[i]], full[old_rows[i]]), f"sequence {i} differs in the reversed batch"
    assert checked >= 3
    print(f"{gpu_backend.name}/{name}: {checked} sequences bit-identical alone on the batch's tile ({config}), in "
          f"the batch and reversed")


BATCH_SHAPES = {
    # A long prefill alone is a "long" workload; among many decode rows the batch is "short".
    "long_prefill_among_decode_rows": BatchSpec(query_lens=(700,) + (1,) * 15, context_lens=(300,) + (500,) * 15,
                                                num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                                                dtype=torch.float16, seed=24),
    # 64 decode rows fill an H200 (528 programs); one alone is 8 programs, whose keys (32 tiles of 128) sm80's
    # policy splits 15 ways there.
    "decode_row_alone": BatchSpec(query_lens=(1,) * 64, context_lens=(4000,) * 64, num_heads=32, num_kv_heads=8,
                                  head_size=128, block_size=16, dtype=torch.bfloat16, seed=25),
}


@pytest.mark.parametrize("name", sorted(BATCH_SHAPES))
def test_tile_choice_follows_the_batch_shape(name, gpu, gpu_backend):
    """A sequence alone may get another tile from the policy than inside its batch (another workload class,
    another split count). Results then agree within tolerance; this test reports whether the bits do."""
    problem = make_problem(BATCH_SHAPES[name], gpu)
    full = run(problem)
    alone = sequence_alone(problem, 0)
    rows = alone.num_tokens
    same_tile = tile_config(gpu_backend, alone) == tile_config(gpu_backend, problem)
    got = run(alone)
    atol, rtol = DEFAULT_TOLERANCES[problem.q.dtype]
    torch.testing.assert_close(got, full[:rows], atol=atol, rtol=rtol)
    identical = torch.equal(got, full[:rows])
    if same_tile:
        assert identical, "same tile, different bits"
    print(f"{gpu_backend.name}/{name}: sequence 0 alone: tile {tile_config(gpu_backend, alone)}; in the batch: "
          f"{tile_config(gpu_backend, problem)}; bit-identical: {identical}")
