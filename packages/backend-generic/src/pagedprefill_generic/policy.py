"""Tiling policy of the generic backend: conservative tiles that fit 48 KiB of shared memory.

* ``block_m`` 64 rows (32 for float32), ``block_n`` 64 keys for head sizes up to 64, else 32;
* ``num_warps`` 4;
* ``num_stages`` 2 on devices that pipeline global-to-shared copies (NVIDIA sm80+), else 1;
* query heads of one KV group packed into a tile (up to ``block_m / 16`` heads, or the count that leaves
  fewer rows empty for the group: :func:`pagedprefill.tiling.pack_heads`), so each K/V tile is loaded once for
  the packed heads;
* finally :func:`pagedprefill.tiling.shrink_to_fit` with a 48 KiB budget (or less if the device has
  less), so every head size up to 256 and every dtype fits.
"""

from __future__ import annotations

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, pack_heads, shrink_to_fit

SHARED_MEM_BUDGET = 48 * 1024


def pipelining_stages(device: DeviceInfo) -> int:
    """Software-pipelining depth the device benefits from (1 where Triton cannot pipeline copies)."""
    if device.type == "cuda" and device.vendor == "nvidia" and device.capability >= (8, 0):
        return 2
    return 1


def generic_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """Pick the generic backend's tile for ``shape`` on ``device``."""
    block_m = 32 if shape.element_size >= 4 else 64
    block_n = 64 if shape.head_size_padded <= 64 else 32
    heads = pack_heads(shape, block_m, block_m // 16, device.num_sms)
    config = TileConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=pipelining_stages(device),
                        heads_per_tile=heads, split_masks=True)
    budget = min(SHARED_MEM_BUDGET, device.max_shared_mem or SHARED_MEM_BUDGET)
    return shrink_to_fit(config, shape, device, budget)
