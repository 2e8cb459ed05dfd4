"""``Backend.run_tile``: how ``pagedprefill tune`` runs each tile of a search space instead of the policy's."""

import os

import pytest
from pagedprefill import get_registry
from pagedprefill.device import DeviceInfo
from pagedprefill.testing import DEFAULT_TOLERANCES, assert_matches_reference, case_spec, make_problem
from pagedprefill.tiling import TileConfig


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64)])
def test_run_tile_runs_the_given_tile_and_matches_the_reference(block_m, block_n, pagedprefill_device,
                                                                pagedprefill_size):
    if pagedprefill_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on the CPU need TRITON_INTERPRET=1")
    spec = case_spec("long_query", pagedprefill_size, 0)
    problem = make_problem(spec, pagedprefill_device)
    config = TileConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1)
    get_registry().get("generic").run_tile(problem, config, DeviceInfo.detect(pagedprefill_device))
    atol, rtol = DEFAULT_TOLERANCES[spec.dtype]
    assert_matches_reference(problem.out, problem, atol, rtol, label=f"run_tile {block_m}x{block_n}")


def test_a_backend_without_a_search_space_refuses_by_name(pagedprefill_device):
    problem = make_problem(case_spec("basic", "small", 0), pagedprefill_device)
    config = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    with pytest.raises(NotImplementedError, match="'reference' runs only its policy's tiles"):
        get_registry().get("reference").run_tile(problem, config, DeviceInfo.detect(pagedprefill_device))
