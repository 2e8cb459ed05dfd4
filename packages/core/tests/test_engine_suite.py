"""The engine suite of ``pagedprefill bench``: its workloads (read without allocating), the K/V bytes a call
must read, and the classic twin of an engine problem (the same data, the new tokens' K/V passed separately)."""

from __future__ import annotations

import pytest
import torch
from pagedprefill.cache import gather_kv
from pagedprefill.reference_impl import reference_prefill
from pagedprefill.workloads import (
    LLAMA3_8B,
    SUITES,
    BatchSpec,
    classic_twin,
    flops,
    kv_bytes,
    make_problem,
    new_token_slots,
)

K, M = 1024, 1024 * 1024


def _rows() -> dict:
    return {w.name: w for w in SUITES["engine"]()}


def test_engine_suite_has_the_issue_rows_with_their_shapes():
    rows = _rows()
    expect = {  # name -> (query lengths, context lengths), every other shape Llama-3-8B's unless changed below
        "prefix-cached 8x(1024+7168)": ((1024,) * 8, (7168,) * 8),
        "prefix-cached 8x(1024+7168) block 128": ((1024,) * 8, (7168,) * 8),
        "long prefill 2x8192": ((8192,) * 2, (0, 0)),
        "chunked 4x2048 ctx 0..30k": ((2048,) * 4, (0, 10000, 20000, 30000)),
        "decode 256x ctx 4k": ((1,) * 256, (4 * K,) * 256),
        "decode 4x ctx 128k": ((1,) * 4, (128 * K,) * 4),
        "decode 16x ctx 32k": ((1,) * 16, (32 * K,) * 16),
        "speculative 2x8 on 64k": ((8,) * 2, (64 * K,) * 2),
        "chunk 256 on 128k": ((256,), (128 * K,)),
    }
    for name, (qlens, clens) in expect.items():
        assert (tuple(rows[name].spec.query_lens), tuple(rows[name].spec.context_lens)) == (qlens, clens), name
    short = rows["many short 64x128 ctx 1k..4k"].spec
    assert short.query_lens == (128,) * 64 and (short.context_lens[0], short.context_lens[-1]) == (1024, 4096)
    mixed = rows["mixed 2048 on 8k + 128 decode ctx 1k..8k"].spec
    assert mixed.query_lens == (2048,) + (1,) * 128
    assert mixed.context_lens[0] == 8192 and (mixed.context_lens[1], mixed.context_lens[-1]) == (1024, 8192)
    spec = rows["speculative 128x4 ctx 1k..8k"].spec
    assert spec.query_lens == (4,) * 128 and (spec.context_lens[0], spec.context_lens[-1]) == (1024, 8192)
    assert sorted(spec.context_lens) == list(spec.context_lens) and len(set(spec.context_lens)) == 128

    shapes = {name: (w.spec.num_heads, w.spec.num_kv_heads, w.spec.head_size, w.spec.block_size, w.spec.dtype)
              for name, w in rows.items()}
    llama = (LLAMA3_8B["num_heads"], LLAMA3_8B["num_kv_heads"], 128, 16, torch.bfloat16)
    assert shapes.pop("prefix-cached 8x(1024+7168) block 128") == (32, 8, 128, 128, torch.bfloat16)
    assert shapes.pop("D64 32/32 heads prefix-cached") == (32, 32, 64, 16, torch.bfloat16)
    assert shapes.pop("D256 16/8 heads prefix-cached") == (16, 8, 256, 16, torch.bfloat16)
    assert set(shapes.values()) == {llama}, shapes
    for name in ("D64 32/32 heads prefix-cached", "D256 16/8 heads prefix-cached"):
        assert rows[name].spec.query_lens == (1024,) * 8 and rows[name].spec.context_lens == (7168,) * 8
    fp8 = {name: rows[name].spec for name in ("FP8 e4m3 KV prefix-cached", "FP8 query e4m3 KV prefix-cached")}
    for name, spec in fp8.items():  # the prefix-cached row on an e4m3 cache, with a 16-bit and an FP8 query
        assert spec == rows["prefix-cached 8x(1024+7168)"].spec.replace(kv_cache_dtype="fp8_e4m3",
                                                                        fp8_query="query" in name), name
    for w in rows.values():  # the engine's form is built by bench; the suite's specs are plain ones
        assert not w.spec.kv_in_cache and w.spec.layout == "nhd"
        assert w.spec.kv_cache_dtype == "auto" or w.name in fp8, w.name


def test_memory_bound_rows_are_the_decode_and_speculative_ones():
    marked = sorted(name for name, w in _rows().items() if w.memory_bound)
    assert marked == sorted(["decode 256x ctx 4k", "speculative 128x4 ctx 1k..8k", "decode 4x ctx 128k",
                             "decode 16x ctx 32k", "speculative 2x8 on 64k"])


