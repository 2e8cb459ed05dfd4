"""Host side of the Triton kernel: turn a validated problem and a TileConfig into one launch.

No device-to-host synchronisation: the grid comes from tensor shapes (``num_tokens // tokens_per_tile +
num_seqs`` tiles, programs past their sequence's end exit at once), scales given as tensors are read on the
device, and the launch happens on the tensors' device whatever the current device is. A tile with split keys
(``TileConfig.key_splits`` > 1) allocates its partial rows (sized by the shapes alone, through PyTorch's
caching allocator: CUDA-graph safe) and is followed by the combine launch (:mod:`.combine`); no other call
allocates.

Two ways to launch:

* :func:`launch_prefill` goes through Triton's JIT (binding and specialising every argument on every call);
  it compiles on first use and works everywhere, the interpreter included.
* :class:`BoundLaunch` holds the compiled kernel of one specialisation and launches it directly. The
  dispatch keeps one per call signature (every shape, stride, dtype and scalar that decides the
  specialisation), so a serving engine's repeated calls pay for neither binding nor re-deriving arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import triton
from triton import knobs

from ..accelerator import device_guard
from ..cache import as_stored_type
from ..tiling import ProblemShape, TileConfig, launch_grid, padded_head_size, pagewise_possible, problem_shape
from ..types import FP8_QUERY_DTYPES, KVLayout, PrefillProblem
from ..validation import dtype_name
from . import blocks
from .arguments import (
    Batch,
    Cache,
    CacheLayout,
    CacheStrides,
    Extents,
    Features,
    KeyStrides,
    Partials,
    PerHead,
    RowStrides,
    ScaleFromTensor,
    Scales,
    ScaleTensors,
    TableStrides,
    Tile,
    Tokens,
    TokenStrides,
    ValueStrides,
)
from .combine import combine_splits_kernel
from .kernel import prefix_prefill_kernel

#: Largest finite FP8 e4m3 value: a quantised output saturates there (the portable kernel reads it from
#: :mod:`.blocks`; other kernels take it as an argument).
FP8_E4M3_MAX = blocks.FP8_E4M3_MAX.value


def _vector_alignment(strides, unit: int, element_size: int) -> int:
    """Largest power of two (at most 16 bytes of elements) dividing every stride but ``strides[unit]``,
    which must be 1 for any alignment to help; 1 when nothing is known."""
    if strides[unit] != 1:
        return 1
    align = max(1, 16 // element_size)
    while align > 1 and any(s % align for i, s in enumerate(strides) if i != unit):
        align //= 2
    return align


def _cache_addressing(problem: PrefillProblem, config: TileConfig) -> tuple[Cache, CacheStrides, CacheLayout]:
    """The cache as the kernel reads it (FP8 bytes viewed as float8: the kernel converts them), its strides,
    and its layout with the alignments (in elements) the kernel may assume for those strides."""
    c = problem.cache
    key, value = as_stored_type(c.key, c.dtype), as_stored_type(c.value, c.dtype)
    split = c.layout is KVLayout.SPLIT
    if split:  # [blocks, Hkv, D / x, block_size, x] and [blocks, Hkv, D, block_size]
        chunk = key.shape[4]
        keys = KeyStrides(key.stride(0), key.stride(1), key.stride(2), key.stride(3), key.stride(4))
        values = ValueStrides(value.stride(0), value.stride(1), value.stride(2), value.stride(3))
        value_unit = 3  # slots are contiguous
    else:  # [blocks, block_size, Hkv, D], both
        chunk = None
        keys = KeyStrides(key.stride(0), key.stride(2), 0, key.stride(1), key.stride(3))
        values = ValueStrides(value.stride(0), value.stride(2), value.stride(3), value.stride(1))
        value_unit = 2  # the head dim is contiguous
    if config.pagewise and not pagewise_possible(c.block_size, config.block_n):
        raise ValueError(f"config: page-wise addressing needs a power-of-two block size that divides or is a "
                         f"multiple of block_n={config.block_n}, not {c.block_size}; a policy's tile is settled "
                         "for its shape (tiling.settle), a hand-made one must be too")
    layout = CacheLayout(
        SPLIT=split, CHUNK=chunk, PAGEWISE=config.pagewise, PAGE_SIZE=c.block_size if config.pagewise else None,
        KEY_ALIGN=_vector_alignment(keys, 4, key.element_size()),
        VALUE_ALIGN=_vector_alignment(values, value_unit, value.element_size()),
    )
    table = problem.batch.block_table
    strides = CacheStrides(keys, values, TableStrides(table.stride(0), table.stride(1)))
    return Cache(key, value, table), strides, layout


def _scale_arg(scale, used: bool) -> tuple[float, bool]:
    """``(float value, read-from-tensor flag)`` of a scale (FP8 cache or output): a tensor is read on the
    device, where :func:`call_tensors` passes it; an unused scale is 1."""
    if not used or scale is None:
        return 1.0, False
    if isinstance(scale, torch.Tensor):
        return 1.0, True
    return float(scale), False


def call_features(p: PrefillProblem) -> Features:
    """The optional parts of the computation a call compiles in (every kernel's ``FEATURES`` constexpr)."""
    o = p.options
    widened = dtype_name(p.dtype) if p.q.dtype in FP8_QUERY_DTYPES else ""
    return Features(CAUSAL=o.causal, WINDOW=o.sliding_window is not None, SOFTCAP=o.softcap > 0,
                    ALIBI=o.alibi_slopes is not None, SINKS=o.sinks is not None, SKIP_DECODE=o.skip_decode,
                    NEW_KV_IN_CACHE=p.k is None, OUT_SCALE=o.fp8_out_scale is not None,
                    QUERY_WIDENED_TO=widened, CONTEXT_FROM_STARTS=p.batch.context_lens is None)


def scale_arguments(p: PrefillProblem) -> tuple[Scales, ScaleFromTensor]:
    """The call's scales as numbers (1.0 where a tensor holds one, or where it is unused) and which of them the
    kernel reads from :class:`~.arguments.ScaleTensors` instead (on the device: no host synchronisation)."""
    fp8 = p.cache.dtype.is_fp8
    k_scale, k_from_tensor = _scale_arg(p.cache.k_scale, fp8)
    v_scale, v_from_tensor = _scale_arg(p.cache.v_scale, fp8)
    out_scale, out_from_tensor = _scale_arg(p.options.fp8_out_scale, True)
    q_scale, q_from_tensor = _scale_arg(p.options.q_scale, p.q.dtype in FP8_QUERY_DTYPES)
    # An FP8 q is widened exactly; its descale scales every logit, as the softmax scale does.
    softmax = p.sm_scale * q_scale if q_scale != 1.0 else p.sm_scale
    return (Scales(softmax, k_scale, v_scale, out_scale),
            ScaleFromTensor(k_from_tensor, v_from_tensor, out_from_tensor, q_from_tensor))


def call_extents(p: PrefillProblem) -> Extents:
    """The sizes that bound every index of a call (:class:`~.arguments.Extents`)."""
    T, H, _ = p.q.shape
    c = p.cache
    return Extents(p.batch.num_seqs, T, c.num_blocks, p.batch.block_table.shape[1], c.block_size,
                   H // p.num_kv_heads)


def dot_precision(dtype: torch.dtype, config: TileConfig) -> str:
    """The ``input_precision`` both dots run at for inputs of ``dtype``: the policy's ``fp32_dot`` for
    float32; 16-bit inputs multiply exactly (``"ieee"``), whatever the policy says about float32."""
    return config.fp32_dot if dtype == torch.float32 else "ieee"


@dataclass(frozen=True)
class KernelCall:
    """One launch of a kernel: grid, the tensor arguments, the numeric arguments, constexprs and options.

    ``tensors`` come first in the kernel's signature (for the portable kernel, the tensor groups of
    :mod:`.arguments`), then ``scalars``, then the constexprs; a launch passes ``*tensors, *scalars``
    positionally and ``constexprs`` plus ``options`` (warps, stages) by keyword.
    """

    grid: tuple[int, int, int]
    tensors: tuple
    scalars: tuple
    constexprs: dict
    options: dict

    @property
    def args(self) -> tuple:
        return self.tensors + self.scalars

    @property
    def kwargs(self) -> dict:
        return {**self.constexprs, **self.options}


def call_tensors(p: PrefillProblem, key_splits: int = 1) -> tuple:
    """The kernel's tensor groups for ``p``, in signature order, as plain tuples (placeholders where a feature
    is off): :class:`.arguments.Tokens`, :class:`.arguments.Cache`, :class:`.arguments.Batch`,
    :class:`.arguments.PerHead`, :class:`.arguments.ScaleTensors` and :class:`.arguments.Partials` (allocated
    here for a launch of ``key_splits`` > 1), in their fields' order.

    The one definition of that order: :func:`kernel_call` names the groups for Triton's JIT, and
    :class:`BoundLaunch` receives them as they are on every call (the driver's launcher flattens any tuple), so
    that building them costs no more than reading attributes.
    """
    q, c, o = p.q, p.cache, p.options
    k, v = (q, q) if p.k is None else (p.k, p.v)
    fp8 = c.dtype.is_fp8
    k_scale = c.k_scale if fp8 and isinstance(c.k_scale, torch.Tensor) else q
    v_scale = c.v_scale if fp8 and isinstance(c.v_scale, torch.Tensor) else q
    out_scale, q_scale = o.fp8_out_scale, o.q_scale
    b = p.batch
    # Context lengths derived from the starts (None): seq_lens stands in for them, unread (CONTEXT_FROM_STARTS).
    context_lens = b.seq_lens if b.context_lens is None else b.context_lens
    return ((q, k, v, p.out), (c.key, c.value, b.block_table), (b.query_start, b.seq_lens, context_lens),
            (q if o.alibi_slopes is None else o.alibi_slopes, q if o.sinks is None else o.sinks),
            (k_scale, v_scale, out_scale if isinstance(out_scale, torch.Tensor) else q,
             q_scale if isinstance(q_scale, torch.Tensor) else q),
            partial_rows(q, key_splits))


def partial_rows(q: torch.Tensor, key_splits: int) -> tuple:
    """The :class:`.arguments.Partials` of a launch with ``key_splits`` splits on queries ``q`` (``q`` itself
    twice, unread, without a split)."""
    if key_splits == 1:
        return (q, q)
    T, H, D = q.shape
    return (torch.empty((key_splits, T, H, padded_head_size(D)), dtype=torch.float32, device=q.device),
            torch.empty((key_splits, T, H), dtype=torch.float32, device=q.device))


def combine_call(problem: PrefillProblem, config: TileConfig, tensors: tuple, grid: tuple) -> KernelCall:
    """The combine launch (:mod:`.combine`) after a launch of ``config`` (``key_splits`` > 1) with ``grid`` whose
    partial rows are in ``tensors`` (:func:`call_tensors`' groups): the same tiles, one program per tile."""
    p = problem
    T, H, D = p.q.shape
    tokens, _, batch, per_head, scale_tensors, partials = tensors
    scales, scale_from_tensor = scale_arguments(p)
    constexprs = dict(HEAD_SIZE=D, HEAD_SIZE_PADDED=padded_head_size(D), TILE=tile_of(p, config),
                      FEATURES=call_features(p),
                      OUT_SCALE_FROM_TENSOR=scale_from_tensor.OUT, OUT_MAX=FP8_E4M3_MAX)
    return KernelCall((grid[0], grid[1], 1), (Tokens(*tokens), Batch(*batch), PerHead(*per_head),
                                              ScaleTensors(*scale_tensors), Partials(*partials)),
                      (scales.out, *call_extents(p), _row_strides(p.out)), constexprs,
                      dict(num_warps=8 if config.block_m * min(padded_head_size(D), 128) > 8192 else 4, num_stages=1))


def tile_of(p: PrefillProblem, config: TileConfig) -> Tile:
    """``config`` as core's kernel and the combine take it (:class:`.arguments.Tile`) for ``p``."""
    group = p.num_heads // p.num_kv_heads
    return Tile(config.block_m, config.block_n, config.heads_per_tile, triton.cdiv(group, config.heads_per_tile),
                config.split_masks, dot_precision(p.dtype, config), config.key_splits)


def combine_tensors(tensors: tuple) -> tuple:
    """The combine launch's tensor groups, taken from the first launch's (:func:`call_tensors`)."""
    tokens, _, batch, per_head, scale_tensors, partials = tensors
    return tokens, batch, per_head, scale_tensors, partials


def _row_strides(t: Optional[torch.Tensor]) -> RowStrides:
    return RowStrides(0, 0) if t is None else RowStrides(t.stride(0), t.stride(1))


def kernel_call(problem: PrefillProblem, config: TileConfig, shape: Optional[ProblemShape] = None
                ) -> Optional[KernelCall]:
    """The kernel launch that computes ``problem`` with ``config``, or None when there is nothing to do.

    ``config`` is run as it is: a policy's tile is settled for its shape (``tiling.settle``); a hand-made one
    must be settled by its maker. ``shape`` is the :class:`~pagedprefill.tiling.ProblemShape` the policy saw
    (derived from ``problem`` when not given); it sizes the grid.
    """
    p = problem
    q = p.q
    T, H, D = q.shape
    B = p.batch.num_seqs
    if T == 0 or B == 0 or H == 0:
        return None
    if shape is None:
        shape = problem_shape(p)
    cache, cache_strides, layout = _cache_addressing(p, config)
    scales, scale_from_tensor = scale_arguments(p)
    opts = p.options
    window = opts.sliding_window  # None: no window (the kernel's int argument is then unused; 0 is passed)
    tokens, _, batch, per_head, scale_tensors, partials = call_tensors(p, config.key_splits)
    tensors = (Tokens(*tokens), cache, Batch(*batch), PerHead(*per_head), ScaleTensors(*scale_tensors),
               Partials(*partials))
    scalars = (
        scales, float(opts.softcap), window or 0, *call_extents(p),
        TokenStrides(_row_strides(q), _row_strides(p.k), _row_strides(p.v), _row_strides(p.out)),
        cache_strides,
    )
    constexprs = dict(
        HEAD_SIZE=D, HEAD_SIZE_PADDED=padded_head_size(D),
        TILE=tile_of(p, config),
        LAYOUT=layout, FEATURES=call_features(p), SCALE_FROM_TENSOR=scale_from_tensor,
    )
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return KernelCall(launch_grid(shape, config), tensors, scalars, constexprs, options)


def jit_launch(kernel: Any, call: KernelCall, device: torch.device):
    """Launch ``call`` of ``kernel`` through Triton's JIT (binding every argument, compiling on first use) on
    ``device``, whatever the current device is; Triton's compiled-kernel handle."""
    with device_guard(device):
        return kernel[call.grid](*call.args, **call.kwargs)


def launch_prefill(problem: PrefillProblem, config: TileConfig, shape: Optional[ProblemShape] = None):
    """Run the prefix-prefill kernel for ``problem`` (already validated) with ``config`` (see :func:`kernel_call`),
    and with split keys the combine after it.

    Returns Triton's compiled-kernel handle of the first launch (its ``metadata.shared`` is the shared memory it
    uses), or None when there was nothing to launch.
    """
    call = kernel_call(problem, config, shape)
    if call is None:
        return None
    compiled = jit_launch(prefix_prefill_kernel, call, problem.q.device)
    launch_combine(problem, config, call.tensors, call.grid)
    return compiled


def launch_combine(problem: PrefillProblem, config: TileConfig, groups: tuple, grid: tuple) -> None:
    """After a launch of ``config`` with ``grid`` on the tensors ``groups`` (:func:`call_tensors`' six groups, in
    its order; core's kernel takes them as they are), merge its partial rows when ``config`` splits the keys;
    nothing otherwise."""
    if config.key_splits > 1:
        jit_launch(combine_splits_kernel, combine_call(problem, config, groups, grid), problem.q.device)


def _launches_hooked() -> bool:
    """Whether something (a profiler) asked Triton to be told of every launch."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _aligned_tensors(tensors: tuple) -> tuple:
    """Where the 16-byte aligned tensors are among ``tensors`` (a flat tuple, or a tuple of tensor groups):
    ``(index, None)`` for a lone tensor, ``(index, field)`` for one inside a group."""
    paths = []
    for i, arg in enumerate(tensors):
        for j, t in enumerate(arg) if isinstance(arg, tuple) else [(None, arg)]:
            if isinstance(t, torch.Tensor) and t.data_ptr() % 16 == 0:
                paths.append((i, j))
    return tuple(paths)


class BoundLaunch:
    """A compiled specialisation of the kernel, launched without Triton's per-call argument binding.

    Built from one :class:`KernelCall` after Triton compiled it; valid for any later problem with the same
    call signature (shapes, strides, dtypes, scalars, options) whose tensors are 16-byte aligned like the
    first one's, which :meth:`__call__` checks (it returns False and launches nothing otherwise). ``run``
    replaces Triton's launcher of ``compiled`` (``compiled.run``) with one that takes the same arguments, e.g.
    one that receives TMA descriptors already encoded.
    """

    __slots__ = ("_run", "_function", "_metadata", "_grid", "_tail", "_aligned", "_device_index", "_stream")

    def __init__(self, compiled: Any, call: KernelCall, device: torch.device, kernel: Any = prefix_prefill_kernel,
                 run: Optional[Callable[..., None]] = None):
        from triton.runtime import driver

        self._run = compiled.run if run is None else run
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._grid = call.grid
        # Every argument goes positionally, as Triton's own launch passes them: tuple arguments as the tuples
        # they are (the driver's launcher flattens them) and constexprs too (the launcher skips them).
        names = kernel.arg_names
        n = len(call.tensors) + len(call.scalars)
        self._tail = call.scalars + tuple(call.constexprs[name] for name in names[n:])
        # Only tensors carry an alignment the compiled code may assume (a TMA descriptor checks its own).
        self._aligned = _aligned_tensors(call.tensors)
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._stream = driver.active.get_current_stream

    @property
    def launcher(self) -> Callable[..., None]:
        """What launches the compiled kernel: Triton's launcher, or the ``run`` it was given."""
        return self._run

    def __call__(self, tensors: tuple) -> bool:
        """Launch with ``tensors`` (:func:`call_tensors` of a problem with this signature) on the current
        stream of the device it was compiled for; False, launching nothing, when that is not possible."""
        if torch.cuda.current_device() != self._device_index or _launches_hooked():
            return False  # another device is current, or a profiler hooks launches: Triton's own path serves
        for i, j in self._aligned:
            t = tensors[i] if j is None else tensors[i][j]
            if t.data_ptr() % 16:
                return False  # the compiled code assumes 16-byte alignment this tensor lacks
        g0, g1, g2 = self._grid
        self._run(g0, g1, g2, self._stream(self._device_index), self._function, self._metadata, None, None, None,
                  *tensors, *self._tail)
        return True


def bind(kernel: Any, call: KernelCall, device: torch.device,
         launcher: Optional[Callable[[Any], Optional[Callable[..., None]]]] = None) -> Optional[BoundLaunch]:
    """Launch ``call`` of ``kernel`` through Triton's JIT and bind the compiled kernel for later calls with the
    same signature; None where no GPU driver launches directly (the interpreter and other drivers keep the JIT
    path). ``launcher(compiled)``, when given, returns a stand-in for Triton's launcher of ``compiled`` (or None
    to keep Triton's)."""
    compiled = jit_launch(kernel, call, device)
    if device.type != "cuda" or not hasattr(compiled, "packed_metadata"):
        return None
    run = launcher(compiled) if launcher is not None else None
    return BoundLaunch(compiled, call, device, kernel=kernel, run=run)


def bind_launch(problem: PrefillProblem, config: TileConfig, shape: Optional[ProblemShape] = None
                ) -> Optional[Callable[[tuple], bool]]:
    """Launch ``problem`` on the portable kernel (compiling on first use; with split keys the combine too) and
    return a :class:`BoundLaunch` (a :class:`SplitLaunch` with split keys) for later calls with the same
    signature; None when there was nothing to launch or no GPU driver runs it."""
    call = kernel_call(problem, config, shape)
    if call is None:
        return None
    return with_combine(bind(prefix_prefill_kernel, call, problem.q.device), problem, config, call.tensors, call.grid)


class SplitLaunch:
    """A bound launch with split keys and the bound combine after it: called like :class:`BoundLaunch`, with the
    first launch's tensors. ``groups(tensors)`` are :func:`call_tensors`' six groups among them (the tensors
    themselves for core's kernel; a backend's own kernel may take more, TMA descriptors say)."""

    __slots__ = ("_first", "_combine", "_groups")

    def __init__(self, first: Callable[[tuple], bool], combine: BoundLaunch,
                 groups: Callable[[tuple], tuple] = lambda tensors: tensors):
        self._first = first
        self._combine = combine
        self._groups = groups

    def __call__(self, tensors: tuple) -> bool:
        # The combine reads a subset of the tensors the first launch accepted: it accepts them too.
        return self._first(tensors) and self._combine(combine_tensors(self._groups(tensors)))


def with_combine(first: Optional[Callable[[tuple], bool]], problem: PrefillProblem, config: TileConfig,
                 groups: tuple, grid: tuple) -> Optional[Callable[[tuple], bool]]:
    """``first``, a bound launch of ``config`` just run with ``grid`` on ``groups`` (:func:`call_tensors`' six
    groups), completed by the combine when ``config`` splits the keys: the combine of this call runs now, and
    the result launches both (a :class:`SplitLaunch`). Without a bound launch (no GPU driver launches
    directly) the combine runs through Triton's JIT and None is returned."""
    if config.key_splits == 1:
        return first
    if first is None:
        launch_combine(problem, config, groups, grid)
        return None
    combine = bind_combine(problem, config, groups, grid)
    return None if combine is None else SplitLaunch(first, combine)


def bind_combine(problem: PrefillProblem, config: TileConfig, groups: tuple, grid: tuple) -> Optional[BoundLaunch]:
    """Run the combine of a launch of ``config`` (``key_splits`` > 1) with ``grid`` on ``groups``
    (:func:`call_tensors`' six groups) and bind it for later calls of the same signature, which pass
    :func:`combine_tensors` of theirs; None where no GPU driver launches directly (it ran through the JIT)."""
    return bind(combine_splits_kernel, combine_call(problem, config, groups, grid), problem.q.device)
