"""The launcher's argument lists: the direct launch of a compiled kernel must pass exactly what Triton would."""

import importlib.util

import pytest
from pagedprefill.testing import CASES, case_spec, make_problem
from pagedprefill.tiling import TileConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.mark.parametrize("case", sorted(CASES))
def test_call_tensors_are_the_kernel_calls_tensors(case):
    from pagedprefill.triton.kernel import prefix_prefill_kernel
    from pagedprefill.triton.launch import call_tensors, kernel_call

    problem = make_problem(case_spec(case, "small", 0))
    call = kernel_call(problem, TileConfig())
    fast = call_tensors(problem)
    assert len(fast) == len(call.tensors)
    # the same memory (FP8 caches are passed as float8 views to the JIT, as their bytes to a bound launch)
    assert [t.data_ptr() for t in fast] == [t.data_ptr() for t in call.tensors]
    names = prefix_prefill_kernel.arg_names
    # tensors, then scalars, then every constexpr: the positional order of the kernel's signature
    assert len(call.tensors) + len(call.scalars) + len(call.constexprs) == len(names)
    assert set(call.constexprs) == set(names[len(call.tensors) + len(call.scalars):])


def test_launch_hooks_send_launches_through_triton():
    from pagedprefill.triton.launch import _launches_hooked
    from triton import knobs

    assert not _launches_hooked()
    hook = knobs.runtime.launch_enter_hook

    def seen(*args):
        return None

    hook.add(seen)
    try:
        assert _launches_hooked()
    finally:
        hook.remove(seen)
    assert not _launches_hooked()
