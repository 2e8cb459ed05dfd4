"""Both ways the kernel addresses cached keys, against the reference: page-wise (``TileConfig.pagewise``, the
default wherever the block size allows it, which the conformance suite runs too) and per key (the path of
block sizes that do not tile evenly, forced here on block sizes that would allow page-wise addressing)."""

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.backends.triton_base import problem_shape
from pagedprefill.testing import DEFAULT_TOLERANCES, assert_matches_reference, case_spec, make_problem
from pagedprefill.tiling import pagewise_possible
from pagedprefill_generic import generic_policy

CASES = ["basic", "block_size_128", "block_size_32_split_fp8", "window_6", "decode_rows", "alibi", "gqa_3",
         "long_query", "sinks", "split_x_1", "split_x_4", "split_x_16", "split_x_8_fp8_e4m3", "split_x_1_float32"]


@pytest.mark.parametrize("pagewise", [True, False], ids=["page-wise", "per-key"])
@pytest.mark.parametrize("case", CASES)
def test_cache_addressing_matches_reference(case, pagewise, pagedprefill_device, pagedprefill_size):
    from pagedprefill.triton.launch import launch_prefill

    if pagedprefill_device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on the CPU need TRITON_INTERPRET=1")
    for seed in (0, 1):
        spec = case_spec(case, pagedprefill_size, seed)
        problem = make_problem(spec, pagedprefill_device)
        config = generic_policy(problem_shape(problem), DeviceInfo.detect(pagedprefill_device)).with_(pagewise=pagewise)
        assert pagewise_possible(problem.cache.block_size, config.block_n), "a case whose block size tiles evenly"
        launch_prefill(problem, config)
        atol, rtol = DEFAULT_TOLERANCES[spec.dtype]
        assert_matches_reference(problem.out, problem, atol, rtol, label=f"pagewise={pagewise}/{case}/seed={seed}")
        assert torch.isfinite(problem.out).all()
