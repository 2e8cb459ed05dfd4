"""Host side of the Triton kernel: turn a validated problem and a TileConfig into one launch.

No device-to-host synchronisation and no allocation: the grid comes from tensor shapes
(``num_tokens // tokens_per_tile + num_seqs`` tiles, programs past their sequence's end exit at once),
scales given as tensors are read on the device, and the launch happens on the tensors' device whatever the
current device is.

Two ways to launch:

* :func:`launch_prefill` goes through Triton's JIT (binding and specialising every argument on every call);
  it compiles on first use and works everywhere, the interpreter included.
* :class:`BoundLaunch` holds the compiled kernel of one specialisation and launches it directly. The
  dispatch keeps one per call signature (every shape, stride, dtype and scalar that decides the
  specialisation), so a serving engine's repeated calls pay for neither binding nor re-deriving arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
from triton import knobs

from ..accelerator import device_guard
from ..tiling import ProblemShape, TileConfig, launch_grid, padded_head_size, settle
from ..types import KVLayout, PrefillProblem
from .kernel import prefix_prefill_kernel

#: Largest finite FP8 e4m3 value: a quantised output saturates there.
FP8_E4M3_MAX = 448.0


def _vector_alignment(strides, unit: int, element_size: int) -> int:
    """Largest power of two (at most 16 bytes of elements) dividing every stride but ``strides[unit]``,
    which must be 1 for any alignment to help; 1 when nothing is known."""
    if strides[unit] != 1:
        return 1
    align = max(1, 16 // element_size)
    while align > 1 and any(s % align for i, s in enumerate(strides) if i != unit):
        align //= 2
    return align


def _cache_geometry(problem: PrefillProblem, head_size_padded: int):
    """Cache tensors (FP8 bytes viewed as float8), ``X``, the strides of the unified address formula and
    the alignments (in elements) the kernel may assume for them."""
    c = problem.cache
    key, value = c.key, c.value
    if c.dtype.is_fp8 and key.dtype == torch.uint8:
        key, value = key.view(c.dtype.torch_dtype), value.view(c.dtype.torch_dtype)
    if c.layout is KVLayout.SPLIT:
        x = key.shape[4]
        k_strides = (key.stride(0), key.stride(1), key.stride(2), key.stride(3), key.stride(4))
        v_strides = (value.stride(0), value.stride(1), value.stride(2), value.stride(3))
        v_unit = 3  # slots are contiguous
    else:  # [blocks, slot, head, d]: no d // X term, X beyond any head dim
        x = 2 * head_size_padded
        k_strides = (key.stride(0), key.stride(2), 0, key.stride(1), key.stride(3))
        v_strides = (value.stride(0), value.stride(2), value.stride(3), value.stride(1))
        v_unit = 2  # the head dim is contiguous
    k_align = _vector_alignment(k_strides, 4, key.element_size())
    v_align = _vector_alignment(v_strides, v_unit, value.element_size())
    return key, value, x, k_strides, v_strides, k_align, v_align


def _scale_arg(scale, used: bool) -> tuple[float, bool]:
    """``(float value, read-from-pointer flag)`` of a scale (FP8 cache or output): a tensor is read on the device,
    where :func:`call_tensors` passes it; an unused scale is 1."""
    if not used or scale is None:
        return 1.0, False
    if isinstance(scale, torch.Tensor):
        return 1.0, True
    return float(scale), False


@dataclass(frozen=True)
class KernelCall:
    """One launch of the kernel: grid, the tensor arguments, the scalar arguments, constexprs and options.

    ``tensors`` come first in the kernel's signature, then ``scalars``, then the constexprs; a launch passes
    ``*tensors, *scalars`` positionally and ``constexprs`` plus ``options`` (warps, stages) by keyword.
    """

    grid: tuple[int, int]
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


def call_tensors(p: PrefillProblem) -> tuple:
    """The kernel's tensor arguments for ``p``, in signature order (placeholders where a feature is off).

    The one definition of that order: :func:`kernel_call` builds on it and :class:`BoundLaunch` receives it
    on every call, so it does no more than read attributes.
    """
    q, c, o = p.q, p.cache, p.options
    k, v = (q, q) if p.k is None else (p.k, p.v)
    fp8 = c.dtype.is_fp8
    k_scale = c.k_scale if fp8 and isinstance(c.k_scale, torch.Tensor) else q
    v_scale = c.v_scale if fp8 and isinstance(c.v_scale, torch.Tensor) else q
    out_scale = o.fp8_out_scale
    b = p.batch
    return (q, k, v, p.out, c.key, c.value, b.block_table, b.query_start, b.seq_lens, b.context_lens,
            q if o.alibi_slopes is None else o.alibi_slopes, q if o.sinks is None else o.sinks,
            k_scale, v_scale, out_scale if isinstance(out_scale, torch.Tensor) else q)


def kernel_call(problem: PrefillProblem, config: TileConfig) -> Optional[KernelCall]:
    """The kernel launch that computes ``problem`` with ``config``, or None when there is nothing to do."""
    p = problem
    q, out = p.q, p.out
    T, H, D = q.shape
    B = p.batch.num_seqs
    if T == 0 or B == 0 or H == 0:
        return None
    group = H // p.num_kv_heads
    shape = ProblemShape(head_size=D, num_heads=H, num_kv_heads=p.num_kv_heads, dtype=q.dtype, num_tokens=T,
                         num_seqs=B, block_size=p.cache.block_size)
    config = settle(config, shape)  # a no-op for configs from a policy; raw configs (tests, sweeps) get the rule
    head_chunks = triton.cdiv(group, config.heads_per_tile)
    d_pad = padded_head_size(D)
    key, value, x, ks, vs, k_align, v_align = _cache_geometry(p, d_pad)
    fp8 = p.cache.dtype.is_fp8
    k_scale, k_from_ptr = _scale_arg(p.cache.k_scale, fp8)
    v_scale, v_from_ptr = _scale_arg(p.cache.v_scale, fp8)
    opts = p.options
    causal, skip_decode = opts.causal, opts.skip_decode
    window = opts.sliding_window  # None: no window (the kernel's int argument is then unused; 0 is passed)
    out_scale = opts.fp8_out_scale
    out_scale_value, out_from_ptr = _scale_arg(out_scale, True)
    new_kv_in_cache = p.k is None
    table = p.batch.block_table
    bs = p.cache.block_size
    new_strides = (0, 0, 0, 0) if new_kv_in_cache else (p.k.stride(0), p.k.stride(1), p.v.stride(0), p.v.stride(1))
    tensors = call_tensors(p)
    tensors = tensors[:4] + (key, value) + tensors[6:]  # FP8 bytes as float8: the kernel converts them
    scalars = (
        p.sm_scale, k_scale, v_scale, out_scale_value, float(opts.softcap), window or 0,
        B, T, p.cache.num_blocks, table.shape[1], bs, group,
        q.stride(0), q.stride(1), *new_strides, out.stride(0), out.stride(1),
        *ks, *vs,
        table.stride(0), table.stride(1),
    )
    constexprs = dict(
        HEAD_SIZE=D, HEAD_SIZE_PADDED=d_pad, X=x,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEADS_PER_TILE=config.heads_per_tile,
        HEAD_CHUNKS=head_chunks, SPLIT_MASKS=config.split_masks, WINDOW=window is not None,
        SOFTCAP=opts.softcap > 0, ALIBI=opts.alibi_slopes is not None, SINKS=opts.sinks is not None,
        K_SCALE_PTR=k_from_ptr, V_SCALE_PTR=v_from_ptr, PAGE_SIZE=bs if config.pagewise else 0,
        SPLIT_CACHE=p.cache.layout is KVLayout.SPLIT, K_ALIGN=k_align, V_ALIGN=v_align,
        CAUSAL=causal, SKIP_DECODE=skip_decode, NEW_KV_IN_CACHE=new_kv_in_cache,
        OUT_SCALE=out_scale is not None, OUT_SCALE_PTR=out_from_ptr, OUT_MAX=FP8_E4M3_MAX,
        DOT_PRECISION=config.fp32_dot if q.dtype == torch.float32 else "tf32",
    )
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    grid = launch_grid(shape, config)
    return KernelCall(grid, tensors, scalars, constexprs, options)


def launch_prefill(problem: PrefillProblem, config: TileConfig):
    """Run the prefix-prefill kernel for ``problem`` (already validated) with ``config``.

    Returns Triton's compiled-kernel handle (its ``metadata.shared`` is the shared memory it uses), or None
    when there was nothing to launch.
    """
    call = kernel_call(problem, config)
    if call is None:
        return None
    with device_guard(problem.q.device):
        return prefix_prefill_kernel[call.grid](*call.args, **call.kwargs)


def _launches_hooked() -> bool:
    """Whether something (a profiler) asked Triton to be told of every launch."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class BoundLaunch:
    """A compiled specialisation of the kernel, launched without Triton's per-call argument binding.

    Built from one :class:`KernelCall` after Triton compiled it; valid for any later problem with the same
    call signature (shapes, strides, dtypes, scalars, options) whose tensors are 16-byte aligned like the
    first one's, which :meth:`__call__` checks (it returns False and launches nothing otherwise).
    """

    __slots__ = ("_run", "_function", "_metadata", "_grid", "_tail", "_aligned", "_device_index", "_stream")

    def __init__(self, compiled: Any, call: KernelCall, device: torch.device, kernel: Any = prefix_prefill_kernel):
        from triton.runtime import driver

        self._run = compiled.run
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._grid = call.grid
        # Constexprs are passed positionally too: the launcher skips them by the kernel's signature.
        names = kernel.arg_names
        n = len(call.tensors) + len(call.scalars)
        self._tail = call.scalars + tuple(call.constexprs[name] for name in names[n:])
        # Only tensors carry an alignment the compiled code may assume (a TMA descriptor checks its own).
        self._aligned = tuple(isinstance(t, torch.Tensor) and _aligned16(t) for t in call.tensors)
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._stream = driver.active.get_current_stream

    def __call__(self, tensors: tuple) -> bool:
        """Launch with ``tensors`` (:func:`call_tensors` of a problem with this signature) on the current
        stream of the device it was compiled for; False, launching nothing, when that is not possible."""
        if torch.cuda.current_device() != self._device_index or _launches_hooked():
            return False  # another device is current, or a profiler hooks launches: Triton's own path serves
        for t, was in zip(tensors, self._aligned):
            if was and t.data_ptr() % 16:
                return False  # the compiled code assumes 16-byte alignment this tensor lacks
        g0, g1 = self._grid
        self._run(g0, g1, 1, self._stream(self._device_index), self._function, self._metadata, None, None, None,
                  *tensors, *self._tail)
        return True


def bind_launch(problem: PrefillProblem, config: TileConfig) -> Optional[BoundLaunch]:
    """Launch ``problem`` through Triton's JIT (compiling on first use) and return a :class:`BoundLaunch` for
    later calls with the same signature; None when there was nothing to launch or no GPU driver runs it."""
    call = kernel_call(problem, config)
    if call is None:
        return None
    device = problem.q.device
    with device_guard(device):
        compiled = prefix_prefill_kernel[call.grid](*call.args, **call.kwargs)
    if device.type != "cuda" or not hasattr(compiled, "packed_metadata"):
        return None  # the interpreter and other drivers keep the JIT path
    return BoundLaunch(compiled, call, device)
