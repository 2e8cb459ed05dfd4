"""A Triton backend hands each call to the route its tile's kernel names, and to core's kernel where that route
cannot take the call (backends/routes.py); no launch happens here: the routes record what they were given."""

from __future__ import annotations

import pytest
from pagedprefill.backends.routes import PORTABLE, KernelRoute
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import TileConfig
from pagedprefill.workloads import BatchSpec, make_problem

OWN_TILE = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, kernel="own")
PORTABLE_TILE = TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


class RecordingRoute(KernelRoute):
    """A kernel of the backend's own that takes calls while ``refuse`` is None, and records every call."""

    name = "own"
    title = "own kernel"

    def __init__(self, refuse=None):
        self.refuse, self.calls = refuse, []

    def unfit_reason(self, problem, config, shape, device):
        return self.refuse

    def run(self, problem, config, shape):
        self.calls.append(("run", config))

    def bind(self, problem, config, shape):
        self.calls.append(("bind", config))
        return None  # no launcher: the backend runs later calls again through run()


class RecordingPortable(RecordingRoute):
    name = "portable"


def backend_with(own: RecordingRoute, portable: RecordingRoute):
    class OwnKernelBackend(TritonBackend):
        name = "own-kernel"
        routes = {"portable": portable, "own": own}

        def tile_config(self, shape, device):
            return OWN_TILE

        def portable_tile(self, shape, device):
            return PORTABLE_TILE

    return OwnKernelBackend()


@pytest.fixture
def problem():
    return make_problem(BatchSpec(query_lens=(5, 1, 17), context_lens=(9, 0, 33)))


CPU = DeviceInfo.detect("cpu")


def test_a_call_goes_to_the_route_its_tile_names(problem):
    own, portable = RecordingRoute(), RecordingPortable()
    backend = backend_with(own, portable)
    route, config, _ = backend.route_for(problem, CPU)
    assert (route, config) == (own, OWN_TILE)
    assert backend.kernel_for(problem, CPU) == "own"
    backend.run(problem, CPU)
    plan = backend.bind(problem, CPU)
    assert own.calls == [("run", OWN_TILE), ("bind", OWN_TILE)] and portable.calls == []
    assert plan(problem) is True and own.calls[-1] == ("run", OWN_TILE)  # no launcher: runs again


def test_a_call_the_route_cannot_take_runs_on_core_kernel_with_the_portable_tile(problem):
    own = RecordingRoute(refuse="needs 16-byte aligned strides")
    backend = backend_with(own, PORTABLE)
    route, config, _ = backend.route_for(problem, CPU)
    assert (route, config) == (PORTABLE, PORTABLE_TILE)
    assert backend.kernel_for(problem, CPU) == "portable"


def test_run_tile_refuses_a_tile_its_kernel_cannot_take_naming_the_kernel_and_why(problem):
    own = RecordingRoute(refuse="needs 16-byte aligned strides")
    backend = backend_with(own, RecordingPortable())
    with pytest.raises(ValueError, match="config: the own kernel needs 16-byte aligned strides"):
        backend.run_tile(problem, OWN_TILE, CPU)
    assert own.calls == []
    own.refuse = None
    backend.run_tile(problem, OWN_TILE, CPU)
    assert own.calls == [("run", OWN_TILE)]


def test_the_sm80_backend_routes_hopper_tiles_to_its_kernel_and_the_rest_to_core():
    sm80 = pytest.importorskip("pagedprefill_sm80", reason="the sm80 backend is not installed")
    routes = sm80.Sm80Backend.routes
    assert set(routes) == {"portable", "hopper"} and routes["portable"] is PORTABLE
    assert routes["hopper"].title == "Hopper kernel"
