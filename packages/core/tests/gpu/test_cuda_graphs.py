"""CUDA graphs: one launch captured with fixed-capacity tensors replays correctly for any lengths written into the
same metadata tensors; capturing it allocates nothing (but, where the policy splits the keys, the partial rows
the shapes size, freed when the call returns) and does not synchronise with the host.

Capacity: ``T_CAP`` token rows, ``B_CAP`` sequences, a block table ``WIDTH`` columns wide. Each replay writes new
lengths (inside the capacity: unused sequences get no tokens, unused rows sit at the end), a new block table and
new q/k/v into the captured tensors, and is compared with an eager call on the same inputs.
"""

from __future__ import annotations

import pagedprefill as pp
import pytest
import torch
from pagedprefill.testing import DEFAULT_TOLERANCES

H, HKV, D, BS = 8, 2, 128, 16
T_CAP, B_CAP, WIDTH, NUM_BLOCKS = 96, 4, 8, 40

#: (query_lens, context_lens) of each replay: at most B_CAP sequences, T_CAP tokens and WIDTH * BS cached tokens.
LENGTHS = [
    ((5, 1, 17, 0), (9, 40, 0, 6)),
    ((1, 1, 1, 1), (127, 3, 64, 0)),      # decode rows
    ((90,), (0,)),                         # one sequence; the other three are empty
    ((0, 0, 0, 0), (1, 2, 3, 4)),          # no new tokens: nothing is written
    ((30, 30, 30, 6), (128, 0, 17, 1)),    # the whole capacity
    ((2, 7), (33, 120)),
]

CONFIGS = {
    "fp16_nhd": dict(dtype=torch.float16, layout="nhd", kv="auto", features=False),
    "bf16_split_all_features": dict(dtype=torch.bfloat16, layout="split", kv="auto", features=True),
    "fp16_fp8_tensor_scales": dict(dtype=torch.float16, layout="split", kv="fp8_e4m3", features=False),
}


