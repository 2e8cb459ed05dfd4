"""Host side of the Hopper kernel: whether a call fits it, its TMA descriptors, and one launch.

The policy chooses the kernel from what a call looks like (:func:`shape_unfit_reason`); a few properties
only the tensors know (strides that a 2-D TMA view needs, 16-byte alignment) are checked per call signature
by :func:`unfit_reason`, and a call that fails them runs on the portable kernel with the same tile.
Like core's launcher, nothing here synchronises with the device or allocates.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
from pagedprefill.accelerator import device_guard
from pagedprefill.cache import as_stored_type
from pagedprefill.tiling import ProblemShape, TileConfig, launch_grid
from pagedprefill.triton.blocks import LOG2E
from pagedprefill.triton.launch import FP8_E4M3_MAX, BoundLaunch, KernelCall, _scale_arg
from pagedprefill.types import KVLayout, PrefillProblem

from ..policy import hopper_schedule
from .encoded import EncodedLauncher

#: Head sizes the kernel is built for: powers of two (its register tensors need them), and in the NHD layout the
#: sizes of :data:`PADDED_HEADS`.
HEAD_SIZES = (64, 96, 128, 256)
#: Head sizes run on a tile of the next power of two (NHD): rank-3 TMA boxes read the columns past the head as
#: zeros, the queries' too, so those columns add nothing to the scores, and they are not stored.
PADDED_HEADS = {96: 128}
#: TMA coordinates are 32-bit.
MAX_ROWS = 2**31 - 1
#: FP8 cache formats the kernel reads: widened to the input dtype exactly, scales folded.
FP8_CACHES = ("fp8_e4m3", "fp8_e5m2")


def shared_bytes(shape: ProblemShape, config: TileConfig, schedule: Optional[dict] = None) -> int:
    """Bytes of shared memory the kernel allocates for calls of ``shape`` with ``config``: the Q tile, the K/V
    ring, the split layout's ring of V^T pages, an FP8 cache's own ring and each consumer's widened copies, and
    1 KiB for the barriers (they take about 0.3 KiB). Within that margin of what Triton allocated for every
    policy tile of the bench suite (``ci/codegen_report.py``: 160.2 KiB for 128 x 128 keys in 2 stages at head
    size 128 on NHD, 224.3 KiB on split, 192.2 KiB for head size 256 on 128 x 64 in 2 stages). ``schedule``:
    the flags it is compiled with (default :data:`SCHEDULE`; :func:`resolve_schedule`)."""
    schedule = resolve_schedule(shape, config, schedule)
    d = PADDED_HEADS.get(shape.head_size, shape.head_size)
    tile = config.block_n * d * 2  # one K or V tile in the input's 16-bit type
    total = config.block_m * d * 2 + config.num_stages * 2 * tile
    if shape.layout == "split" and not (schedule["NEW_VALUES_T"] or schedule["WIDEN_TO_V"]):
        total += config.num_stages * tile  # the new tokens' V ring beside the cached values' V^T ring
    if shape.kv_cache_dtype != "auto":
        consumers = 0 if schedule["PRODUCER_WIDENS"] else 2 if schedule["PINGPONG"] else 1
        total += config.num_stages * 2 * config.block_n * d + consumers * 2 * tile
    return total + 1024


def shape_unfit_reason(shape: ProblemShape, config: TileConfig, max_shared: Optional[int] = None) -> Optional[str]:
    """Why the Hopper kernel cannot take calls of this shape with this tile, or None when it can. With
    ``max_shared`` (the device's shared memory per block, bytes) the tile must also fit in it
    (:func:`shared_bytes`)."""
    if shape.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 inputs, not {shape.dtype}"
    if shape.layout not in ("nhd", "split"):
        return f"reads the NHD and split cache layouts, not {shape.layout!r}"
    if shape.kv_cache_dtype not in ("auto", *FP8_CACHES):
        return f"reads caches in the input dtype or {' or '.join(FP8_CACHES)}, not {shape.kv_cache_dtype!r}"
    if shape.kv_cache_dtype != "auto" and shape.head_size > 128:
        return f"reads an FP8 cache for head sizes up to 128 only (its FP8 ring takes shared memory), not head " \
               f"size {shape.head_size}"
    if shape.head_size not in HEAD_SIZES:
        return f"is built for head sizes {HEAD_SIZES}, not {shape.head_size}"
    schedule = resolve_schedule(shape, config)
    if shape.layout == "split" and shape.head_size > 128 and not schedule["NEW_VALUES_T"] and config.block_n > 32:
        return f"reads the split layout at head size {shape.head_size} with up to 32 keys per step (its V^T ring " \
               f"takes shared memory; the NEW_VALUES_T schedule makes room for more), not block_n={config.block_n}"
    page, block_n = shape.block_size, config.block_n
    smallest = 16 if shape.layout == "split" else 8  # a V^T page box is at least one 32-byte swizzle atom wide
    if page < smallest or page & (page - 1) or not (block_n % page == 0 or page % block_n == 0):
        return f"needs a power-of-two block size >= {smallest} that divides or is a multiple of " \
               f"block_n={block_n}, not {page}"
    if config.block_m != 16 * config.num_warps:
        return f"needs block_m = 16 x num_warps (one MMA row band per warp), not {config.block_m} with " \
               f"{config.num_warps} warps"
    if max_shared is not None and shared_bytes(shape, config) > max_shared:
        return f"needs {shared_bytes(shape, config)} bytes of shared memory with block_n={config.block_n} and " \
               f"num_stages={config.num_stages}, the device has {max_shared} per block"
    return None


def _tma_2d(t: torch.Tensor, rows_dim: int, cols_dims: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """``(rows, row stride)`` of ``t`` seen as a 2-D matrix whose rows are ``rows_dim`` (and the dims before
    it, when they are row-contiguous) and whose columns are ``cols_dims`` (contiguous), or None when the
    strides do not allow that view or TMA cannot address it (16-byte aligned rows and base)."""
    inner = 1
    for d in reversed(cols_dims):
        if t.stride(d) != inner:
            return None
        inner *= t.shape[d]
    rows, row_stride = t.shape[rows_dim], t.stride(rows_dim)
    for d in range(rows_dim - 1, -1, -1):
        if t.stride(d) != t.shape[d + 1] * t.stride(d + 1) and t.shape[d] > 1:
            return None
        rows *= t.shape[d]
    if (row_stride * t.element_size()) % 16 or t.data_ptr() % 16 or rows > MAX_ROWS:
        return None
    return rows, row_stride


def _split_keys_fit(key: torch.Tensor) -> bool:
    """Whether split-layout keys ``[blocks, Hkv, D / x, block, x]`` can be copied 16 bytes at a time: ``x``
    fills 16 bytes, contiguous, and every other stride and the base keep that alignment."""
    x = key.shape[4]
    return (x * key.element_size() == 16 and key.stride(4) == 1 and key.stride(3) == x
            and all(key.stride(d) % x == 0 for d in range(3)) and key.data_ptr() % 16 == 0)


def unfit_reason(problem: PrefillProblem, config: TileConfig) -> Optional[str]:
    """Why the Hopper kernel cannot take ``problem`` (tensor strides and alignment), or None when it can."""
    c = problem.cache
    if c.layout is KVLayout.SPLIT:
        if not _split_keys_fit(c.key):
            return "key_cache: needs x = 16 bytes of elements, contiguous, and 16-byte aligned strides"
        if _tma_2d(c.value, 2, (3,)) is None:
            return "value_cache: needs each page's [head, d] rows of slots contiguous, 16-byte aligned"
    else:
        for name, t in (("key_cache", c.key), ("value_cache", c.value)):
            if _tma_2d(t, 1, (2, 3)) is None:
                return f"{name}: needs [blocks, slots] rows of contiguous heads, 16-byte aligned"
    if problem.k is not None:
        for name, t in (("k", problem.k), ("v", problem.v)):
            if _tma_2d(t, 0, (1, 2)) is None:
                return f"{name}: needs rows of contiguous heads, 16-byte aligned"
    for name, t in (("q", problem.q), ("out", problem.out)):
        if t.stride(2) != 1:
            return f"{name}: needs a contiguous head dim"
    return None


def _gluon_dtype(dtype: torch.dtype):
    """The Gluon element type of a torch dtype the kernel's descriptors take."""
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
            torch.float8_e5m2: gl.float8e5}[dtype]


