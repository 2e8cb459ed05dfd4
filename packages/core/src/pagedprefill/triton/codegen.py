"""Ahead-of-time compilation of the kernel for a GPU that is not present, and what its code looks like.

Triton compiles for any NVIDIA target without a GPU. :func:`compile_for_target` binds a problem's launch
arguments exactly as a real launch would (the same specialisation of pointer alignment, divisibility by 16
and integers equal to 1) and compiles for the given compute capability; :func:`codegen_summary` reads the
result: registers and spills (from ``ptxas``), shared memory, whether the dots became Hopper's warpgroup
MMA (``wgmma``) or stayed ``mma.sync``, how many asynchronous copies (``cp.async``) and tensor-memory
copies (TMA) the loops issue, how deep the key loops are pipelined, and (from the SASS) whether any
instruction touches registers an asynchronous warpgroup MMA still owns.

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
    #: Instructions touching registers an in-flight warpgroup MMA owns (:func:`wgmma_register_hazards`); None
    #: when there is no disassembler.
    wgmma_hazards: Optional[int] = None

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


def argument_specialization(kernel, call, capability: int = 90) -> dict:
    """How Triton specialises each argument of ``kernel`` (a Triton or Gluon JIT function) for the launch ``call``,
    by parameter name: the type and the value class it keys its compiled kernels on (an integer equal to 1 becomes a
    constant, one divisible by 16 is marked so). Two launches whose answers differ compile twice; no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", capability, 32))
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, specialization, _ = bind(*call.args, **call.kwargs)
    return {param.name: str(spec) for param, spec in zip(kernel.params, specialization)}


def _bundled_tool(name: str) -> Optional[str]:
    """The path of one of the NVIDIA tools that ship with Triton (``ptxas``, ``nvdisasm``), or None."""
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return exe if os.path.exists(exe) else None


def ptxas_usage(ptx: str, capability: int) -> tuple[Optional[int], Optional[int]]:
    """``(registers, spill bytes)`` reported by the ``ptxas`` that ships with Triton (None when absent)."""
    exe = _bundled_tool("ptxas")
    if exe is None:
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


def sass(compiled) -> Optional[str]:
    """The SASS of a compiled kernel, from the ``nvdisasm`` that ships with Triton (None when absent)."""
    exe = _bundled_tool("nvdisasm")
    if exe is None or "cubin" not in compiled.asm:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        done = subprocess.run([exe, "-c", path], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


_SASS_LINE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_HGMMA = re.compile(r"HGMMA\.64x(\d+)x\d+")
_REGISTER = re.compile(r"\bR(\d+)\b")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
#: Instructions whose first operand is not a register they write.
_NO_DESTINATION = ("ST", "STS", "STG", "STL", "RED", "BAR", "BRA", "EXIT", "WARPGROUP", "SYNCS", "UTMA", "RET",
                   "CALL", "MEMBAR", "FENCE", "NOP", "WARPSYNC", "BSYNC", "BSSY", "ARRIVES", "UBLKCP")


def _written(opcode: str, operands: str) -> set:
    """Registers an instruction writes: its first operand and, for wide results, the ones after it."""
    if opcode.startswith(_NO_DESTINATION) or opcode.startswith("HGMMA"):
        return set()
    first = _REGISTER.match(operands.strip())
    if first is None:
        return set()
    width = 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode) else 1
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def wgmma_register_hazards(sass_text: str) -> list[str]:
    """Instructions that touch registers an in-flight warpgroup MMA owns, before the wait that retires it.

    An asynchronous ``HGMMA`` reads its A operand from registers (four per thread) and accumulates into
    registers until a ``WARPGROUP.DEPBAR`` retires its group; writing the A registers, or reading or writing the
    accumulator, before then is undefined. Walks the SASS in layout order (a lint: control flow is not
    followed) and returns one line per offending instruction.
    """
    pending: list[tuple[set, set]] = []  # committed groups, oldest first: (A registers, accumulators)
    group_a, group_acc = set(), set()
    found = []
    for line in sass_text.splitlines():
        match = _SASS_LINE.search(line)
        if not match:
            continue
        opcode, operands = match.groups()
        hgmma = _HGMMA.match(opcode)
        if hgmma:
            regs = [int(r) for r in _REGISTER.findall(operands)]
            n = int(hgmma.group(1))
            acc0 = regs[0] if regs else None
            if acc0 is not None:
                group_acc |= set(range(acc0, acc0 + n // 2))
            tokens = [t.strip() for t in operands.split(",")]
            if len(tokens) > 1 and _REGISTER.fullmatch(tokens[1].split(".")[0]):
                a0 = int(tokens[1][1:].split(".")[0])
                group_a |= set(range(a0, a0 + 4))
            if "gsb0" in operands:
                pending.append((group_a, group_acc))
                group_a, group_acc = set(), set()
            continue
        depbar = _DEPBAR.search(line)
        if depbar:
            keep = int(depbar.group(1), 16)
            while len(pending) > keep:
                pending.pop(0)
            continue
        if not pending:
            continue
        written = _written(opcode, operands)
        read = {int(r) for r in _REGISTER.findall(operands)} - written
        for a_regs, acc_regs in pending:
            clash = (written & (a_regs | acc_regs)) | (read & acc_regs)
            if clash:
                found.append(f"{line.strip()}  <- R{min(clash)} is still owned by an in-flight HGMMA")
                break
    return found


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
    disassembly = sass(compiled) if "wgmma.mma_async" in ptx else ""
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
        wgmma_hazards=None if disassembly is None else len(wgmma_register_hazards(disassembly)),
    )
