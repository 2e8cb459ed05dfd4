"""Workloads: random paged batches (:class:`BatchSpec`, :func:`make_problem`) for tests, the demo, ``bench``
and ``tune``, and the benchmark suites (:func:`default_suite`, :func:`context_suite`, :func:`engine_suite`,
:func:`models_suite`, with exact FLOP counts and, for memory-bound rows, the K/V bytes a call must read:
:func:`kv_bytes`).

Data is N(0, 1) (never zeros), lengths are ragged, and each sequence's blocks are a random subset of the
cache in shuffled order, with unused blocks also filled with random data, so wrong indexing shows.
The output is poisoned with NaN so that an unwritten element fails any comparison.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .cache import allocate_cache, as_stored_type, fp8_scale_for, quantize_fp8, write_to_cache
from .types import AttentionOptions, BatchMetadata, KVCacheDType, KVLayout, PagedKVCache, PrefillProblem
from .validation import dtype_name, expected_x


@dataclass(frozen=True)
class BatchSpec:
    """Everything that defines a random batch. ``query_lens[i]``/``context_lens[i]`` per sequence."""

    query_lens: Sequence[int] = (5, 1, 17)
    context_lens: Sequence[int] = (9, 0, 33)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    block_size: int = 8
    dtype: torch.dtype = torch.float16
    kv_cache_dtype: str = "auto"
    layout: str = "nhd"
    alibi: bool = False
    sliding_window: Optional[int] = None
    softcap: float = 0.0
    sinks: bool = False
    sm_scale: Optional[float] = None
    scale_as_tensor: bool = False
    start_loc_entries: str = "B+1"
    spare_blocks: int = 3
    seed: int = 0
    #: elements per innermost K chunk of the split layout (None: 16 bytes' worth)
    x: Optional[int] = None
    causal: bool = True
    skip_decode: bool = False
    #: FP8 e4m3 output with this scale (the output tensor is ``float8_e4m3fn``)
    fp8_out_scale: Optional[float] = None
    #: k = v = None: the new tokens' keys/values are written into the cache and read from there
    kv_in_cache: bool = False
    #: junk block-table columns past the widest sequence's blocks (engines pad their tables)
    extra_columns: int = 0
    #: q quantised to FP8 e4m3 with a per-tensor ``q_scale`` (a tensor with ``scale_as_tensor``); ``dtype`` is
    #: then the type of the output and the new tokens' keys and values
    fp8_query: bool = False
    #: no context lengths in the batch (``BatchMetadata.context_lens`` None): derived from the ``B + 1`` starts
    #: and the sequence lengths, as the serving engine's signature gives them
    context_from_starts: bool = False
    #: every cache slot no sequence holds (past each sequence's keys, and blocks no table row names) NaN, as
    #: a cache allocated with ``torch.empty`` or reused by an engine may be: a kernel must never let them reach an
    #: output (a masked score times a NaN value is NaN)
    nan_unused_slots: bool = False

    def replace(self, **changes) -> BatchSpec:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = [f"q={list(self.query_lens)}", f"ctx={list(self.context_lens)}",
                 f"H={self.num_heads}/{self.num_kv_heads}", f"D={self.head_size}", f"bs={self.block_size}",
                 dtype_name(self.dtype), self.layout]
        if self.kv_cache_dtype != "auto":
            parts.append(self.kv_cache_dtype)
        if self.x is not None:
            parts.append(f"x={self.x}")
        for flag in ("alibi", "sinks", "scale_as_tensor", "skip_decode", "kv_in_cache", "fp8_query",
                     "context_from_starts", "nan_unused_slots"):
            if getattr(self, flag):
                parts.append(flag)
        if not self.causal:
            parts.append("non_causal")
        if self.fp8_out_scale is not None:
            parts.append(f"fp8_out_scale={self.fp8_out_scale}")
        if self.sliding_window:
            parts.append(f"window={self.sliding_window}")
        if self.extra_columns:
            parts.append(f"extra_columns={self.extra_columns}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.sm_scale is not None:
            parts.append(f"sm_scale={self.sm_scale}")
        return " ".join(parts)


def make_problem(spec: BatchSpec, device="cpu") -> PrefillProblem:
    """Build a random :class:`PrefillProblem` for ``spec`` on ``device`` (output poisoned with NaN)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(spec.seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    qlens, clens = list(spec.query_lens), list(spec.context_lens)
    B = len(qlens)
    T = sum(qlens)
    H, Hkv, D, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    # With kv_in_cache the cache also holds the new tokens (positions ctx .. ctx + q - 1).
    cached = [c + q for c, q in zip(clens, qlens)] if spec.kv_in_cache else clens
    blocks_per_seq = [-(-c // bs) for c in cached]
    width = max(blocks_per_seq + [1]) + spec.extra_columns
    num_blocks = max(1, sum(blocks_per_seq) + spec.spare_blocks)
    kv_dtype = KVCacheDType.parse(spec.kv_cache_dtype)
    cache = allocate_cache(num_blocks, bs, Hkv, D, spec.dtype, layout=spec.layout, kv_cache_dtype=kv_dtype,
                           device=device, x=spec.x)
    k_scale = v_scale = 1.0
    if kv_dtype.is_fp8:
        k_full, v_full = randn(*cache.key.shape), randn(*cache.value.shape)
        k_scale, v_scale = fp8_scale_for(k_full, kv_dtype), fp8_scale_for(v_full, kv_dtype)
        cache.key.copy_(quantize_fp8(k_full, k_scale, kv_dtype))
        cache.value.copy_(quantize_fp8(v_full, v_scale, kv_dtype))
        if spec.scale_as_tensor:
            k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
            v_scale = torch.tensor(v_scale, dtype=torch.float32, device=device)
    else:
        cache.key.copy_(randn(*cache.key.shape, dtype=spec.dtype))
        cache.value.copy_(randn(*cache.value.shape, dtype=spec.dtype))
    cache = dataclasses.replace(cache, k_scale=k_scale, v_scale=v_scale)

    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (B, width), generator=gen, dtype=torch.int32)  # unused columns: junk
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    if spec.nan_unused_slots:
        fill_unused_slots(cache, table, cached, float("nan"))
    batch = BatchMetadata.from_lengths(qlens, clens, table, device=device)
    if spec.start_loc_entries == "B":
        if spec.context_from_starts:
            raise ValueError("spec: context lengths derived from the starts (context_from_starts) need B + 1 of "
                             "them, got start_loc_entries='B'")
        batch = dataclasses.replace(batch, query_start=batch.query_start[:B])
    if spec.context_from_starts:
        batch = dataclasses.replace(batch, context_lens=None)

    q = randn(T, H, D, dtype=spec.dtype)
    k = randn(T, Hkv, D, dtype=spec.dtype)
    v = randn(T, Hkv, D, dtype=spec.dtype)
    if spec.kv_in_cache:  # write the new tokens where the table puts positions ctx .. ctx + q - 1, then drop k/v
        write_to_cache(cache, k, v, new_token_slots(qlens, clens, table, bs).to(device))
        k = v = None
    q_scale = 1.0
    if spec.fp8_query:  # as an engine quantises its queries: q / q_scale in e4m3, the descale passed beside it
        q_scale = fp8_scale_for(q, KVCacheDType.FP8_E4M3)
        q = quantize_fp8(q, q_scale, KVCacheDType.FP8_E4M3).view(torch.float8_e4m3fn)
        if spec.scale_as_tensor:
            q_scale = torch.tensor([q_scale], dtype=torch.float32, device=device)
    out_dtype = torch.float8_e4m3fn if spec.fp8_out_scale is not None else spec.dtype
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=device)
    options = AttentionOptions(
        sm_scale=spec.sm_scale,
        alibi_slopes=(randn(H).abs() * 0.5) if spec.alibi else None,
        sliding_window=spec.sliding_window,
        softcap=spec.softcap,
        sinks=randn(H) if spec.sinks else None,
        causal=spec.causal,
        skip_decode=spec.skip_decode,
        fp8_out_scale=spec.fp8_out_scale,
        q_scale=q_scale,
    )
    return PrefillProblem(q=q, k=k, v=v, out=out, cache=cache, batch=batch, options=options)


def fill_unused_slots(cache: PagedKVCache, block_table: torch.Tensor, cached: Sequence[int], value: float) -> None:
    """Write ``value`` into every slot of ``cache`` that holds none of the ``cached[i]`` keys of sequence ``i``
    (positions past them in its last block, and blocks no row of ``block_table`` names for its keys): the
    slots a kernel reads only by mistake. An FP8 cache holds ``value`` in its FP8 type (NaN: the type's NaN)."""
    table, bs = block_table.cpu(), cache.block_size
    used = torch.zeros(cache.key.shape[0], bs, dtype=torch.bool)
    for i, n in enumerate(cached):
        pos = torch.arange(n)
        used[table[i, pos // bs].long(), pos % bs] = True
    unused = (~used).to(cache.key.device)
    if cache.dtype.is_fp8:  # torch fills no FP8 tensor in place: write the value's bytes
        fill = torch.tensor([value]).to(cache.dtype.torch_dtype).view(torch.uint8).item()
    for t, slot_dims in ((cache.key, (0, 3, 1, 2, 4) if cache.layout is KVLayout.SPLIT else None),
                         (cache.value, (0, 3, 1, 2) if cache.layout is KVLayout.SPLIT else None)):
        view = t.view(torch.uint8) if cache.dtype.is_fp8 else t
        view = view if slot_dims is None else view.permute(*slot_dims)  # [blocks, slots, ...]
        view[unused] = fill if cache.dtype.is_fp8 else value


def new_token_slots(query_lens: Sequence[int], context_lens: Sequence[int], block_table: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """``[sum(query_lens)]`` int64 cache slots (``block * block_size + offset``) of every new token, in token
    order: sequence ``i``'s tokens sit at positions ``context_lens[i] ..`` of row ``i`` of ``block_table``
    (read on the host)."""
    table = block_table.cpu()
    slots = [torch.zeros(0, dtype=torch.long)]
    for i, (n, c) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(c, c + n)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


def classic_twin(problem: PrefillProblem, layout: str = "nhd") -> PrefillProblem:
    """The classic form of an engine problem (k = v = None, on an NHD cache that holds every token): the same
    queries, batch and cached values, with the new tokens' keys/values read back out of the cache and passed
    separately, on a cache of ``layout`` (``"nhd"``: the same cache tensors; ``"split"``: a copy in the split
    layout, 16 bytes per innermost K chunk). A new NaN-poisoned output.

    The two forms attend to the same values, so their outputs compare with one reference. (An FP8 cache's new
    tokens come back dequantised, in the 16-bit type the call computes in: the query's, unless it is FP8.)
    """
    if not problem.kv_in_cache:
        raise ValueError("problem: expected an engine problem with k = v = None (BatchSpec(kv_in_cache=True)), "
                         "got one with the new tokens' keys/values passed separately")
    if problem.cache.layout is not KVLayout.NHD:
        raise ValueError(f"problem: expected its cache in the NHD layout (the engine's), got {problem.cache.layout}")
    if layout not in ("nhd", "split"):
        raise ValueError(f"layout: expected 'nhd' or 'split', got {layout!r}")
    b = problem.batch
    seq, ctx = b.seq_lens.tolist(), b.context_lengths().tolist()
    slots = new_token_slots([s - c for s, c in zip(seq, ctx)], ctx, b.block_table, problem.cache.block_size)
    k, v = _read_slots(problem.cache, slots.to(problem.device), problem.dtype)
    cache = problem.cache if layout == "nhd" else _split_copy(problem.cache)
    twin = dataclasses.replace(problem, k=k, v=v, cache=cache)
    return fresh_output(twin)


def _read_slots(cache: PagedKVCache, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values at ``slots`` of an NHD cache, ``[len(slots), Hkv, D]`` each, in ``dtype`` (FP8
    dequantised with the cache's scales)."""
    rows = []
    for t, scale in ((cache.key, cache.k_scale), (cache.value, cache.v_scale)):
        flat = as_stored_type(t, cache.dtype).reshape(-1, cache.num_kv_heads, cache.head_size)
        picked = flat[slots]
        if cache.dtype.is_fp8:
            picked = picked.float() * scale  # a float, or a 0-d / 1-element tensor: both broadcast
        rows.append(picked.to(dtype).contiguous())
    return rows[0], rows[1]


def _split_copy(cache: PagedKVCache) -> PagedKVCache:
    """An NHD cache's values in the split layout (K ``[blocks, Hkv, D // x, block, x]``, V ``[blocks, Hkv, D,
    block]``, ``x`` making 16 bytes), a new copy."""
    nb, bs, hkv, d = cache.key.shape
    x = expected_x(d, cache.key.element_size())
    key = cache.key.view(nb, bs, hkv, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value = cache.value.permute(0, 2, 3, 1).contiguous()
    return dataclasses.replace(cache, key=key, value=value, layout=KVLayout.SPLIT)


def with_output(problem: PrefillProblem, out: torch.Tensor) -> PrefillProblem:
    """The same problem writing into ``out``."""
    return dataclasses.replace(problem, out=out)


def fresh_output(problem: PrefillProblem) -> PrefillProblem:
    """The same problem with a new NaN-poisoned output tensor (of the output's dtype)."""
    return with_output(problem, torch.full_like(problem.out, float("nan")))


#: Llama-3-8B attention shapes, the suite's default.
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Workload:
    """A named batch of the benchmark suite; ``note`` is printed with its row. A ``memory_bound`` row is
    limited by reading the K/V cache, not by the matrix units (decode, speculative): ``bench`` gives its
    GB/s of :func:`kv_bytes` beside its TFLOP/s."""

    name: str
    spec: BatchSpec
    note: str = ""
    memory_bound: bool = False


def _spread(count: int, low: int, high: int) -> tuple[int, ...]:
    """``count`` (at least 2) lengths evenly spaced from ``low`` to ``high``, both included."""
    return tuple(low + ((high - low) * i) // (count - 1) for i in range(count))


def default_suite() -> list[Workload]:
    """The suite of the performance table (Llama-3-8B shapes unless the name says otherwise)."""
    base = BatchSpec(**LLAMA3_8B, spare_blocks=0)
    prefix = base.replace(query_lens=(1024,) * 8, context_lens=(7168,) * 8)
    chunked = base.replace(query_lens=(2048,) * 4, context_lens=(0, 10000, 20000, 30000))
    short_ctx = _spread(64, 1024, 4096)
    return [
        Workload("prefix-cached 8x(1024+7168)", prefix),
        Workload("long prefill 2x8192", base.replace(query_lens=(8192,) * 2, context_lens=(0, 0))),
        Workload("chunked 4x2048 ctx 0..30k", chunked),
        Workload("many short 64x128 ctx 1k..4k", base.replace(query_lens=(128,) * 64, context_lens=short_ctx)),
        Workload("D64 prefix-cached", prefix.replace(head_size=64)),
        Workload("D96 prefix-cached", prefix.replace(head_size=96)),
        Workload("D256 prefix-cached", prefix.replace(head_size=256)),
        Workload("fp16 prefix-cached", prefix.replace(dtype=torch.float16)),
        Workload("FP8 e4m3 KV prefix-cached", prefix.replace(kv_cache_dtype="fp8_e4m3")),
        Workload("FP8 query e4m3 KV prefix-cached", prefix.replace(kv_cache_dtype="fp8_e4m3", fp8_query=True)),
        Workload("window 4096 chunked", chunked.replace(sliding_window=4096), "in-window FLOPs"),
    ]


def context_suite() -> list[Workload]:
    """Context scaling: two sequences of 1024 new tokens on 8k, 32k and 128k cached tokens each (Llama-3-8B
    shapes), so that a kernel's speed can be read against the length of the prefix it streams."""
    base = BatchSpec(**LLAMA3_8B, spare_blocks=0, query_lens=(1024,) * 2)
    return [Workload(f"context 2x(1024+{k}k)", base.replace(context_lens=(k * 1024,) * 2)) for k in (8, 32, 128)]


def engine_suite() -> list[Workload]:
    """The serving engine's suite: batches as an engine's steps make them (prefix-cached prefills at pages of
    16 and 128, a long prefill, chunks, many short sequences, a mixed step of a chunk and decode rows, decode,
    speculative rows, head sizes 64 and 256, an FP8 e4m3 cache with a 16-bit and with an FP8 query), then few
    sequences on long contexts. Llama-3-8B shapes unless the name says otherwise; ``bench`` times each the
    engine's way (k = v = None, every key and value read from the cache) and the classic way."""
    base = BatchSpec(**LLAMA3_8B, spare_blocks=0)
    prefix = base.replace(query_lens=(1024,) * 8, context_lens=(7168,) * 8)
    return [
        Workload("prefix-cached 8x(1024+7168)", prefix),
        Workload("prefix-cached 8x(1024+7168) block 128", prefix.replace(block_size=128)),
        Workload("long prefill 2x8192", base.replace(query_lens=(8192,) * 2, context_lens=(0, 0))),
        Workload("chunked 4x2048 ctx 0..30k", base.replace(query_lens=(2048,) * 4,
                                                            context_lens=(0, 10000, 20000, 30000))),
        Workload("many short 64x128 ctx 1k..4k", base.replace(query_lens=(128,) * 64,
                                                               context_lens=_spread(64, 1024, 4096))),
        Workload("mixed 2048 on 8k + 128 decode ctx 1k..8k",
                 base.replace(query_lens=(2048,) + (1,) * 128, context_lens=(8192,) + _spread(128, 1024, 8192))),
        Workload("decode 256x ctx 4k", base.replace(query_lens=(1,) * 256, context_lens=(4096,) * 256),
                 memory_bound=True),
        Workload("speculative 128x4 ctx 1k..8k", base.replace(query_lens=(4,) * 128,
                                                              context_lens=_spread(128, 1024, 8192)),
                 memory_bound=True),
        Workload("D64 32/32 heads prefix-cached", prefix.replace(head_size=64, num_kv_heads=32)),
        Workload("D256 16/8 heads prefix-cached", prefix.replace(head_size=256, num_heads=16)),
        Workload("FP8 e4m3 KV prefix-cached", prefix.replace(kv_cache_dtype="fp8_e4m3")),
        Workload("FP8 query e4m3 KV prefix-cached", prefix.replace(kv_cache_dtype="fp8_e4m3", fp8_query=True)),
        *long_context_engine_rows(base),
    ]


def long_context_engine_rows(base: BatchSpec) -> list[Workload]:
    """The engine suite's few sequences on long contexts (``base``: their shapes): rows that give the device
    few programs unless a kernel splits the keys."""
    return [
        Workload("decode 4x ctx 128k", base.replace(query_lens=(1,) * 4, context_lens=(131072,) * 4),
                 memory_bound=True),
        Workload("decode 16x ctx 32k", base.replace(query_lens=(1,) * 16, context_lens=(32768,) * 16),
                 memory_bound=True),
        Workload("speculative 2x8 on 64k", base.replace(query_lens=(8,) * 2, context_lens=(65536,) * 2),
                 memory_bound=True),
        Workload("chunk 256 on 128k", base.replace(query_lens=(256,), context_lens=(131072,))),
    ]


@dataclass(frozen=True)
class ModelHeads:
    """A model's attention shape: query heads, KV heads and head size over all its GPUs, and the tensor-parallel
    degrees it is commonly served at."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)

    def per_gpu(self, tp: int) -> tuple[int, int]:
        """``(query heads, KV heads)`` one GPU holds at tensor-parallel degree ``tp``: the heads divided among the
        GPUs, and a KV head replicated on each GPU whose query heads it serves when there are fewer KV heads than
        GPUs (as serving engines shard them)."""
        if self.num_heads % tp:
            raise ValueError(f"tp: {self.name}'s {self.num_heads} query heads do not divide among {tp} GPUs")
        return self.num_heads // tp, max(1, self.num_kv_heads // tp)


#: The models of the ``models`` suite (their attention shapes only; no weights are involved).
MODELS = (
    ModelHeads("Llama-3-8B", 32, 8, 128),
    ModelHeads("Llama-3-70B", 64, 8, 128),
    ModelHeads("Llama-3.2-3B", 24, 8, 128),
    ModelHeads("Qwen2.5-7B", 28, 4, 128, (1, 2, 4)),
    ModelHeads("Qwen2-1.5B", 12, 2, 128, (1, 2)),
    ModelHeads("Qwen2.5-14B/32B", 40, 8, 128),
    ModelHeads("Gemma-2-9B", 16, 8, 256),
    ModelHeads("Phi-3-mini", 32, 32, 96),
    ModelHeads("Llama-2-7B", 32, 32, 128),  # MHA at head size 128: Phi-3-mini's heads without the padding
    ModelHeads("Falcon-7B", 71, 1, 64, (1,)),
)


def model_shards() -> list[tuple[str, int, int, int]]:
    """``(label, query heads, KV heads, head size)`` for every model of :data:`MODELS` at each of its
    tensor-parallel degrees, one GPU's share; a shape two shards share appears once, under the first label."""
    seen, out = set(), []
    for model in MODELS:
        for tp in model.tensor_parallel:
            heads, kv_heads = model.per_gpu(tp)
            if (heads, kv_heads, model.head_size) in seen:
                continue
            seen.add((heads, kv_heads, model.head_size))
            out.append((f"{model.name} TP{tp}", heads, kv_heads, model.head_size))
    return out


def models_suite() -> list[Workload]:
    """One GPU's share of each model's heads (:func:`model_shards`: Llama-3 8B and 70B, Llama-3.2-3B, Qwen2.5
    7B and 14B/32B, Qwen2-1.5B, Gemma-2-9B at head size 256, Phi-3-mini at 96, Llama-2-7B's MHA at 128,
    Falcon-7B's MQA at 64, at tensor-parallel degrees 1 to 8), each as a prefix-cached prefill, a chunked
    prefill and a decode step, bf16, pages of 16. Row names start with the shard (``"Llama-3-70B TP8 8/1
    ..."``), so that ``--only`` picks a model, a degree or a head shape."""
    out = []
    for label, heads, kv_heads, head_size in model_shards():
        base = BatchSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                         dtype=torch.bfloat16, spare_blocks=0)
        name = f"{label} {heads}/{kv_heads} D{head_size}"
        out += [
            Workload(f"{name} prefix-cached 8x(1024+7168)", base.replace(query_lens=(1024,) * 8,
                                                                          context_lens=(7168,) * 8)),
            Workload(f"{name} chunked 4x2048 ctx 0..30k", base.replace(query_lens=(2048,) * 4,
                                                                      context_lens=(0, 10000, 20000, 30000))),
            Workload(f"{name} decode 128x ctx 2k", base.replace(query_lens=(1,) * 128, context_lens=(2048,) * 128),
                     memory_bound=True),
        ]
    return out


#: The suites ``pagedprefill bench --suite`` runs, by name.
SUITES = {"default": default_suite, "context": context_suite, "engine": engine_suite, "models": models_suite}


def attended_pairs(spec: BatchSpec) -> int:
    """Exact number of (query, key) pairs the batch attends to (causal, window)."""
    total = 0
    w = spec.sliding_window or 0
    for q, c in zip(spec.query_lens, spec.context_lens):
        for_all = q * c + q * (q + 1) // 2  # every query sees the prefix plus itself and earlier new tokens
        if w > 0:
            # query at position p sees keys max(0, p - w + 1) .. p: min(p + 1, w) keys
            first, last = c, c + q - 1
            full_until = min(last, w - 1)  # positions p <= w - 1 see p + 1 keys
            n_small = max(0, full_until - first + 1)
            small = (first + 1 + full_until + 1) * n_small // 2 if n_small else 0
            for_all = small + (q - n_small) * w
        total += for_all
    return total


def flops(spec: BatchSpec) -> float:
    """FLOPs of the batch: ``4 * D * H * attended (query, key) pairs``."""
    return 4.0 * spec.head_size * spec.num_heads * attended_pairs(spec)


def kv_bytes(spec: BatchSpec) -> int:
    """Bytes of keys and values a call must read, in the cache's storage dtype: each sequence's keys and
    values once, ``2 * Hkv * D * element size`` per token, for its context and new tokens (only the keys a
    window leaves visible to some query; none for a sequence with no new token, or one that ``skip_decode``
    leaves out)."""
    fp8 = KVCacheDType.parse(spec.kv_cache_dtype).is_fp8
    element = 1 if fp8 else spec.dtype.itemsize
    tokens = 0
    for q, c in zip(spec.query_lens, spec.context_lens):
        if q == 0 or (spec.skip_decode and q == 1):
            continue
        # the union of the queries' windows: positions max(0, c - w + 1) .. c + q - 1
        tokens += min(c + q, q + spec.sliding_window - 1) if spec.sliding_window else c + q
    return 2 * spec.num_kv_heads * spec.head_size * element * tokens