def _descriptor(t: torch.Tensor, rows_dim: int, cols_dims: tuple[int, ...], box: list[int], swizzle=None):
    """A TMA descriptor over ``t`` seen as a 2-D matrix (:func:`_tma_2d`), copying ``box`` at a time into
    the shared layout of that box (or one of ``swizzle`` bytes). A ``box`` of three sizes ``[rows, 1, width]``
    takes the last two of ``cols_dims`` as ``[heads, head size]`` instead (a rank-3 view, for padded heads)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, row_stride = _tma_2d(t, rows_dim, cols_dims)
    dtype = _gluon_dtype(t.dtype)
    if len(box) == 3:
        heads, head_size = t.shape[cols_dims[-2]], t.shape[cols_dims[-1]]
        layout = gl.NVMMASharedLayout.get_default_for([box[0], box[2]], dtype)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                      element_bitwidth=8 * t.element_size(), rank=3)
        return TensorDescriptor(t, [rows, heads, head_size], [row_stride, t.stride(cols_dims[-2]), 1], box, layout)
    cols = math.prod(t.shape[d] for d in cols_dims)
    if swizzle is None:
        layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    else:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * t.element_size(), rank=2)
    return TensorDescriptor(t, [rows, cols], [row_stride, 1], box, layout)


def _value_pages_descriptor(value: torch.Tensor, width: int, box: int, swizzle: int):
    """A TMA descriptor over the split layout's values ``[blocks, Hkv, D, PAGE]`` seen as ``[blocks x Hkv, D,
    PAGE]``, copying ``[1, width, box]`` at a time: with ``width`` > ``D`` (a padded head) the rows past the head
    lie outside the view and arrive as zeros."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, row_stride = _tma_2d(value, 2, (3,))
    d = value.shape[2]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * value.element_size(), rank=3)
    return TensorDescriptor(value, [rows // d, d, value.shape[3]], [d * row_stride, row_stride, 1], [1, width, box],
                            layout)


def _key_pages_fit(key: torch.Tensor) -> bool:
    """Whether :func:`_key_pages_descriptor` can describe the split layout's keys ``key``."""
    return _tma_2d(key, 3, (4,)) is not None


def _key_pages_descriptor(key: torch.Tensor, box: int):
    """A TMA descriptor over the split layout's keys ``[blocks, Hkv, D / x, PAGE, x]`` (contiguous from the
    block dimension in) seen as ``[blocks x Hkv x D / x, PAGE, x]``, copying ``[D / x, box, x]`` at a time: the
    ``box`` slots of a page's keys of one head, every 16-byte column of them, in one unswizzled box."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, x = _tma_2d(key, 3, (4,))
    page, columns = key.shape[3], key.shape[2]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * key.element_size(), rank=3)
    return TensorDescriptor(key, [rows // page, page, x], [page * x, x, 1], [columns, box, x], layout)


def call_tensors(p: PrefillProblem, config: TileConfig, schedule: dict) -> tuple:
    """The kernel's tensor arguments (TMA descriptors for K/V) in signature order; placeholders (an
    argument of the same kind that the kernel does not read) where a layout or feature does not use one.
    ``schedule`` (resolved, :func:`resolve_schedule`): under ``FP8_BOXES`` the split layout's FP8 key cache is
    described too, by pages (:func:`_key_pages_descriptor`)."""
    c = p.cache
    D = p.head_size
    box = min(c.block_size, config.block_n)
    width = PADDED_HEADS.get(D, D)

    def rows_of(n: int) -> list[int]:  # a box of n rows of one head
        return [n, width] if width == D else [n, 1, width]

    if c.layout is KVLayout.SPLIT:
        # [blocks, Hkv, D, block]: rows of slots; a page of one head is D consecutive rows. An FP8 cache's
        # values come by 16-byte copies instead: its descriptor only names their type (a box of 16 FP8 slots
        # is narrower than the narrowest swizzle, 32 bytes: unswizzled).
        value = as_stored_type(c.value, c.dtype)
        swizzle = min(128, box * value.element_size())
        swizzle = swizzle if swizzle >= 32 else 0
        if width == D:
            v_cache_t = _descriptor(value, 2, (3,), [D, box], swizzle=swizzle)
        else:  # a padded head: boxes of the tile's width from the rank-3 view, zeros past the head
            v_cache_t = _value_pages_descriptor(value, width, box, swizzle)
        k_cache = v_cache = v_cache_t
        if schedule["FP8_BOXES"]:
            # [blocks, Hkv, D / x, block, x]: a page's keys of one head are D / x contiguous [block, x] blocks of
            # 16 bytes' width, together one unswizzled box.
            key = as_stored_type(c.key, c.dtype)
            if not _key_pages_fit(key):
                raise ValueError("FP8_BOXES: key_cache must be contiguous from its block dimension in, 16-byte "
                                 f"aligned, with at most {MAX_ROWS} rows of x elements; got strides "
                                 f"{tuple(c.key.stride())} for shape {tuple(c.key.shape)}")
            k_cache = _key_pages_descriptor(key, box)
    else:
        # FP8 caches hold bytes: described as the FP8 type they store, which the kernel widens.
        key, value = as_stored_type(c.key, c.dtype), as_stored_type(c.value, c.dtype)
        k_cache = _descriptor(key, 1, (2, 3), rows_of(box))
        v_cache = _descriptor(value, 1, (2, 3), rows_of(box))
        v_cache_t = v_cache
    if p.k is None:
        k_new, v_new = k_cache, v_cache  # unused: the new tokens' K/V are read from the cache
    else:
        k_new = _descriptor(p.k, 0, (1, 2), rows_of(config.block_n))
        v_new = _descriptor(p.v, 0, (1, 2), rows_of(config.block_n))
    args = _plain_tensors(p)
    args[DESCRIPTORS] = [k_cache, v_cache, k_new, v_new, v_cache_t]
    return tuple(args)


#: Where the TMA descriptors sit among the kernel's tensor arguments (:func:`_plain_tensors`).
DESCRIPTORS = slice(2, 7)


def _plain_tensors(p: PrefillProblem) -> list:
    """The kernel's tensor arguments in signature order, with ``None`` at :data:`DESCRIPTORS`."""
    c, o, b = p.cache, p.options, p.batch
    q = p.q
    out_scale = o.fp8_out_scale
    split = c.layout is KVLayout.SPLIT
    # Split keys are copied, not described, and split values too under VT_COPIES or from an FP8 cache (as the
    # FP8 type it stores, which the kernel widens).
    keys = as_stored_type(c.key, c.dtype) if split else q
    values = as_stored_type(c.value, c.dtype) if split else q
    fp8 = c.dtype.is_fp8
    k_scale = c.k_scale if fp8 and isinstance(c.k_scale, torch.Tensor) else q
    v_scale = c.v_scale if fp8 and isinstance(c.v_scale, torch.Tensor) else q
    new_values = q if p.v is None else p.v  # read by the producer's loads under NEW_VALUES_T
    return [q, p.out, None, None, None, None, None, keys, values, new_values, b.block_table, b.query_start,
            b.seq_lens, b.context_lens, q if o.alibi_slopes is None else o.alibi_slopes,
            q if o.sinks is None else o.sinks, out_scale if isinstance(out_scale, torch.Tensor) else q, k_scale,
            v_scale]


