"""Host side of the Hopper kernel: whether a call's tensors fit it, its TMA descriptors, and one launch.

The policy chooses the kernel from what a call looks like (:func:`.schedule.shape_unfit_reason`); a few
properties only the tensors know (strides that a 2-D TMA view needs, 16-byte alignment) are checked per call
signature by :func:`unfit_reason`, and a call that fails them runs on the portable kernel with the same tile.
Everything a launch shares with the portable kernel's (the feature flags, the scales, the plain tensors, the
JIT launch, the bind and, with split keys, the partial rows) is core's (:mod:`pagedprefill.triton.launch`); with
split keys the kernel merges the partial rows itself (:func:`.epilogue.merge_if_last`), so a call is one launch
either way. Like core's launcher, nothing here synchronises with the device, and only a launch with split keys
allocates: its partial rows (through core); its arrival counters are kept zeroed per stream
(:class:`ArrivalCounters`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from pagedprefill.cache import as_stored_type
from pagedprefill.tiling import ProblemShape, TileConfig, launch_grid
from pagedprefill.triton.arguments import Batch, Cache, Partials, PerHead, RowStrides, ScaleTensors, Tokens
from pagedprefill.triton.blocks import LOG2E
from pagedprefill.triton.launch import (
    FP8_E4M3_MAX,
    KernelCall,
    bind,
    call_extents,
    call_features,
    call_tensors,
    jit_launch,
    scale_arguments,
)
from pagedprefill.types import KVLayout, PrefillProblem

from . import schedule as hopper_schedule
from .arguments import Layout, Strides, Tile
from .encoded import EncodedLauncher
from .schedule import MAX_ROWS, PADDED_HEADS


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


class ArrivalCounters:
    """The split keys' arrival counters, kept zeroed per (device, stream): every launch leaves its counters zero
    again (:func:`.epilogue.merge_if_last`), so one buffer serves every later launch on the same stream, which the
    stream orders after it, and a call allocates and fills nothing for them. Launches on other streams get their
    own buffer; a launch captured into a CUDA graph gets a fresh zeroed one (a memset in the graph), so that no
    replay shares a buffer with an eager call and no buffer the graph holds is ever freed by growth here."""

    def __init__(self):
        self._kept: dict = {}

    def kept(self, device: torch.device) -> Optional[torch.Tensor]:
        """The buffer kept for ``device``'s current stream, None before its first launch with split keys."""
        from triton.runtime import driver

        index = torch.cuda.current_device() if device.index is None else device.index
        return self._kept.get((index, driver.active.get_current_stream(index)))

    def __call__(self, device: torch.device, count: int) -> torch.Tensor:
        """At least ``count`` zeroed int32 counters for a launch on ``device``'s current stream."""
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return torch.zeros(count, dtype=torch.int32, device=device)
        from triton.runtime import driver

        key = (device.index, driver.active.get_current_stream(device.index))
        kept = self._kept.get(key)
        if kept is None or kept.numel() < count:
            # Growing frees the smaller buffer to torch's allocator, which hands it out on this stream only,
            # after the launches already queued on it.
            kept = torch.zeros(max(count, 2 * (0 if kept is None else kept.numel())), dtype=torch.int32,
                               device=device)
            self._kept[key] = kept
        return kept


#: The counters every Hopper launch with split keys counts on.
arrival_counters = ArrivalCounters()


def split_arrivals(p: PrefillProblem, config: TileConfig, grid: tuple) -> torch.Tensor:
    """The arrival counters of a launch of ``config`` with ``grid``: with split keys, one zeroed int32 per
    (tile, head chunk, consumer) program pair (:data:`arrival_counters`), which the kernel leaves zeroed again;
    ``p.q`` (unread) without."""
    if config.key_splits == 1:
        return p.q
    return arrival_counters(p.q.device, grid[0] * grid[1] * 2)


