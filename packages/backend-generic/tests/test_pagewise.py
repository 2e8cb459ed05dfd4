"""The kernel's page-wise cache addressing (``TileConfig.pagewise``), off by default, against the reference."""

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.testing import DEFAULT_TOLERANCES, assert_matches_reference, case_spec, make_problem
from pagedprefill_generic import generic_policy

CASES = ["basic", "block_size_128", "block_size_32_split_fp8", "window_6", "decode_rows", "alibi", "gqa_3",
         "long_query", "sinks", "split_x_1", "split_x_4", "split_x_16", "split_x_8_fp8_e4m3", "split_x_1_float32"]


@pytest.mark.parametrize("case", CASES)
def test_pagewise_addressing_matches_reference(case, pagedprefill_device, pagedprefill_size):
    from pagedprefill.triton.launch import launch_prefill

    if pagedprefill_device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on the CPU need TRITON_INTERPRET=1")
    for seed in (0, 1):
        spec = case_spec(case, pagedprefill_size, seed)
        problem = make_problem(spec, pagedprefill_device)
        config = generic_policy(problem_shape(problem), DeviceInfo.detect(pagedprefill_device)).with_(pagewise=True)
        bs = problem.cache.block_size
        assert bs & (bs - 1) == 0 and (config.block_n % bs == 0 or bs % config.block_n == 0), "not page-wise"
        launch_prefill(problem, config)
        atol, rtol = DEFAULT_TOLERANCES[spec.dtype]
        assert_matches_reference(problem.out, problem, atol, rtol, label=f"pagewise/{case}/seed={seed}")
        assert torch.isfinite(problem.out).all()