#: How the kernel schedules its work (constexprs of the kernel). ``HEAVY_FIRST`` runs each sequence's last
#: query tiles first. ``PINGPONG`` gives each consumer warpgroup a partition of its own (tiles of 8 warps
#: only), so that one's softmax runs while the other's MMAs do. ``TURNS`` makes those two issue their Q K^T in
#: alternation, and ``OVERLAP`` issues each tile's Q K^T together with the previous tile's P V (as an
#: asynchronous MMA) so that the softmax runs under it. ``VT_COPIES`` (split layout) has the producer copy the
#: cached values 16 bytes at a time into V^T in the MMA's 128-byte swizzle, instead of one TMA box per page,
#: whose 32-byte swizzle (a page of 16 slots is 32 bytes wide) is what the P V MMA then reads. ``WIDE_PRODUCER``
#: (split layout) makes the producer a warpgroup, so that four warps share the 16-byte copies of the cached keys
#: (and of the values under ``VT_COPIES``) that one warp issues otherwise; the consumers then hold
#: :data:`WIDE_CONSUMER_REGS` registers each. ``PRODUCER_WIDENS`` (FP8 cache) has a
#: producer warpgroup widen each cached tile once into the 16-bit ring, up to a ring's depth ahead of the
#: consumers, instead of each consumer widening its own copy before its MMAs (registers as ``WIDE_PRODUCER``,
#: with :data:`WIDENING_PRODUCER_REGS` for the producer). ``KEY_LOADS`` (split layout, at least 32 keys per step)
#: has a producer warpgroup read the cached keys with 16-byte loads and store them into the K ring, 32 keys at a
#: time, instead of 16-byte asynchronous copies: on the H200 each such copy was an L2 request of its own, and the
#: split prefix-cached row ran at 80% of the L2's request rate with the bytes at the NHD row's level
#: (docs/performance.md, run 9); loads are merged into one request per 128-byte line (registers as
#: ``PRODUCER_WIDENS``). ``VALUES_FIRST`` (with ``KEY_LOADS``, a 16-bit cache and value boxes) issues a cached
#: tile's value boxes before its keys are loaded, so that they land meanwhile. Run 10 (H200): both passed sm80's
#: suite under them (374 passed) and ``hopper_check.py`` (44 of 44); together they were 1.01-1.23 x the copies on
#: the split rows at head sizes 128 and 256 and 0.82-0.98 x on the others, so the policy sets them for those
#: routes only (:func:`pagedprefill_sm80.policy.hopper_schedule`) and they stay off here. ``WIDE_KEY_CHUNKS``
#: (with ``KEY_LOADS``, a 16-bit cache and tiles of more than 64 keys) loads 64 keys per chunk instead of 32, so
#: that a whole 128-key tile is in flight: under the profiler the split prefix-cached row's largest stall was
#: then the producer's wait on its own loads (run 10). Its producer holds more registers
#: (:data:`WIDE_CHUNK_PRODUCER_REGS`). Run 11 (H200): it passed ``hopper_check.py`` (44 of 44) and sm80's suite,
#: and was 1.09-1.18 x on the split rows of 128-key tiles; the policy sets it there, with the two above, and
#: at head sizes 64 and 96 too (:func:`pagedprefill_sm80.policy.hopper_schedule`).
#: ``EARLY_KEYS`` (with ``KEY_LOADS``, a 16-bit cache and tiles of one or two chunks: every route the policy gives
#: the key loads) loads each cached tile's keys into the producer's registers before it waits for the tile's
#: buffer, instead of after: their latency then passes while the consumers still hold the buffer (in run 11's
#: profile the split rows' producer still waited on its loads, 1.8 of 8.4 cycles). The registers are those of
#: the two chunks it holds anyway. Run 12 (H200): it passed ``hopper_check.py`` (44 of 44) and sm80's suite, and
#: was 1.03-1.09 x on the split rows of head sizes 64-128 and 0.985 x at head size 256; the policy sets it at
#: the former (:func:`pagedprefill_sm80.policy.hopper_schedule`).
#: ``F32_WIDENING`` (with ``PRODUCER_WIDENS``, a bfloat16 call) widens FP8 tiles through float32: the direct
#: FP8-to-bfloat16 conversion compiles for sm90 to one scalar float16-to-bfloat16 conversion per element (256 per
#: producer thread per 128-key tile at head size 128), on the pipe the consumers' exponentials take; through
#: float32 they become packed float32 additions and conversions (the same count, no scalar conversion left).
#: Bit-identical results (every step is exact). Run 13 (H200): it passed ``hopper_check.py`` (44 of 44) and ran the
#: FP8 prefix-cached row at 1.50 x (NHD, 458.5 vs 305.2 TFLOP/s) and 1.26 x (split, 314.2 vs 248.7); under the
#: profiler the special-function pipe's load fell from 47% to 25% and the tensor pipe's rose from 33% to 49%: on.
#: ``THREAD_ARRIVALS`` (not with the consumers' own FP8 widening) hands each ring buffer back by one arrival per
#: consumer thread instead of a barrier among the consumer's warps and one thread's arrival: one warp barrier
#: less per key tile and consumer in the sm90 code. Run 13 (H200): 42 of ``hopper_check.py``'s 44 cases passed
#: before the step's limit (none failed), and the timings were level (0.97-1.02 x on the long prefill,
#: prefix-cached, window and D64 rows): the loop's other barrier remains, which Triton 3.6 places before every
#: mbarrier wait in a loop (ci/mbarrier_wait_barriers.py). Off.
#: ``NEW_VALUES_T`` (split layout, 16-bit cache): the producer warpgroup loads the new tokens'
#: values and stores them transposed into the V^T ring (each thread an 8 x 8 block, transposed in its registers:
#: 16-byte loads and 16-byte stores), so the split layout has two rings like NHD instead of three. That makes
#: room for 64 keys per step at head size 256 (192 KiB in 2 stages, against 32 keys beside three rings) and for a
#: third stage of 128 keys at head size 128 (224 KiB). Compiled for sm90: no spills at head size 256 (64 keys in
#: 2 stages) or 64; at head sizes 96 and 128 (128-key tiles, whose producer also holds two 64-key chunks of key
#: loads) its producer spills 24 bytes. Run 14 (H200): it passed ``hopper_check.py`` (44 of 44) and, on 64-key
#: tiles in 2 stages, the forced-Hopper conformance class (79 passed). At head size 256 on 64-key tiles it ran the
#: split prefix-cached row at 1.09 x (447.5 vs 411.9 TFLOP/s), chunked 1.05 x, many short 1.06 x, but the window
#: row at 0.88 x and the long prefill at 0.52 x (247.3 vs 472.0); at head size 128, 0.52-0.94 x. The producer's
#: loads of the new tokens' values bound every tile of new tokens, and a shape does not tell the policy how much
#: of a call is cached: off. Since then each chunk's loads go out before the previous chunk is stored (its four
#: chunks at head size 256 waited for their loads one after another), with 96 registers for the producer and 208
#: for the consumers (no spills at head size 256 on 64 keys). Run 15: it passed ``hopper_check.py`` (44 of 44), and
#: at head size 256 on 64 keys in 2 stages it still halves the long prefill (268.6 vs 472.5 TFLOP/s; prefix-cached
#: 452.4 vs 423.4, chunked 457.1 vs 434.7, window 392.2 vs 435.9): off.
#: ``FP8_BOXES`` (split layout, FP8 cache, head sizes 64 and 128) brings the cached keys and values into the FP8
#: ring by unswizzled TMA boxes instead of 16-byte asynchronous copies, each an L2 request of its own (in run 13's
#: profile the split FP8 row made 6 x the NHD row's L2 requests): a head's page of values is one contiguous
#: ``[D, block]`` block, its keys ``D / 16`` contiguous ``[block, 16]`` blocks, together one ``[D / 16, block, 16]``
#: box. Each box lands on a whole block of the FP8 ring (the pages one after another), which the producer's
#: widening reads in that order. A 16-bit K tile cannot be read that way by Triton 3.6's warpgroup MMA ("Failed to
#: find a valid layout" for an unswizzled K), so the 16-bit split layout keeps its key loads. A key cache that is
#: not contiguous from its block dimension in takes the copies (:func:`kernel_call`). Run 14 (H200): boxes into
#: 16-byte column slices of a row-major tile faulted (a TMA destination must be contiguous and 128-byte aligned);
#: the page boxes passed ``hopper_check.py`` (44 of 44) and the forced-Hopper conformance class (79 passed), and ran
#: the split FP8 row at 1.16 x (365.0 vs 313.9 TFLOP/s; 1.20 x with 32-slot pages, level at head size 64): the
#: policy's choice for the split layout's FP8 cache (:func:`pagedprefill_sm80.policy.hopper_schedule`).
#: ``WIDEN_TO_V`` (split layout, FP8 cache) has the producer widen the cached values (V^T pages in FP8) into the
#: V ring, transposed, where the new tokens' values land, instead of into a V^T ring of their own: the split
#: layout's FP8 cache then has the NHD layout's rings, and 128-key tiles in 2 stages fit (224 KiB, against 289
#: KiB beside a V^T ring; its tiles are 64 keys since run 9). Each producer thread loads four consecutive head
#: rows of 16 slots and stores four consecutive elements of a V row at a time. The consumers' P V MMA no longer
#: depends on which ring a tile is in, so it runs asynchronously as in NHD. Run 15 (H200): it passed
#: ``hopper_check.py`` (44 of 44) and the forced-Hopper conformance class on 128 keys in 2 stages (79 passed); on
#: the split FP8 row 128 keys in 2 stages ran at 1.03 x the page boxes' 64 keys without it (374.5 vs 365.1
#: TFLOP/s; 1.02 x with 32-slot pages, 420.6 vs 413.2), 64 keys with it at 0.94 x (343.8): the policy's choice on
#: 128-key tiles (:func:`pagedprefill_sm80.policy.hopper_schedule`). A key cache that the page boxes cannot describe
#: takes the copies on that tile, whose producer spills 24 bytes at head size 128.
#: Run 15 (H200): computing every other (or every fourth) key's exponential by a cubic and an exponent-bit add on
#: the FMA pipe instead of the special-function unit passed ``hopper_check.py`` (44 of 44) and was slower on the D64
#: row, 0.70 x on NHD (270.9 vs 384.9 TFLOP/s) and 0.84 x on split for half, 0.87 x and 0.95 x for a quarter: the
#: cubic's instructions cost the consumers more issue slots than the special-function unit's queue did. Removed.
#: ``FUSED_SCALE`` takes issue slots away instead: without softcap and ALiBi, the consumers take each row's maximum
#: on the raw scores and scale it once, and each key's scale and subtraction of the maximum are one fused
#: multiply-add (the scale is positive, so the maximum is the same one; at head size 64, 252 fewer multiplies and
#: 256 adds turned into fused multiply-adds per consumer thread). Run 16 (H200): it passed ``hopper_check.py`` (44
#: of 44) and was 1.01-1.15 x on every row timed (head size 64 NHD 436.7 vs 378.5 TFLOP/s, split 358.1 vs 342.9;
#: long prefill split 537.3 vs 504.0): on. Reducing each row's maximum and sum by a tree over its groups of 8 keys
#: instead of Triton's chain through every key a thread holds (the longest dependent ``FMNMX`` chain 66 to 9 at
#: head size 64, as many instructions) passed too but ran at 0.97-1.01 x alone and below ``FUSED_SCALE`` alone
#: with it: removed.
#: Run 7 (H200, docs/performance.md): ``PRODUCER_WIDENS`` passed hopper_check.py's 37 cases and was 1.12 x the
#: consumers widening their own copies on the FP8 row (266.9 vs 238.6 TFLOP/s): on by default.
#: ``WIDE_PRODUCER`` passed them too and was 0.97 x (355.1 vs 365.8 on the split prefix-cached row): off, but for
#: the split layout at head size 256, where one producer warp spills its copy addresses (:func:`kernel_call`).
#: A schedule that kept the cached tiles' V^T and the new tokens' V in one ring (a stage holding one or the other)
#: gave wrong results and an illegal-address fault on the split cases in run 7, although its PTX differed from
#: the passing two-ring kernel's only in where the rings and the Q tile sat: removed (the split layout at head
#: size 256 takes 32 keys per step beside its V^T ring instead).
#: On the H200 (docs/performance.md, runs 3 and 4; ci/gpu/hopper_check.py, 4 bench workloads x 2 layouts):
#: heavy-first was at least as fast as index order on every row; ping-pong was 1.00-1.21 x the lockstep loop
#: and 1.24-1.49 x the portable kernel, the fastest schedule on every NHD row and within 1.3% of ``TURNS`` on
#: the split rows, and passed the 29 checks of hopper_check.py and sm80's conformance suite with the kernel
#: forced; ``TURNS`` was 3-10% slower on NHD; ``OVERLAP`` gave NaN on NHD then (P was overwritten while its
#: P V ran; fixed since). Run 12: ``OVERLAP`` passed ``hopper_check.py`` (44 of 44) and ran every row it changes
#: at 0.58-0.93 x the policy's schedule; on the split layout's 128-key tiles it spills (32 bytes; 320 with ``TURNS``).
SCHEDULE = dict(HEAVY_FIRST=True, PINGPONG=True, TURNS=False, OVERLAP=False, VT_COPIES=False, WIDE_PRODUCER=False,
                PRODUCER_WIDENS=True, KEY_LOADS=False, VALUES_FIRST=False, WIDE_KEY_CHUNKS=False,
                EARLY_KEYS=False, F32_WIDENING=True, THREAD_ARRIVALS=False,
                NEW_VALUES_T=False, FP8_BOXES=False, WIDEN_TO_V=False, FUSED_SCALE=True)
