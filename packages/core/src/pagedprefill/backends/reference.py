"""The built-in ``reference`` backend: PyTorch ops on any device, lowest priority.

A thin wrapper; the implementation itself is :func:`pagedprefill.reference_impl.reference_prefill`.
"""

from __future__ import annotations

from ..device import DeviceInfo
from ..reference_impl import reference_prefill
from ..registry import Backend, hookimpl
from ..types import FEATURES, PrefillProblem


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    description = "pure PyTorch, float32 accumulation, every feature, any device (slow; the test oracle)"
    #: Every optional feature (see :mod:`pagedprefill.features`).
    supported_features = FEATURES
    #: It reads lengths on the host anyway, so dispatch also checks the metadata values (block numbers,
    #: lengths) with ``validate="basic"``: a bad block table is a clear error, not an ``IndexError``.
    reads_metadata_on_host = True

    def supports(self, device: DeviceInfo) -> list[str]:
        return []

    def run(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        reference_prefill(problem)


@hookimpl
def pagedprefill_backends():
    return [ReferenceBackend()]