def call_tensors_of(p: PrefillProblem, config: TileConfig, flags: dict, grid: tuple) -> tuple:
    """The kernel's tensor arguments for the first launch of a signature, in signature order: core's groups, the
    cache viewed as the type it stores (an FP8 cache as float8, which the kernel widens), the TMA descriptors
    at :data:`DESCRIPTORS` (placeholders where a layout or feature does not use one) and the split keys' arrival
    counters (:func:`split_arrivals`) last. ``flags`` (resolved,
    :func:`.schedule.resolve`): under ``FP8_BOXES`` the split layout's FP8 key cache is described too, by
    pages (:func:`_key_pages_descriptor`); under ``WIDE_BOXES`` a padded head's NHD boxes come from the 2-D view
    (which :func:`unfit_reason` requires of every NHD call)."""
    c = p.cache
    D = p.head_size
    box = min(c.block_size, config.block_n)
    width = PADDED_HEADS.get(D, D)

    def rows_of(n: int) -> list[int]:  # a box of n rows of one head (WIDE_BOXES: on into the next head's columns)
        return [n, width] if width == D or flags["WIDE_BOXES"] else [n, 1, width]

    key, value = as_stored_type(c.key, c.dtype), as_stored_type(c.value, c.dtype)
    if c.layout is KVLayout.SPLIT:
        # [blocks, Hkv, D, block]: rows of slots; a page of one head is D consecutive rows. An FP8 cache's
        # values come by 16-byte copies or page boxes instead: this descriptor names their type (a box of 16 FP8
        # slots is narrower than the narrowest swizzle, 32 bytes: unswizzled).
        swizzle = min(128, box * value.element_size())
        swizzle = swizzle if swizzle >= 32 else 0
        if width == D:
            v_cache_t = _descriptor(value, 2, (3,), [D, box], swizzle=swizzle)
        else:  # a padded head: boxes of the tile's width from the rank-3 view, zeros past the head
            v_cache_t = _value_pages_descriptor(value, width, box, swizzle)
        k_cache = v_cache = v_cache_t
        if flags["FP8_BOXES"]:
            # [blocks, Hkv, D / x, block, x]: a page's keys of one head are D / x contiguous [block, x] blocks of
            # 16 bytes' width, together one unswizzled box.
            if not _key_pages_fit(key):
                raise ValueError("FP8_BOXES: key_cache must be contiguous from its block dimension in, 16-byte "
                                 f"aligned, with at most {MAX_ROWS} rows of x elements; got strides "
                                 f"{tuple(c.key.stride())} for shape {tuple(c.key.shape)}")
            k_cache = _key_pages_descriptor(key, box)
    else:
        k_cache = _descriptor(key, 1, (2, 3), rows_of(box))
        v_cache = _descriptor(value, 1, (2, 3), rows_of(box))
        v_cache_t = v_cache
    if p.k is None:
        k_new, v_new = k_cache, v_cache  # unused: the new tokens' K/V are read from the cache
    else:
        k_new = _descriptor(p.k, 0, (1, 2), rows_of(config.block_n))
        v_new = _descriptor(p.v, 0, (1, 2), rows_of(config.block_n))
    tokens, _, batch, per_head, scale_tensors, partials = call_tensors(p, config.key_splits)
    return (Tokens(*tokens), k_cache, v_cache, k_new, v_new, v_cache_t, Cache(key, value, p.batch.block_table),
            Batch(*batch), PerHead(*per_head), ScaleTensors(*scale_tensors), Partials(*partials),
            split_arrivals(p, config, grid))


#: Where the TMA descriptors sit among the kernel's arguments: consecutive top-level arguments, where Triton's
#: launcher looks for them.
DESCRIPTORS = slice(1, 6)


def _strides(p: PrefillProblem) -> Strides:
    c = p.cache
    split = c.layout is KVLayout.SPLIT
    key_strides = (c.key.stride(0), c.key.stride(1), c.key.stride(2)) if split else (0, 0, 0)
    return Strides(RowStrides(p.q.stride(0), p.q.stride(1)), RowStrides(p.out.stride(0), p.out.stride(1)),
                   p.batch.block_table.stride(0), *key_strides, p.num_kv_heads * p.head_size,
                   c.value.stride(2) if split else 0)