#: Registers per thread of the second consumer partition under ``PINGPONG`` (the first, the kernel's default
#: partition, keeps what the others leave).
CONSUMER_REGS = 240
#: Registers per thread of a producer warpgroup (``WIDE_PRODUCER``: a quarter of the copy addresses per lane) and
#: of the consumers beside it: 128 x 56 + 256 x 224 = 64,512 of the SM's 65,536.
WIDE_PRODUCER_REGS = 56
WIDE_CONSUMER_REGS = 224
#: A producer warpgroup that also widens FP8 tiles holds a 16-byte slice of each: 128 x 80 + 256 x 216 = 65,536.
WIDENING_PRODUCER_REGS = 80
WIDENING_CONSUMER_REGS = 216
#: One whose key loads take 64 keys per chunk (``WIDE_KEY_CHUNKS``) holds two chunks of 64 registers' worth:
#: 128 x 112 + 256 x 200 = 65,536.
WIDE_CHUNK_PRODUCER_REGS = 112
WIDE_CHUNK_CONSUMER_REGS = 200
#: One that also stores the new tokens' values transposed (``NEW_VALUES_T``) holds the next chunk of them while it
#: stores one: 128 x 96 + 256 x 208 = 65,536.
NEW_VALUES_PRODUCER_REGS = 96
NEW_VALUES_CONSUMER_REGS = 208
#: Keys per chunk of the producer's key loads (``KEY_LOADS``), and under ``WIDE_KEY_CHUNKS``.
KEY_CHUNK, WIDE_KEY_CHUNK = 32, 64


