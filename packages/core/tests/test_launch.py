"""The launcher's argument lists: the direct launch of a compiled kernel must pass exactly what Triton would."""

import importlib.util

import pytest
import torch
from pagedprefill.testing import CASES, case_spec, make_problem
from pagedprefill.tiling import TileConfig, settle

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.mark.parametrize("case", sorted(CASES))
def test_call_tensors_are_the_kernel_calls_tensors(case):
    from pagedprefill.triton.kernel import prefix_prefill_kernel
    from pagedprefill.triton.launch import call_tensors, kernel_call

    problem = make_problem(case_spec(case, "small", 0))
    call = kernel_call(problem, settle(TileConfig(), _shape(problem)))
    fast = call_tensors(problem)
    # the groups' sizes (plain tuples: the driver's launcher flattens them as it does Triton's named ones)
    assert [len(group) for group in fast] == [len(group) for group in call.tensors]
    # the same memory (FP8 caches are passed as float8 views to the JIT, as their bytes to a bound launch)
    assert [t.data_ptr() for group in fast for t in group] == [t.data_ptr() for group in call.tensors for t in group]
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


def _shape(problem):
    from pagedprefill.backends.triton_base import problem_shape

    return problem_shape(problem)


def test_kernel_signature_is_grouped():
    import inspect

    import triton.language as tl
    from pagedprefill.triton.kernel import prefix_prefill_kernel

    params = inspect.signature(prefix_prefill_kernel.fn).parameters.values()
    assert len(params) <= 30
    assert sum(p.annotation is tl.constexpr for p in params) <= 6


def test_unsettled_pagewise_tile_is_refused():
    from pagedprefill.triton.launch import kernel_call

    problem = make_problem(case_spec("block_size_7", "small", 0))
    with pytest.raises(ValueError, match="page-wise"):
        kernel_call(problem, TileConfig(pagewise=True))
    assert kernel_call(problem, settle(TileConfig(pagewise=True), _shape(problem))) is not None


class _Recorded:
    """A compiled kernel's stand-in that records what its launcher is handed."""

    function = "function"
    packed_metadata = (4, 1, 0)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Driver:
    @staticmethod
    def get_current_stream(device):
        return "stream"


@pytest.mark.parametrize("case", ["alibi", "fp8_split_tensor_scales", "kv_in_cache", "vllm_options"])
def test_bound_launch_hands_the_launcher_what_triton_does(case, monkeypatch):
    """``BoundLaunch`` passes the launcher the kernel's arguments exactly as ``JITFunction.run`` does: the
    bound arguments in signature order, tuple groups as the tuples they are, constexprs included."""
    from pagedprefill.triton.kernel import prefix_prefill_kernel
    from pagedprefill.triton.launch import BoundLaunch, call_tensors, kernel_call
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import driver
    from triton.runtime.jit import create_function_from_signature

    kernel = prefix_prefill_kernel
    if not hasattr(kernel, "params"):
        pytest.skip("compares with Triton's JIT, which TRITON_INTERPRET=1 replaces")
    problem = make_problem(case_spec(case, "small", 0))
    call = kernel_call(problem, settle(TileConfig(), _shape(problem)))
    # What JITFunction.run hands kernel.run after the grid, stream, function, metadata and hooks.
    bind = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    bound_args, _, _ = bind(*call.args, **call.kwargs)
    expected = tuple(bound_args.values())

    compiled = _Recorded()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(driver, "_active", _Driver())
    launch = BoundLaunch(compiled, call, torch.device("cuda", 0))
    # A later call passes call_tensors: the cache's FP8 bytes instead of the float8 views, the same memory.
    assert launch(call_tensors(problem))
    (args,) = compiled.calls
    grid = call.grid
    assert args[:9] == (grid[0], grid[1], 1, "stream", "function", (4, 1, 0), None, None, None)
    passed = args[9:]
    assert len(passed) == len(expected) == len(kernel.arg_names)
    for got, want in zip(passed, expected):
        # A tensor group may come as a plain tuple: the driver's launcher reads every tuple by position.
        assert type(got) is type(want) or (isinstance(got, tuple) and isinstance(want, tuple))
        _assert_same(got, want)


def _assert_same(got, want):
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        assert got.data_ptr() == want.data_ptr()
    else:
        assert got == want and type(got) is type(want)


def _misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, strides and dtype whose data starts one element past a 16-byte boundary."""
    assert t.element_size() < 16
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    buffer = torch.zeros(extent + 16, dtype=t.dtype)
    to_boundary = (-buffer.data_ptr() % 16) // t.element_size()
    view = torch.as_strided(buffer, t.shape, t.stride(), storage_offset=to_boundary + 1)
    assert view.data_ptr() % 16 == t.element_size()
    return view


@pytest.mark.parametrize("case", ["basic", "fp8_split_tensor_scales", "alibi", "sinks"])
def test_bound_launch_declines_a_tensor_less_aligned_than_the_first_calls(case, monkeypatch):
    """The compiled code may assume every tensor that was 16-byte aligned at compile time still is: a later call
    with any one of them misaligned launches nothing (and takes the full path), the others launch."""
    from pagedprefill.triton.launch import BoundLaunch, call_tensors, kernel_call
    from triton.runtime import driver

    problem = make_problem(case_spec(case, "small", 0))
    call = kernel_call(problem, settle(TileConfig(), _shape(problem)))
    compiled = _Recorded()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(driver, "_active", _Driver())
    launch = BoundLaunch(compiled, call, torch.device("cuda", 0))
    tensors = call_tensors(problem)
    positions = [(i, j) for i, group in enumerate(tensors) for j, t in enumerate(group)
                 if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() % 16 == 0]
    assert len(positions) >= 8, positions  # q, k, v, out, both caches, the table and the lengths at least
    for i, j in positions:
        group = list(tensors[i])
        group[j] = _misaligned_like(group[j])
        assert launch(tensors[:i] + (tuple(group),) + tensors[i + 1:]) is False, (i, j)
    assert compiled.calls == []
    assert launch(tensors) is True and len(compiled.calls) == 1


def test_a_split_launch_runs_the_combine_on_the_first_launchs_groups_and_not_after_a_refusal():
    from pagedprefill.triton.launch import SplitLaunch, combine_tensors

    groups = tuple(f"group{i}" for i in range(6))
    seen = []
    combine = lambda tensors: seen.append(tensors) or True  # noqa: E731
    own = ("descriptor", *groups)  # a backend kernel's tensors: core's groups among its own
    assert SplitLaunch(lambda tensors: True, combine, lambda tensors: tensors[1:])(own)
    assert seen == [combine_tensors(groups)] == [("group0", "group2", "group3", "group4", "group5")]
    assert not SplitLaunch(lambda tensors: False, combine)(groups)
    assert len(seen) == 1  # a first launch that declined launches no combine