def kernel_call(problem: PrefillProblem, config: TileConfig, shape: ProblemShape,
                schedule: Optional[dict] = None) -> Optional[KernelCall]:
    """The launch of the Hopper kernel for ``problem`` with the settled ``config`` (and ``schedule``: flags
    over the route's, :func:`.schedule.resolve`), or None when there is nothing to do."""
    p = problem
    T, H, D = p.q.shape
    if T == 0 or p.batch.num_seqs == 0 or H == 0:
        return None
    opts = p.options
    softcap = float(opts.softcap)
    scales, scale_from_tensor = scale_arguments(p)
    # The softmax scale with an FP8 query's descale (given as a number) folded in; the kernel's logits are
    # log2-domain.
    qk_scale = scales.softmax if softcap > 0 else scales.softmax * LOG2E.value
    flags = hopper_schedule.resolve(shape, config, schedule)
    if flags["FP8_BOXES"] and not _key_pages_fit(p.cache.key):
        # A key cache that the page boxes cannot describe (not contiguous from its block dimension in) takes the
        # 16-byte copies, which address any 16-byte aligned strides.
        flags["FP8_BOXES"] = False
    kernel_schedule = hopper_schedule.kernel_schedule(flags, shape, config)
    split = p.cache.layout is KVLayout.SPLIT
    group = H // p.num_kv_heads
    constexprs = dict(
        TILE=Tile(config.block_m, config.block_n, config.heads_per_tile, triton.cdiv(group, config.heads_per_tile),
                  config.num_stages, config.num_warps, config.key_splits),
        LAYOUT=Layout(split, p.cache.key.shape[4] if split else 8, p.cache.block_size, PADDED_HEADS.get(D, D), D,
                      p.cache.dtype.is_fp8, FP8_E4M3_MAX),
        FEATURES=call_features(p), SCALE_FROM_TENSOR=scale_from_tensor, SCHEDULE=kernel_schedule,
    )
    scalars = (qk_scale, scales, softcap, opts.sliding_window or 0, *call_extents(p), _strides(p))
    # Under PINGPONG the launch's warps are the default partition's: the first consumer warpgroup.
    warps = config.num_warps // 2 if kernel_schedule.PINGPONG else config.num_warps
    grid = launch_grid(shape, config)
    return KernelCall(grid, call_tensors_of(p, config, flags, grid), scalars, constexprs, dict(num_warps=warps))


def launch_hopper(problem: PrefillProblem, config: TileConfig, shape: ProblemShape, schedule: Optional[dict] = None):
    """Run the Hopper kernel (compiling on first use); Triton's compiled-kernel handle, or None when there
    was nothing to launch."""
    from .kernel import hopper_prefill_kernel

    call = kernel_call(problem, config, shape, schedule)
    if call is None:
        return None
    return jit_launch(hopper_prefill_kernel, call, problem.q.device)


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
    """A call signature's tensor arguments, rebuilt per call from a later problem: core's plain tensors as they
    are, and TMA descriptors that keep the first call's shapes, strides, boxes and layouts (all fixed by the
    signature) and take the new addresses; a descriptor whose address did not change (the cache, call after
    call) is reused as it is. With an :class:`~.encoded.EncodedLauncher` each descriptor is passed encoded, and
    encoded again only when its tensor moved."""

    def __init__(self, first: PrefillProblem, tensors: tuple, config: TileConfig, grid: tuple,
                 encoded: Optional[EncodedLauncher] = None):
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
        self._config = config
        self._grid = grid

    def __call__(self, later: PrefillProblem) -> Optional[tuple]:
        """The arguments for ``later``, or None when an address lost TMA's 16-byte alignment."""
        sources = _descriptor_sources(later)
        tokens, cache, batch, per_head, scale_tensors, partials = call_tensors(later, self._config.key_splits)
        args = [tokens, None, None, None, None, None, cache, batch, per_head, scale_tensors, partials,
                split_arrivals(later, self._config, self._grid)]
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
    None when nothing was launched or no GPU driver launches directly. Later calls rebuild and encode only the
    TMA descriptors whose tensor moved (:mod:`.encoded`)."""
    from .kernel import hopper_prefill_kernel

    call = kernel_call(problem, config, shape, schedule)
    if call is None:
        return None
    positions = range(DESCRIPTORS.start, DESCRIPTORS.stop)
    # Triton's launcher would encode the five descriptors again on every launch: encode them per address.
    bound = bind(hopper_prefill_kernel, call, problem.q.device,
                 lambda compiled: EncodedLauncher.of(compiled, positions))
    if bound is None:
        return None
    encoded = bound.launcher if isinstance(bound.launcher, EncodedLauncher) else None
    arguments = _Arguments(problem, call.tensors, config, call.grid, encoded)

    def launch(later: PrefillProblem) -> bool:
        tensors = arguments(later)
        return tensors is not None and bound(tensors)

    return launch