#: Schedule flags read from the environment at each bind (``"KEY_LOADS=1"``), over :data:`SCHEDULE` and under a
#: caller's own: for running a whole suite or the bench under a schedule that is not the default yet. Plans
#: bound before it changed keep the flags they were bound with.
SCHEDULE_ENV = "PAGEDPREFILL_SM80_SCHEDULE"


def parse_schedule(text: str) -> dict:
    """Schedule flags written as ``"PINGPONG=1,TURNS=0"`` (for measurement and test runs), checked against
    :data:`SCHEDULE`'s names."""
    flags = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in SCHEDULE or value not in ("0", "1"):
            raise ValueError(f"schedule: expected NAME=0 or NAME=1 with NAME one of {', '.join(SCHEDULE)}, "
                             f"got {item!r}")
        flags[name] = value == "1"
    return flags


def resolve_schedule(shape: ProblemShape, config: TileConfig, schedule: Optional[dict] = None) -> dict:
    """The flags calls of ``shape`` with ``config`` are compiled with: :data:`SCHEDULE` updated by the policy's
    flags for the route (:func:`pagedprefill_sm80.policy.hopper_schedule`), then by :data:`SCHEDULE_ENV` and
    then by ``schedule``, less what does not apply to them and plus what they always take. The launch and the
    shared-memory model both read it."""
    try:
        from_env = parse_schedule(os.environ.get(SCHEDULE_ENV, ""))
    except ValueError as exc:
        raise ValueError(f"{SCHEDULE_ENV}: {exc}") from None
    schedule = {**SCHEDULE, **hopper_schedule(shape, config.block_n), **from_env, **(schedule or {})}
    split, fp8 = shape.layout == "split", shape.kv_cache_dtype != "auto"
    # Two consumer partitions need two warpgroups' worth of rows.
    schedule["PINGPONG"] = bool(schedule["PINGPONG"]) and config.num_warps == 8
    schedule["TURNS"] = bool(schedule["TURNS"]) and schedule["PINGPONG"]
    # FP8 tiles are widened before their MMAs: the overlapped issue order is not built for that.
    schedule["OVERLAP"] = bool(schedule["OVERLAP"]) and not fp8
    # Only the split layout's copies are shared among the producer's warps (NHD is all TMA, one thread issues).
    # ... and at head size 256 they take a warpgroup: one producer warp spills its copy addresses there.
    schedule["WIDE_PRODUCER"] = (bool(schedule["WIDE_PRODUCER"]) or shape.head_size > 128) and split
    # ... and the split layout's FP8 tiles always: a consumer's own copies are not built for V^T pages.
    schedule["PRODUCER_WIDENS"] = (bool(schedule["PRODUCER_WIDENS"]) or split) and fp8
    # The producer warpgroup's loads take 32 keys at a time.
    schedule["KEY_LOADS"] = bool(schedule["KEY_LOADS"]) and split and config.block_n >= 32
    # ... and their tiles' value boxes first, where there are boxes (not FP8's copies, not VT_COPIES').
    schedule["VALUES_FIRST"] = (bool(schedule["VALUES_FIRST"]) and schedule["KEY_LOADS"] and not fp8
                                and not schedule["VT_COPIES"])
    # ... and 64 at a time where a tile holds more than one such chunk (a 16-bit cache: the FP8 producer's
    # registers also hold the widening).
    schedule["WIDE_KEY_CHUNKS"] = (bool(schedule["WIDE_KEY_CHUNKS"]) and schedule["KEY_LOADS"] and not fp8
                                   and config.block_n > WIDE_KEY_CHUNK)
    # ... and loaded before their buffer is free, where the tile is one or two chunks (the registers the loads
    # hold anyway); not FP8's, which the producer widens through its own ring.
    schedule["EARLY_KEYS"] = (bool(schedule["EARLY_KEYS"]) and schedule["KEY_LOADS"] and not fp8
                              and config.block_n <= 2 * key_chunk(schedule))
    # The producer's widening of FP8 tiles through float32, where it widens them to bfloat16 (float16 is one
    # packed conversion from FP8 already).
    schedule["F32_WIDENING"] = (bool(schedule["F32_WIDENING"]) and schedule["PRODUCER_WIDENS"]
                                and shape.dtype == torch.bfloat16)
    # Per-thread hand-backs, where every hand-back is the consumers' own after their MMAs (a consumer that widens
    # its own FP8 copies hands each FP8 buffer back after a barrier its widening needs anyway).
    schedule["THREAD_ARRIVALS"] = bool(schedule["THREAD_ARRIVALS"]) and (schedule["PRODUCER_WIDENS"] or not fp8)
    # The new tokens' values transposed into the V^T ring: the split layout's 16-bit cache (an FP8 cache's
    # V^T ring is widened from its own FP8 ring).
    schedule["NEW_VALUES_T"] = bool(schedule["NEW_VALUES_T"]) and split and not fp8
    # The split layout's FP8 keys and values by TMA boxes: its FP8 cache (widened by the producer, always, there)
    # at head sizes that fill the tile (a padded head's columns past it would need zeros written).
    schedule["FP8_BOXES"] = bool(schedule["FP8_BOXES"]) and split and fp8 and shape.head_size not in PADDED_HEADS
    # The split layout's cached FP8 values widened into the V ring (its FP8 cache is widened by the producer).
    schedule["WIDEN_TO_V"] = bool(schedule["WIDEN_TO_V"]) and split and fp8
    return schedule


