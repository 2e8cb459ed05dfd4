"""Tiling policy of the ``example`` backend: 32-row tiles of 16-wide sub-groups, fitted to shared memory."""

from __future__ import annotations

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, shrink_to_fit


def example_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """Pick the tile for ``shape`` on ``device``."""
    heads = max(1, min(shape.group_size, 2))
    config = TileConfig(block_m=32, block_n=32, num_warps=2, num_stages=1, heads_per_tile=heads, split_masks=True)
    return shrink_to_fit(config, shape, device, device.max_shared_mem)
