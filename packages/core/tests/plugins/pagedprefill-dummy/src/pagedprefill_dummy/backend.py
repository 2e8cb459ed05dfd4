"""The ``dummy`` backend: priority 500, only for ``dummyvendor`` devices, computes with the reference."""

from __future__ import annotations

import pagedprefill
from pagedprefill.device import DeviceInfo
from pagedprefill.types import PrefillProblem

from . import VENDOR


class DummyBackend(pagedprefill.Backend):
    name = "dummy"
    priority = 500
    description = "test backend for dummyvendor devices (computes with the reference)"

    def __init__(self) -> None:
        self.calls = 0

    def supports(self, device: DeviceInfo) -> list[str]:
        if device.vendor != VENDOR:
            return [f"dummy runs only on {VENDOR} devices, not on vendor {device.vendor!r} ({device.name})"]
        return []

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        if problem.cache.dtype.is_fp8:
            raise pagedprefill.UnsupportedFeatureError(
                f"dummy: {device.name} has no FP8 cache support; use backend='reference'"
            )

    def run(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        self.calls += 1
        pagedprefill.reference_prefill(problem)
