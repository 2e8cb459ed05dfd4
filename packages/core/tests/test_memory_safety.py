"""The corrupt-metadata check itself (:mod:`pagedprefill.testing.memory_safety`): the reference raises the full
checks' error for every variant, and the check catches a backend that writes outside ``out``, writes an input,
or reads a guard. The kernels run it in every backend's conformance suite."""

from __future__ import annotations

import pytest
import torch
from pagedprefill import DeviceInfo, get_registry
from pagedprefill.registry import Backend
from pagedprefill.testing.memory_safety import SPECS, check_corrupt_metadata

CPU = DeviceInfo.detect("cpu")


@pytest.mark.parametrize("batch", sorted(SPECS))
def test_the_reference_rejects_every_variant_with_a_named_error(batch):
    checked = check_corrupt_metadata(get_registry().get("reference"), CPU, torch.device("cpu"), SPECS[batch])
    assert {"pages_far_past_cache", "pages_negative", "starts_decreasing", "context_past_table"} <= set(checked)


class _Faulty(Backend):
    """Runs nothing real: ``damage(problem)`` stands for a kernel that goes wrong on corrupt metadata."""

    name = "faulty"
    supported_features = frozenset({"kv_in_cache", "non_causal", "skip_decode", "fp8_out_scale"})

    def __init__(self, damage):
        self.damage = damage

    def supports(self, device):
        return []

    def run(self, problem, device):
        problem.out.fill_(1.0)
        self.damage(problem)


def _past_out(p):
    """One element after ``out``'s last one (inside its guard region)."""
    out = p.out
    torch.as_strided(out, (1,), (1,), out.storage_offset() + out.numel()).fill_(3.0)


def _into_cache(p):
    p.cache.key.view(-1)[7] = 5.0


def _guard_read(p):
    p.out[0, 0, 0] = float("nan")


@pytest.mark.parametrize("damage, message", [(_past_out, "written outside out"),
                                             (_into_cache, r"k_cache \(or its guard\) was written"),
                                             (_guard_read, "a guard outside an input was read")],
                         ids=["writes_past_out", "writes_the_cache", "reads_a_guard"])
def test_the_check_catches_each_kind_of_violation(damage, message):
    with pytest.raises(AssertionError, match=message):
        check_corrupt_metadata(_Faulty(damage), CPU, torch.device("cpu"), SPECS["nhd_bs4"])
