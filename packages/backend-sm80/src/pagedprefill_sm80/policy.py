"""Tiling policy of the sm80 backend: measured tables first, rules for what the tables lack.

Lookup order for a problem key (see :func:`pagedprefill.tuning.table_key`):

1. the user's table written by ``pagedprefill tune`` on this GPU (:func:`pagedprefill.tuning.user_table_path`);
2. the table shipped in this package (``tuned/<capability>.json``), measured by the maintainers;
3. rules: large tiles with 8 warps for head sizes up to 128 on 16-bit data, GQA packing for short queries,
   pipelining depth from the device's shared memory.

Every result goes through :func:`pagedprefill.tiling.shrink_to_fit` against the device's shared memory,
so sm80 (163 KiB), sm86/sm89 (99 KiB) and sm90 (227 KiB) parts all get tiles they can hold.
"""

from __future__ import annotations

from importlib import resources

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, shrink_to_fit
from pagedprefill.tuning import load_table, lookup, table_key, user_table_path


def shipped_table(device: DeviceInfo) -> dict[str, TileConfig]:
    name = f"sm{device.capability[0]}{device.capability[1]}.json"
    path = resources.files("pagedprefill_sm80") / "tuned" / name
    return load_table(path) if path.is_file() else {}


def rule_config(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """The rule used when no table has the key."""
    d = shape.head_size_padded
    wide = shape.element_size <= 2
    block_m = 128 if wide and d <= 128 else 64
    block_n = 64 if d <= 128 else 32
    warps = 8 if block_m == 128 else 4
    stages = 3 if device.max_shared_mem >= 160 * 1024 else 2
    heads = min(shape.group_size, block_m // 16) if shape.workload == "short" else 1
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      heads_per_tile=max(1, heads))


def sm80_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    key = table_key(shape, device)
    config = lookup(key, load_table(user_table_path("sm80", device)), shipped_table(device))
    if config is None:
        config = rule_config(shape, device)
    return shrink_to_fit(config, shape, device)


def search_space(shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
    """Candidates for ``pagedprefill tune``: tile sizes, warps, stages and GQA packing that fit the device."""
    out = []
    group = shape.group_size
    for block_m, warps in ((64, 4), (128, 4), (128, 8)):
        for block_n in (32, 64, 128):
            for stages in (2, 3):
                for heads in sorted({1, min(group, block_m // 16)}):
                    cfg = TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                     heads_per_tile=heads)
                    if cfg.fits(shape.head_size, shape.element_size, device):
                        out.append(cfg)
    return out
