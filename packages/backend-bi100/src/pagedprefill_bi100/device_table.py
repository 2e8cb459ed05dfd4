"""Per-device data of Iluvatar CoreX parts (``devices.json``) and the limits the policy works with.

The data lives in ``devices.json`` next to this module:

* ``architectures``: per architecture (``ivcore10``, ``ivcore11``, ``ivcore20``) its reported capability,
  shared memory per block, warp size, SM count and deepest pipelining the policy may use;
* ``parts``: model name (as it appears in the device name, e.g. ``"Iluvatar BI-V100"``) -> architecture;
* ``default``: the values for an Iluvatar part known neither by name nor by capability.

:func:`device_limits` merges what the device reports with that table: a value the runtime reports
(``max_shared_mem > 0``, ``warp_size > 0``, ``num_sms > 1``) always wins; the table fills in what is
missing. The table entry is found by model name first, then by capability, then ``default``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Optional

from pagedprefill.device import DeviceInfo

#: Hard ceiling of the pipelining depth on this hardware's Triton (configs with 3+ stages are not built).
MAX_STAGES = 2


@dataclass(frozen=True)
class TableEntry:
    """One row of ``devices.json``: an architecture's limits (``arch`` is ``"default"`` for the fallback)."""

    arch: str
    capability: Optional[tuple[int, int]]
    max_shared_mem: int
    warp_size: int
    num_sms: int
    max_stages: int
    notes: str = ""


@dataclass(frozen=True)
class DeviceLimits:
    """The limits the policy decides on, each from the device when it reports one, else from the table.

    ``matched_by`` says how the table entry was found (``"name"``, ``"capability"`` or ``"default"``);
    ``from_table`` names the fields that came from the table rather than from the device.
    """

    arch: str
    max_shared_mem: int
    warp_size: int
    num_sms: int
    max_stages: int
    matched_by: str
    from_table: tuple[str, ...]


def _entry(arch: str, raw: dict) -> TableEntry:
    cap = raw.get("capability")
    return TableEntry(
        arch=arch,
        capability=(int(cap[0]), int(cap[1])) if cap is not None else None,
        max_shared_mem=int(raw["max_shared_mem"]),
        warp_size=int(raw["warp_size"]),
        num_sms=int(raw["num_sms"]),
        max_stages=min(MAX_STAGES, int(raw["max_stages"])),
        notes=str(raw.get("notes", "")),
    )


@functools.cache
def load_device_table() -> tuple[dict[str, TableEntry], dict[str, str], TableEntry]:
    """``(architectures, parts, default)`` read from ``devices.json`` (once)."""
    raw = json.loads(resources.files(__package__).joinpath("devices.json").read_text(encoding="utf-8"))
    archs = {name: _entry(name, row) for name, row in raw["architectures"].items()}
    parts = {str(model).upper(): str(arch) for model, arch in raw["parts"].items()}
    for model, arch in parts.items():
        if arch not in archs:
            raise ValueError(f"devices.json: part {model!r} names unknown architecture {arch!r}")
    return archs, parts, _entry("default", raw["default"])


def _model_in_name(name: str, parts: dict[str, str]) -> Optional[str]:
    """The longest known model that appears as a whole word in ``name`` (``BI-V150S`` before ``BI-V150``)."""
    upper = name.upper()
    for model in sorted(parts, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9-]){re.escape(model)}(?![A-Z0-9])", upper):
            return model
    return None


def table_entry(device: DeviceInfo) -> tuple[TableEntry, str]:
    """The table row for ``device`` and how it was found: by model name, by capability, or the default."""
    archs, parts, default = load_device_table()
    model = _model_in_name(device.name, parts)
    if model is not None:
        return archs[parts[model]], "name"
    for entry in archs.values():
        if entry.capability == tuple(device.capability):
            return entry, "capability"
    return default, "default"


def device_limits(device: DeviceInfo) -> DeviceLimits:
    """What ``device`` reports, with the table's values where it reports 0 or nothing."""
    entry, matched_by = table_entry(device)
    from_table = []

    def pick(field: str, reported: int, known: bool) -> int:
        if known:
            return reported
        from_table.append(field)
        return getattr(entry, field)

    smem = pick("max_shared_mem", device.max_shared_mem, device.max_shared_mem > 0)
    warp = pick("warp_size", device.warp_size, device.warp_size > 0)
    # DeviceInfo's default of 1 SM means "not reported": no GPU of this kind has a single SM.
    sms = pick("num_sms", device.num_sms, device.num_sms > 1)
    return DeviceLimits(arch=entry.arch, max_shared_mem=smem, warp_size=warp, num_sms=sms,
                        max_stages=entry.max_stages, matched_by=matched_by, from_table=tuple(from_table))


def described_device(model: str, triton_backend: Optional[str] = "cuda", index: int = 0) -> DeviceInfo:
    """A hand-built :class:`DeviceInfo` of a known part (e.g. ``"BI-V100"``) with the table's values."""
    archs, parts, _ = load_device_table()
    arch = archs[parts[model.upper()]]
    return DeviceInfo(type="cuda", index=index, vendor="iluvatar", name=f"Iluvatar {model.upper()}",
                      capability=arch.capability or (0, 0), warp_size=arch.warp_size, num_sms=arch.num_sms,
                      max_shared_mem=arch.max_shared_mem, triton_backend=triton_backend)
