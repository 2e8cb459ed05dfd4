"""The runs this repository's backends share in Triton's interpreter, and which suite owns each.

On the CPU the ``generic``, ``bi100`` and ``sm80`` backends all run core's portable kernel in Triton's
interpreter; what tells them apart there is each policy's tile. A conformance case that two of them run with the
same kernel and the same tile executes the same code on the same data twice, so only one suite runs it: the
first in :data:`SHARED_SUITES` whose suite runs it that way, and the others report it as a skip naming that
suite and case (:meth:`~pagedprefill.testing.conformance.ConformanceSuite.shared_owner`). Each suite still runs
every case whose tile is its own, the smoke cases (:data:`SMOKE_CASES`) and its random sweep, and on a GPU,
where each backend compiles its own kernels, nothing is shared.

The owner is decided from the backends' policies alone, the same way in every process: a suite computes what
the earlier suites of :data:`SHARED_SUITES` run from their backends and the devices their policies are told of
there, not from which tests ran before it. Each suite checks, case by case, that it runs what that view says
it does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import get_registry
from ..device import DeviceInfo, interpreter_enabled
from ..registry import BackendUnavailableError
from ..tiling import TileConfig

#: The backends whose conformance suites share their runs in Triton's interpreter, in the order that owns a
#: shared run (the first whose suite runs it), each with the described device (``pagedprefill info --describe
#: NAME``) its suite's policy plans for there, or None for the CPU as detected. The generic backend comes first:
#: it runs every case the others run, with the tiles any Triton device gets. A backend outside this table runs
#: every case of its suite.
SHARED_SUITES: dict[str, Optional[str]] = {"generic": None, "bi100": "bi-v100", "sm80": "a100"}

#: Named cases every suite runs even where an earlier suite runs them the same way: a backend that cannot run at
#: all fails its own suite, whichever tiles the others share.
SMOKE_CASES = frozenset({"basic"})

#: The fields of a tile that reach the kernel in Triton's interpreter: those the launch passes as the kernel's
#: constexprs (``TILE``, and ``LAYOUT``'s page-wise addressing; the kernel the tile names is the route a run
#: records beside them). ``num_warps`` and ``num_stages`` are options for the compiler, and the interpreter drops
#: them (it hands a kernel only its own parameters), so tiles that differ only there run the same code.
INTERPRETED_TILE_FIELDS = ("block_m", "block_n", "heads_per_tile", "split_masks", "pagewise", "fp32_dot",
                           "key_splits")


def shares_runs(backend: str, device: torch.device) -> bool:
    """Whether the suite of ``backend`` on ``device`` shares its runs with the other suites of
    :data:`SHARED_SUITES`: on the CPU under ``TRITON_INTERPRET=1`` only."""
    return device.type == "cpu" and interpreter_enabled() and backend in SHARED_SUITES


def interpreted_tile(config: TileConfig) -> tuple:
    """``config`` as the kernel receives it in Triton's interpreter (:data:`INTERPRETED_TILE_FIELDS`)."""
    values = config.to_dict()
    return tuple((name, values[name]) for name in INTERPRETED_TILE_FIELDS)


def describe_tile(tile: tuple) -> str:
    """An :func:`interpreted_tile` in words: ``block_m=32, block_n=16, ...``."""
    return ", ".join(f"{name}={value!r}" for name, value in tile)


def interpreter_device(backend: str, device: torch.device) -> DeviceInfo:
    """The device the policy of ``backend`` (one of :data:`SHARED_SUITES`) is told of when its suite runs on
    ``device`` in the interpreter."""
    name = SHARED_SUITES[backend]
    if name is None:
        return DeviceInfo.detect(device)
    from ..cli.info import described_devices

    return described_devices()[name]


def earlier_suites(backend: str) -> list[str]:
    """The installed backends of :data:`SHARED_SUITES` before ``backend``, in order: the suites that own a run
    they share with it."""
    names = list(SHARED_SUITES)
    return [name for name in names[:names.index(backend)] if _installed(name)]


def _installed(name: str) -> bool:
    try:
        get_registry().get(name)
    except BackendUnavailableError:
        return False
    return True