def partition_registers(schedule: dict, split: bool, num_warps: int) -> tuple[int, int]:
    """Registers per thread of the producer partition and of the consumers under a resolved ``schedule``
    (``setmaxnreg``): what the producer holds decides its share."""
    if schedule["WIDE_KEY_CHUNKS"]:  # two 64-key chunks of key loads
        return WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS
    if schedule["NEW_VALUES_T"]:  # a chunk of new values beside the next chunk's loads
        return NEW_VALUES_PRODUCER_REGS, NEW_VALUES_CONSUMER_REGS
    if schedule["PRODUCER_WIDENS"] or schedule["KEY_LOADS"]:  # a warpgroup holding slices of tiles
        return WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS
    if schedule["WIDE_PRODUCER"]:
        return WIDE_PRODUCER_REGS, WIDE_CONSUMER_REGS
    # The producer warp of the split layout holds a tile of 16-byte copy addresses.
    return 96 if split and num_warps == 8 else 24, CONSUMER_REGS


def key_chunk(schedule: dict) -> int:
    """Keys per chunk of the producer's key loads under a resolved ``schedule``: 0 without ``KEY_LOADS``."""
    if not schedule["KEY_LOADS"]:
        return 0
    return WIDE_KEY_CHUNK if schedule["WIDE_KEY_CHUNKS"] else KEY_CHUNK


