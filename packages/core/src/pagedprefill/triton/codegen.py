"""Ahead-of-time compilation of the kernel for a GPU that is not present, and what its code looks like.

Triton compiles for any NVIDIA target without a GPU. :func:`compile_for_target` binds a problem's launch
arguments exactly as a real launch would (the same specialisation of pointer alignment, divisibility by 16
and integers equal to 1) and compiles for the given compute capability; :func:`codegen_summary` reads the
result: registers and spills (from ``ptxas``), shared memory, whether the dots became Hopper's warpgroup
MMA (``wgmma``) or stayed ``mma.sync``, how many asynchronous copies (``cp.async``) and tensor-memory
copies (TMA) the loops issue, and how deep the key loops are pipelined.

This answers "will this tile be fast" questions (spills, no ``wgmma``, loads not pipelined) before any
GPU time is spent. ``ci/codegen_report.py`` prints the report for every policy tile of the bench suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Optional

from ..tiling import TileConfig
from ..types import PrefillProblem


@dataclass(frozen=True)
class CodegenSummary:
    """What the compiled kernel looks like for one (problem, tile, target)."""

    capability: int
    registers: Optional[int]
    spill_bytes: Optional[int]
    shared_bytes: int
    wgmma: int
    mma_sync: int
    async_copies: int
    tma_copies: int
    pipelined_waits: int
    unpipelined_loads: int
    setmaxnreg: int = 0
    warp_specialized: bool = False

    @property
    def dots(self) -> str:
        if self.wgmma:
            return "wgmma"
        return "mma.sync" if self.mma_sync else "none"

    def to_dict(self) -> dict:
        return {**self.__dict__, "dots": self.dots}


def compile_for_target(problem: PrefillProblem, config: TileConfig, capability: int = 90):
    """Compile core's kernel for ``problem`` with ``config`` for NVIDIA ``sm_<capability>``, without a GPU.

    Returns Triton's compiled kernel (``asm["ttgir"]``, ``asm["ptx"]``, ``metadata.shared``).
    """
    from .kernel import prefix_prefill_kernel
    from .launch import kernel_call

    call = kernel_call(problem, config)
    if call is None:
        raise ValueError("problem: has nothing to compute (no tokens, sequences or heads)")
    return compile_call(prefix_prefill_kernel, call, capability)


def compile_call(kernel, call, capability: int = 90):
    """Compile ``kernel`` (a Triton or Gluon JIT function) for the launch ``call`` (a
    :class:`~pagedprefill.triton.launch.KernelCall`) for NVIDIA ``sm_<capability>``, binding the arguments
    exactly as a real launch would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    args, kwargs = call.args, call.kwargs
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def ptxas_usage(ptx: str, capability: int) -> tuple[Optional[int], Optional[int]]:
    """``(registers, spill bytes)`` reported by the ``ptxas`` that ships with Triton (None when absent)."""
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(exe):
        return None, None
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    report = done.stderr + done.stdout
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", report)
    return (int(regs.group(1)) if regs else None), (max(int(s) for s in spills) if spills else None)


def loop_pipelining(ttgir: str) -> tuple[int, int]:
    """``(pipelined waits, 2-D tile loads left synchronous)`` inside the key loops of TTGIR.

    A pipelined loop waits at its top for copies issued iterations earlier (``async_wait`` with a
    positive count); a K or V tile read with a plain ``tt.load`` inside a loop stalls every iteration.
    """
    pipelined = len(re.findall(r"ttg\.async_wait .*\{num = [1-9]", ttgir))
    unpipelined = 0
    for body in re.split(r"\bscf\.for\b", ttgir)[1:]:
        body = body.split("scf.yield", 1)[0]
        unpipelined += len(re.findall(r"tt\.load [^\n]*tensor<\d+x\d+x!tt\.ptr", body))
    return pipelined, unpipelined


def codegen_summary(problem: PrefillProblem, config: TileConfig, capability: int = 90,
                    compiled=None) -> CodegenSummary:
    """Summarise the code compiled for ``sm_<capability>`` (core's kernel for ``problem`` and ``config``,
    unless a backend passes its own ``compiled`` kernel)."""
    if compiled is None:
        compiled = compile_for_target(problem, config, capability)
    return summarize(compiled, capability)


def summarize(compiled, capability: int) -> CodegenSummary:
    """What a compiled kernel's PTX and TTGIR hold (see :class:`CodegenSummary`)."""
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    registers, spills = ptxas_usage(ptx, capability)
    pipelined, unpipelined = loop_pipelining(ttgir)
    return CodegenSummary(
        capability=capability,
        registers=registers,
        spill_bytes=spills,
        shared_bytes=int(compiled.metadata.shared),
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=len(re.findall(r"\bmma\.sync\b", ptx)),
        async_copies=len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)),
        tma_copies=ptx.count("cp.async.bulk.tensor"),
        pipelined_waits=pipelined,
        unpipelined_loads=unpipelined,
        setmaxnreg=ptx.count("setmaxnreg"),
        warp_specialized="ttg.warp_specialize" in ttgir,
    )