class Captured:
    """The tensors a captured launch reads and writes; ``write`` changes their contents, never their storage."""

    def __init__(self, device: torch.device, dtype, layout: str, kv: str, features: bool, seed: int = 0):
        self.device, self.gen = device, torch.Generator().manual_seed(seed)
        cache = pp.allocate_cache(NUM_BLOCKS, BS, HKV, D, dtype, layout=layout, kv_cache_dtype=kv, device=device)
        if cache.dtype.is_fp8:
            k_full, v_full = self.randn(*cache.key.shape), self.randn(*cache.value.shape)
            ks, vs = pp.fp8_scale_for(k_full, cache.dtype), pp.fp8_scale_for(v_full, cache.dtype)
            cache.key.copy_(pp.quantize_fp8(k_full, ks, cache.dtype))
            cache.value.copy_(pp.quantize_fp8(v_full, vs, cache.dtype))
            cache = pp.PagedKVCache(cache.key, cache.value, layout, kv,
                                    torch.tensor([ks], device=device), torch.tensor([vs], device=device))
        else:
            cache.key.copy_(self.randn(*cache.key.shape, dtype=dtype))
            cache.value.copy_(self.randn(*cache.value.shape, dtype=dtype))
        self.cache = cache
        self.q = self.randn(T_CAP, H, D, dtype=dtype)
        self.k = self.randn(T_CAP, HKV, D, dtype=dtype)
        self.v = self.randn(T_CAP, HKV, D, dtype=dtype)
        self.out = torch.full_like(self.q, float("nan"))
        i32 = dict(dtype=torch.int32, device=device)
        self.batch = pp.BatchMetadata(query_start=torch.zeros(B_CAP + 1, **i32), seq_lens=torch.zeros(B_CAP, **i32),
                                      context_lens=torch.zeros(B_CAP, **i32),
                                      block_table=torch.zeros(B_CAP, WIDTH, **i32))  # no host max_query_len
        self.options = {}
        if features:
            self.options = dict(alibi_slopes=self.randn(H).abs() * 0.1, sinks=self.randn(H), sliding_window=48,
                                softcap=20.0, sm_scale=0.09)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=dtype)

    def call(self, out: torch.Tensor, validate: str = "basic") -> torch.Tensor:
        return pp.prefill_attention(self.q, self.k, self.v, self.cache, self.batch, out=out, validate=validate,
                                    **self.options)

    def write(self, query_lens, context_lens) -> int:
        """Write lengths, a block table and new q/k/v into the captured tensors; returns the tokens used."""
        q = list(query_lens) + [0] * (B_CAP - len(query_lens))
        c = list(context_lens) + [0] * (B_CAP - len(context_lens))
        start = [0]
        for n in q:
            start.append(start[-1] + n)
        assert start[-1] <= T_CAP and max(c) <= WIDTH * BS
        table = torch.randint(0, NUM_BLOCKS, (B_CAP, WIDTH), generator=self.gen, dtype=torch.int32)  # junk
        perm = torch.randperm(NUM_BLOCKS, generator=self.gen).to(torch.int32)
        used = 0
        for i, ctx in enumerate(c):
            n = -(-ctx // BS)
            table[i, :n] = perm[used:used + n]
            used += n
        b = self.batch
        b.query_start.copy_(torch.tensor(start, dtype=torch.int32))
        b.seq_lens.copy_(torch.tensor([x + y for x, y in zip(q, c)], dtype=torch.int32))
        b.context_lens.copy_(torch.tensor(c, dtype=torch.int32))
        b.block_table.copy_(table)
        for t in (self.q, self.k, self.v):
            t.copy_(self.randn(*t.shape, dtype=t.dtype))
        return start[-1]

    def reference(self, tokens: int) -> torch.Tensor:
        """The reference on the first ``tokens`` rows."""
        problem = pp.PrefillProblem(self.q[:tokens], self.k[:tokens], self.v[:tokens],
                                    torch.full_like(self.q[:tokens], float("nan")), self.cache, self.batch,
                                    pp.AttentionOptions(**self.options))
        return pp.reference_prefill(problem)


def scratch_bytes(c: Captured, gpu_backend) -> int:
    """The most a call of ``c`` may allocate: its partial rows (and arrival counters) when the policy splits its keys,
    else nothing."""
    from pagedprefill.backends.triton_base import TritonBackend, problem_shape
    from pagedprefill.device import DeviceInfo
    from pagedprefill.tiling import launch_grid, split_scratch_bytes

    if not isinstance(gpu_backend, TritonBackend):
        return 0
    shape = problem_shape(pp.PrefillProblem(c.q, c.k, c.v, c.out, c.cache, c.batch,
                                            pp.AttentionOptions(**c.options)))
    config = gpu_backend.tile_config(shape, DeviceInfo.detect(c.device))
    if config.key_splits == 1:
        return 0
    g0, g1, _ = launch_grid(shape, config)
    # Two tensors of partial rows, and a Hopper launch's arrival counters (an int32 per program and consumer,
    # allocated once per stream), in 512-byte blocks.
    return split_scratch_bytes(shape, config.key_splits) + 2 * 512 + -(-8 * g0 * g1 // 512) * 512


def warm_up(c: Captured) -> None:
    """Compile and run once outside the capture, on a side stream (as torch.cuda.graph requires)."""
    stream = torch.cuda.Stream(c.device)
    stream.wait_stream(torch.cuda.current_stream(c.device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            c.call(c.out)
    torch.cuda.current_stream(c.device).wait_stream(stream)
    torch.cuda.synchronize(c.device)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_captured_launch_replays_any_lengths_within_capacity(config, gpu, gpu_backend):
    with torch.cuda.device(gpu):
        c = Captured(gpu, **CONFIGS[config])
        c.write(*LENGTHS[0])
        warm_up(c)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host synchronisation in here would raise
            torch.cuda.reset_peak_memory_stats(gpu)
            before = torch.cuda.memory_allocated(gpu)
            result = c.call(c.out, validate="basic")
            after = torch.cuda.memory_allocated(gpu)
            peak = torch.cuda.max_memory_allocated(gpu)
        assert result is c.out
        allowed = scratch_bytes(c, gpu_backend)
        assert after == before and peak - before <= allowed, \
            f"capture allocated {after - before} bytes (peak +{peak - before}, {allowed} allowed for split keys)"
        atol, rtol = DEFAULT_TOLERANCES[c.q.dtype]
        for query_lens, context_lens in LENGTHS:
            tokens = c.write(query_lens, context_lens)
            c.out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(gpu)
            got = c.out.clone()
            eager = c.call(torch.full_like(c.q, float("nan")), validate="full")
            assert torch.equal(got[:tokens], eager[:tokens]), f"{query_lens}/{context_lens}: replay != eager"
            assert torch.isfinite(got[:tokens].float()).all()
            assert got[tokens:].isnan().all(), "rows past the last sequence were written"
            if tokens:
                torch.testing.assert_close(got[:tokens].float(), c.reference(tokens).float(), atol=atol, rtol=rtol)
        print(f"{gpu_backend.name}/{config}: {len(LENGTHS)} replays match eager calls; capture allocated 0 bytes")


def test_eager_call_allocates_nothing_and_never_synchronises(gpu, gpu_backend):
    """With ``out`` given and ``validate="basic"`` a call allocates no memory (but a split launch's partial rows) and
    makes no synchronising CUDA call
    (torch's sync debug mode raises on one); ``validate="full"`` reads the metadata, which does synchronise."""
    with torch.cuda.device(gpu):
        c = Captured(gpu, **CONFIGS["fp16_fp8_tensor_scales"], seed=1)
        tokens = c.write(*LENGTHS[4])
        warm_up(c)
        torch.cuda.synchronize(gpu)
        torch.cuda.reset_peak_memory_stats(gpu)
        before = torch.cuda.memory_allocated(gpu)
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = c.call(c.out, validate="basic")
            peak = torch.cuda.max_memory_allocated(gpu)
            with pytest.raises(RuntimeError):
                c.call(c.out, validate="full")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert result is c.out
        allowed = scratch_bytes(c, gpu_backend)
        assert peak - before <= allowed, f"an eager call allocated {peak - before} bytes ({allowed} allowed)"
        atol, rtol = DEFAULT_TOLERANCES[c.q.dtype]
        torch.testing.assert_close(c.out[:tokens].float(), c.reference(tokens).float(), atol=atol, rtol=rtol)