def kernel_call(problem: PrefillProblem, config: TileConfig, shape: ProblemShape,
                schedule: Optional[dict] = None) -> Optional[KernelCall]:
    """The launch of the Hopper kernel for ``problem`` with the settled ``config`` (and ``schedule``, by
    default :data:`SCHEDULE`), or None when there is nothing to do."""
    p = problem
    T, H, D = p.q.shape
    B = p.batch.num_seqs
    if T == 0 or B == 0 or H == 0:
        return None
    opts = p.options
    group = H // p.num_kv_heads
    softcap = float(opts.softcap)
    qk_scale = p.sm_scale if softcap > 0 else p.sm_scale * LOG2E.value  # the kernel's logits are log2-domain
    out_scale_value, out_from_ptr = _scale_arg(opts.fp8_out_scale, True)
    fp8 = p.cache.dtype.is_fp8
    k_scale, k_from_ptr = _scale_arg(p.cache.k_scale, fp8)
    v_scale, v_from_ptr = _scale_arg(p.cache.v_scale, fp8)
    table = p.batch.block_table
    split = p.cache.layout is KVLayout.SPLIT
    key = p.cache.key
    split_strides = (key.stride(0), key.stride(1), key.stride(2)) if split else (0, 0, 0)
    value_row_stride = p.cache.value.stride(2) if split else 0
    # The new tokens' values by the producer's loads (NEW_VALUES_T): v's token and head strides (its values of a
    # head are contiguous, as its TMA descriptor has them).
    new_value_strides = (p.v.stride(0), p.v.stride(1)) if p.v is not None else (0, 0)
    scalars = (qk_scale, out_scale_value, k_scale, v_scale, softcap, opts.sliding_window or 0, B, T, p.cache.num_blocks,
               table.shape[1], group, p.q.stride(0), p.q.stride(1), p.out.stride(0), p.out.stride(1),
               table.stride(0), *split_strides, p.num_kv_heads * D, value_row_stride, *new_value_strides)
    schedule = resolve_schedule(shape, config, schedule)
    if schedule["FP8_BOXES"] and not _key_pages_fit(p.cache.key):
        # A key cache that the page boxes cannot describe (not contiguous from its block dimension in) takes the
        # 16-byte copies, which address any 16-byte aligned strides.
        schedule["FP8_BOXES"] = False
    if schedule["NEW_VALUES_T"] and p.v is not None and p.v.stride(0) * config.block_n >= 2**31:
        # The producer's offsets within a tile of new values are 32-bit (registers beside its key loads).
        raise ValueError(f"NEW_VALUES_T: v's token stride ({p.v.stride(0)} elements) times block_n "
                         f"({config.block_n}) must stay below 2**31; run without NEW_VALUES_T")
    producer_regs, consumer_regs = partition_registers(schedule, split, config.num_warps)
    chunk = key_chunk(schedule)
    schedule.pop("WIDE_KEY_CHUNKS")  # the kernel takes the chunk's keys as KEY_LOADS
    constexprs = dict(
        HEAD_SIZE=PADDED_HEADS.get(D, D), HEAD_DIM=D, PAGE=p.cache.block_size, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HEADS_PER_TILE=config.heads_per_tile, HEAD_CHUNKS=triton.cdiv(group, config.heads_per_tile),
        STAGES=config.num_stages, NUM_WARPS=config.num_warps, CAUSAL=opts.causal,
        WINDOW=opts.sliding_window is not None, SOFTCAP=softcap > 0, ALIBI=opts.alibi_slopes is not None,
        SINKS=opts.sinks is not None, SKIP_DECODE=opts.skip_decode, NEW_KV_IN_CACHE=p.k is None,
        OUT_SCALE=opts.fp8_out_scale is not None, OUT_SCALE_PTR=out_from_ptr, OUT_MAX=FP8_E4M3_MAX,
        **{**schedule, "KEY_LOADS": chunk},
        SPLIT=split, X=key.shape[4] if split else 8,
        FP8_CACHE=fp8, K_SCALE_PTR=k_from_ptr, V_SCALE_PTR=v_from_ptr,
        PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs,
    )
    # Under PINGPONG the launch's warps are the default partition's: the first consumer warpgroup.
    warps = config.num_warps // 2 if schedule["PINGPONG"] else config.num_warps
    return KernelCall(launch_grid(shape, config), call_tensors(p, config, schedule), scalars, constexprs,
                      dict(num_warps=warps))


