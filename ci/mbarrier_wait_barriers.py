"""How many warp barriers Triton's sm90 code puts around mbarrier operations in a loop, without a GPU.

The Hopper kernel's consumers wait on a ``ready`` barrier and hand the buffer back on an ``empty`` barrier once
per key tile. This script compiles three small Gluon loops for sm90 and prints the warp barriers
(``bar.sync``) in each loop body: one of waits on a barrier chosen at run time, one of waits on two barriers
fixed at compile time, and one of a wait followed by a one-thread arrival on another barrier. Where the
installed Triton's shared-memory hazard analysis puts a barrier before every wait, the kernel's consumers meet
at a barrier at the top of every key tile whatever the kernel does (docs/performance.md, "What limits each
gap": the long prefill).

Usage::

    python ci/mbarrier_wait_barriers.py
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _waits(out, n, FIXED: gl.constexpr, ARRIVE: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    others = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
        mbarrier.init(others.index(i), count=1)
    total = 0
    for i in range(n):
        if FIXED:
            mbarrier.wait(bars.index(0), i & 1)
            mbarrier.wait(bars.index(1), i & 1)
        else:
            mbarrier.wait(bars.index(i % 2), (i // 2) & 1)
        total += i
        if ARRIVE:
            mbarrier.arrive(others.index(i % 2), count=1)
    gl.store(out, total)


def loop_body(ptx: str) -> list[str]:
    """The PTX lines of the (only) loop of ``ptx``: from its header to its back edge."""
    lines = ptx.split(".section")[0].splitlines()
    header = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    # The header's label is on its own line, or on the line before the comment that names it the header.
    start = next(i for i in range(header, -1, -1) if re.match(r"\s*\$L__BB\d+_\d+:", lines[i]))
    label = lines[start].split(":")[0].strip()
    end = next(i for i in range(start + 1, len(lines)) if re.search(rf"\bbra(\.uni)?\s+{re.escape(label)};", lines[i]))
    body = (line.strip() for line in lines[start:end + 1])
    return [line for line in body if line and not line.startswith((".loc", "//"))]


def main() -> None:
    cases = (("waits on a barrier chosen at run time", False, False),
             ("waits on two barriers fixed at compile time", True, False),
             ("a wait, then a one-thread arrival on another barrier", False, True))
    for name, fixed, arrive in cases:
        source = GluonASTSource(_waits, signature={"out": "*i32", "n": "i32", "FIXED": "constexpr",
                                                   "ARRIVE": "constexpr"},
                                constexprs={"FIXED": fixed, "ARRIVE": arrive})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        body = loop_body(compiled.asm["ptx"])
        waits = sum("mbarrier.try_wait" in line for line in body)
        barriers = sum(bool(re.search(r"\b(bar|barrier)\.sync\b", line)) for line in body)
        print(f"{name}: {waits} wait(s), {barriers} warp barrier(s) per iteration (Triton {triton.__version__})")


if __name__ == "__main__":
    main()