def test_engine_suite_flops_are_the_attended_pairs():
    rows = _rows()
    # one query per sequence sees its whole context and itself
    assert flops(rows["decode 256x ctx 4k"].spec) == 4 * 128 * 32 * 256 * (4096 + 1)
    # four draft tokens on context c see c + 1, c + 2, c + 3, c + 4 keys
    spec = rows["speculative 2x8 on 64k"].spec
    assert flops(spec) == 4 * 128 * 32 * 2 * (8 * 65536 + 8 * 9 // 2)


def test_kv_bytes_against_a_hand_count():
    # decode 256 x ctx 4k, bf16, 8 KV heads of 128: K and V of 4097 tokens per sequence
    assert kv_bytes(_rows()["decode 256x ctx 4k"].spec) == 256 * 4097 * 2 * 8 * 128 * 2
    small = BatchSpec(query_lens=(3, 0, 1), context_lens=(10, 50, 7), num_kv_heads=2, head_size=16,
                      dtype=torch.float16)
    assert kv_bytes(small) == (13 + 0 + 8) * 2 * 2 * 16 * 2  # a sequence with no new token reads nothing
    assert kv_bytes(small.replace(kv_cache_dtype="fp8_e4m3")) == (13 + 8) * 2 * 2 * 16 * 1  # one byte a value
    assert kv_bytes(small.replace(dtype=torch.float32)) == (13 + 8) * 2 * 2 * 16 * 4
    # window 4: the first new token (position 10) sees 7..10, the last (12) 9..12: positions 7..12 are read
    assert kv_bytes(small.replace(sliding_window=4)) == (6 + 0 + 4) * 2 * 2 * 16 * 2
    assert kv_bytes(small.replace(skip_decode=True)) == 13 * 2 * 2 * 16 * 2  # the decode row is left out


def test_new_token_slots_follow_the_block_table():
    table = torch.tensor([[5, 2, 9], [7, 1, 0]], dtype=torch.int32)
    # sequence 0: positions 3..5 (blocks of 4: block 5 offset 3, then block 2 offsets 0, 1); sequence 1: position 4
    slots = new_token_slots([3, 1], [3, 4], table, 4)
    assert slots.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 1 * 4 + 0] and slots.dtype == torch.int64


ENGINE_SPEC = BatchSpec(query_lens=(5, 1, 17, 4), context_lens=(9, 40, 0, 13), num_heads=4, num_kv_heads=2,
                        head_size=32, block_size=8, dtype=torch.float32, kv_in_cache=True)


@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_classic_twin_holds_the_same_data(layout):
    engine = make_problem(ENGINE_SPEC)
    twin = classic_twin(engine, layout)
    assert twin.k is not None and twin.k.shape == (27, 2, 32) and twin.cache.layout.value == layout
    assert torch.isnan(twin.out).all() and twin.out is not engine.out
    b = engine.batch
    for i, seq in enumerate(b.seq_lens.tolist()):  # every token's key and value, cached or new, read alike
        k_engine, v_engine = gather_kv(engine.cache, b.block_table[i], seq)
        k_twin, v_twin = gather_kv(twin.cache, b.block_table[i], int(b.context_lens[i]))
        s0, n = int(b.query_start[i]), seq - int(b.context_lens[i])
        assert torch.equal(torch.cat([k_twin, twin.k[s0:s0 + n]]), k_engine)
        assert torch.equal(torch.cat([v_twin, twin.v[s0:s0 + n]]), v_engine)
    # so one reference serves both forms
    torch.testing.assert_close(reference_prefill(twin), reference_prefill(engine), atol=1e-6, rtol=1e-6)


def test_classic_twin_of_an_fp8_cache_reads_the_dequantised_new_tokens():
    engine = make_problem(ENGINE_SPEC.replace(dtype=torch.float16, kv_cache_dtype="fp8_e4m3"))
    twin = classic_twin(engine)
    assert twin.k.dtype == torch.float16
    torch.testing.assert_close(reference_prefill(twin).float(), reference_prefill(engine).float(),
                               atol=2e-3, rtol=2e-3)


def test_classic_twin_refuses_what_is_not_an_engine_problem():
    with pytest.raises(ValueError, match=r"problem: expected an engine problem with k = v = None"):
        classic_twin(make_problem(ENGINE_SPEC.replace(kv_in_cache=False)))
    with pytest.raises(ValueError, match=r"problem: expected its cache in the NHD layout"):
        classic_twin(make_problem(ENGINE_SPEC.replace(layout="split")))
    with pytest.raises(ValueError, match=r"layout: expected 'nhd' or 'split', got 'hnd'"):
        classic_twin(make_problem(ENGINE_SPEC), "hnd")