def launch_hopper(problem: PrefillProblem, config: TileConfig, shape: ProblemShape, schedule: Optional[dict] = None):
    """Run the Hopper kernel (compiling on first use); Triton's compiled-kernel handle, or None when there
    was nothing to launch."""
    from .kernel import hopper_prefill_kernel

    call = kernel_call(problem, config, shape, schedule)
    if call is None:
        return None
    with device_guard(problem.q.device):
        return hopper_prefill_kernel[call.grid](*call.args, **call.kwargs)


class _Address:
    """What a TMA descriptor reads of its tensor: the address and the dtype (and no reference that would keep
    the tensor alive)."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


def _descriptor_sources(p: PrefillProblem) -> tuple:
    """The tensors a call's TMA descriptors can describe, in a fixed order."""
    return (p.cache.key, p.cache.value, p.k, p.v)


class _Arguments:
    """A call signature's tensor arguments, rebuilt per call from a later problem: TMA descriptors keep the
    first call's shapes, strides, boxes and layouts (all fixed by the signature) and take the new addresses,
    and a descriptor whose address did not change (the cache, call after call) is reused as it is. With an
    :class:`~.encoded.EncodedLauncher` each descriptor is passed encoded, and encoded again only when its
    tensor moved."""

    def __init__(self, first: PrefillProblem, tensors: tuple, encoded: Optional[EncodedLauncher] = None):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        sources = _descriptor_sources(first)
        self._slots = []  # (argument position, source position, dtype, shape, strides, block, layout)
        self._last = {}  # argument position -> (address, the argument passed)
        for position, arg in enumerate(tensors):
            if isinstance(arg, TensorDescriptor):
                # By address: an FP8 cache is described through a view of its bytes, a tensor of its own.
                source = next(i for i, t in enumerate(sources)
                              if t is not None and t.data_ptr() == arg.base.data_ptr())
                self._slots.append((position, source, arg.base.dtype, arg.shape, arg.strides, arg.block_shape,
                                    arg.layout))
        self._descriptor = TensorDescriptor
        self._encoded = encoded

    def __call__(self, later: PrefillProblem) -> Optional[tuple]:
        """The arguments for ``later``, or None when an address lost TMA's 16-byte alignment."""
        sources = _descriptor_sources(later)
        args = _plain_tensors(later)
        for position, source, dtype, shape, strides, block, layout in self._slots:
            ptr = sources[source].data_ptr()
            last = self._last.get(position)
            if last is None or last[0] != ptr:
                if ptr % 16:
                    return None
                descriptor = self._descriptor(_Address(ptr, dtype), shape, strides, block, layout)
                if self._encoded is not None:
                    descriptor = self._encoded.encode(position, descriptor)
                last = (ptr, descriptor)
                self._last[position] = last
            args[position] = last[1]
        return tuple(args)


def bind_hopper(problem: PrefillProblem, config: TileConfig, shape: ProblemShape, schedule: Optional[dict] = None):
    """Launch ``problem`` and return ``launch(later_problem) -> bool`` for later calls with its signature, or
    None when nothing was launched. Later calls rebuild and encode only the TMA descriptors whose tensor moved
    (:mod:`.encoded`)."""
    from .kernel import hopper_prefill_kernel

    call = kernel_call(problem, config, shape, schedule)
    if call is None:
        return None
    device = problem.q.device
    with device_guard(device):
        compiled = hopper_prefill_kernel[call.grid](*call.args, **call.kwargs)
    # Triton's launcher would encode the five descriptors again on every launch: encode them per address.
    encoded = EncodedLauncher.of(compiled, range(DESCRIPTORS.start, DESCRIPTORS.stop))
    bound = BoundLaunch(compiled, call, device, kernel=hopper_prefill_kernel, run=encoded)
    arguments = _Arguments(problem, call.tensors, encoded)

    def launch(later: PrefillProblem) -> bool:
        tensors = arguments(later)
        return tensors is not None and bound(tensors)

    return launch
