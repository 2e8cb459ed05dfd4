"""ci/gpu/guard_cost.py on the Hopper kernel: its copy without the guards (block-table columns clamped below at
0, block numbers outside the cache replaced by 0) must still be found and compile for sm90 as the kernel does,
so a change to the kernel's source that the script no longer recognises fails in CI, not on the GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_sm80_hopper import without_interpreter

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "guard_cost.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")

CHILD = f"""
import importlib.util, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
spec = importlib.util.spec_from_file_location("guard_cost", {str(SCRIPT)!r})
guard_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard_cost)
unguarded = guard_cost.unguarded_kernels(with_hopper=True)["hopper"]
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.triton.codegen import compile_call, summarize
from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel
from pagedprefill_sm80.hopper.launch import kernel_call
from pagedprefill_sm80.policy import hopper_config
from test_sm80_hopper import SPEC, make_problem
for layout in ("nhd", "split"):
    problem = make_problem(SPEC.replace(layout=layout))
    shape = problem_shape(problem)
    call = kernel_call(problem, hopper_config(shape), shape)
    for name, kernel in (("guarded", hopper_prefill_kernel), ("unguarded", unguarded)):
        s = summarize(compile_call(kernel, call, 90), 90)
        print(layout, name, s.registers, s.spill_bytes, s.wgmma, s.tma_copies, s.warp_specialized)
"""


def test_unguarded_copy_of_the_hopper_kernel_compiles_like_the_kernel():
    pytest.importorskip("triton.experimental.gluon", reason="the Hopper kernel is written in Gluon")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                          env=without_interpreter())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = {tuple(line.split()[:2]): line.split()[2:] for line in proc.stdout.splitlines() if line.strip()}
    for layout in ("nhd", "split"):
        guarded, unguarded = lines[(layout, "guarded")], lines[(layout, "unguarded")]
        # No spills, the same warpgroup MMAs and TMA copies, still warp-specialised: only guard arithmetic went.
        assert unguarded[1] == "0" and unguarded[2:] == guarded[2:], (layout, guarded, unguarded)
        assert unguarded[4] == "True", (layout, unguarded)
