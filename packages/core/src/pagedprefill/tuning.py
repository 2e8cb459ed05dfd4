"""Tuned tile tables: measured TileConfigs kept as data, looked up by problem key.

A table is a JSON file ``{"device": ..., "entries": {key: TileConfig fields}}``. A backend ships one in its
package (measured by its maintainers) and ``pagedprefill tune`` writes one for the present GPU into the
user's cache directory; the user's table takes precedence.

Keys (:func:`table_key`) are ``"<capability>|d<padded head size>|<dtype>|<kv dtype>|<workload>|<layout>"``:

* capability as ``major.minor`` (``9.0`` for H100/H200, ``8.0`` for A100, ``8.9`` for L40);
* the head size padded to a power of two (``d64``, ``d128``, ``d256``; head size 96 uses ``d128``);
* the query dtype ``bf16``, ``fp16`` or ``fp32``; the cache ``auto`` or ``fp8`` (both FP8 formats);
* ``short`` when the batch's sequences bring at most 256 new tokens on average, else ``long``;
* the cache layout ``nhd`` or ``split``.

For example ``"9.0|d128|bf16|auto|long|nhd"``. A lookup falls back from ``fp8`` to ``auto`` and from a key
with a layout to the same key without one (tables written before layouts were keyed). A table for another
GPU (an A100 table is ``sm80.json`` with ``8.0|...`` keys) is made by ``pagedprefill tune`` on that GPU.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Optional

from .device import DeviceInfo
from .environment import variable
from .tiling import ProblemShape, TileConfig

ENV_TABLE_DIR = "PAGEDPREFILL_TUNE_DIR"
_table_dir_env = variable(ENV_TABLE_DIR)  # read by every call's plan signature

_DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def table_key(shape: ProblemShape, device: DeviceInfo) -> str:
    dtype = _DTYPE_NAMES.get(str(shape.dtype), str(shape.dtype))
    kv = "fp8" if shape.kv_cache_dtype.is_fp8 else "auto"
    cap = f"{device.capability[0]}.{device.capability[1]}"
    return f"{cap}|d{shape.head_size_padded}|{dtype}|{kv}|{shape.workload}|{shape.layout}"


def user_table_path(backend: str, device: DeviceInfo) -> Path:
    """Where ``pagedprefill tune`` writes (and policies read) the table for ``backend`` on ``device``."""
    base = Path(os.environ.get(ENV_TABLE_DIR) or Path.home() / ".cache" / "pagedprefill")
    safe = "".join(ch if ch.isalnum() else "-" for ch in device.name).strip("-").lower()
    return base / f"{backend}-{safe}.json"


@cache
def _load(path: str) -> dict[str, TileConfig]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    return {key: TileConfig(**fields) for key, fields in data.get("entries", {}).items()}


def load_table(path: Path) -> dict[str, TileConfig]:
    """Entries of the table at ``path`` ({} if it does not exist).

    Read once per process and path (policies call this on every launch, so no file access on the hot path);
    :func:`save_table` and :func:`forget_tables` make the next call read the file again.
    """
    return _load(str(path))


#: Counts :func:`forget_tables` calls, so that what was decided from the tables read so far can be told apart.
_generation = 0


def forget_tables() -> None:
    """Drop the tables read so far (after a table file was written by another process)."""
    global _generation
    _load.cache_clear()
    _generation += 1


def tables_state() -> tuple:
    """Changes whenever a policy reading tables could decide differently: a table was written or forgotten,
    or ``PAGEDPREFILL_TUNE_DIR`` names another directory. Part of the key under which tiles are remembered."""
    return _generation, _table_dir_env()


def lookup(key: str, *tables: dict[str, TileConfig]) -> Optional[TileConfig]:
    """The first table's entry for ``key``; then the same key with an FP8 cache read as ``auto``; then each
    of those without its layout."""
    candidates = [key]
    if "|fp8|" in key:
        candidates.append(key.replace("|fp8|", "|auto|"))
    if key.count("|") == 5:
        candidates += [c.rsplit("|", 1)[0] for c in candidates]
    for candidate in candidates:
        for table in tables:
            if candidate in table:
                return table[candidate]
    return None


def save_table(path: Path, device: DeviceInfo, entries: dict[str, TileConfig], extra: Optional[dict] = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"device": device.name, "capability": list(device.capability), **(extra or {}),
            "entries": {k: v.to_dict() for k, v in sorted(entries.items())}}
    path.write_text(json.dumps(data, indent=1) + "\n")
    forget_tables()
