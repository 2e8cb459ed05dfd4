"""Tiling policy of the ``bi100`` backend (Iluvatar CoreX: BI-V100, BI-V150, BI-V150S, MR-V50).

``bi100_policy(shape, device) -> TileConfig`` decides from the device's own limits, completed by the
table in ``devices.json`` where the runtime reports 0 or nothing (see :mod:`.device_table`; the
per-architecture values, shared memory, warp size, SMs and pipelining depth, are kept there only).

Steps:

1. Starting tile, as other Triton attention kernels on this hardware use: ``block_m`` 64 rows and
   ``block_n`` 64 keys for padded head sizes up to 64, else 32; float32 halves both (32 rows, 32/16 keys).
2. GQA packing: ``heads_per_tile`` = the largest power of two <= min(group size, ``block_m / 16``), so the
   query heads of one KV group share every K/V tile load and the packed heads always divide the tile.
3. Rows that would stay empty are not allocated: when the call's query-length bound times the packed heads
   is below ``block_m``, ``block_m`` drops to that many rows (power of two, at least 16); when the grid would
   have fewer programs than the device has SMs, ``block_m`` is halved (not below 32) to spread the work.
4. Pipelining: the architecture's ``max_stages`` from the table, never above 2. If the tile does not fit
   with 2 stages, the second stage is dropped before any tile is shrunk (a full-size tile matters more than
   pipelining).
5. :func:`pagedprefill.tiling.shrink_to_fit` with the device's shared memory per block as the budget, so
   every tile for head sizes 1..256 in fp16/bf16/fp32 fits the model of
   :meth:`~pagedprefill.tiling.TileConfig.shared_mem_bytes`.
6. Warps from the final tile: 4 threads per row, i.e. ``num_warps = 4 * block_m / warp_size`` rounded
   down to a power of two (between 1 and 8). With 64-wide warps: 64 rows -> 4 warps (256 threads),
   32 rows -> 2, 16 rows -> 1.

Masked and mask-free key tiles are always run separately (``split_masks``).

One combination cannot fit 48 KiB under that model whatever the tile: float32 with a head size above 128
(padded to 256), whose smallest legal tile (16 x 16) needs 49 KiB. The backend refuses such calls on such
devices (BI-V100) rather than hand Triton a tile that overflows: ``TritonBackend.check_problem`` compares the
policy's tile with the device's shared memory. They run on ivcore11 (128 KiB), and in fp16/bf16 everywhere.
"""

from __future__ import annotations

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, launch_grid, next_power_of_2, settle, shrink_to_fit

from .device_table import MAX_STAGES, DeviceLimits, device_limits

#: Threads per tile row when choosing warps (64 rows x 4 = 256 threads = 4 warps of 64).
THREADS_PER_ROW = 4
MAX_WARPS = 8
#: ``block_m`` is not halved below this many rows to fill SMs.
MIN_ROWS_FOR_OCCUPANCY = 32


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def starting_tile(shape: ProblemShape) -> tuple[int, int]:
    """``(block_m, block_n)`` before any fitting: 64 x (64 or 32), halved for float32."""
    block_m = 64
    block_n = 64 if shape.head_size_padded <= 64 else 32
    if shape.element_size >= 4:
        block_m, block_n = block_m // 2, block_n // 2
    return block_m, max(16, block_n)


def packed_heads(shape: ProblemShape, block_m: int) -> int:
    """Query heads of one KV group per tile: a power of two, at most the group and ``block_m / 16``."""
    return _pow2_floor(min(shape.group_size, max(1, block_m // 16)))


def _num_programs(shape: ProblemShape, block_m: int, heads: int) -> int:
    config = settle(TileConfig(block_m=block_m, heads_per_tile=min(heads, block_m)), shape)
    tiles, heads_dim, _ = launch_grid(shape, config)
    return tiles * heads_dim


def rows_for(shape: ProblemShape, block_m: int, heads: int, limits: DeviceLimits) -> int:
    """``block_m`` after dropping rows the call cannot fill and halving for SM occupancy."""
    bound = shape.query_len_bound
    if bound > 0:
        block_m = min(block_m, max(16, next_power_of_2(bound * heads)))
    if shape.num_tokens > 0:
        while block_m > MIN_ROWS_FOR_OCCUPANCY and block_m // 2 >= heads \
                and _num_programs(shape, block_m, heads) < limits.num_sms:
            block_m //= 2
    return block_m


def warps_for(block_m: int, warp_size: int) -> int:
    """``THREADS_PER_ROW`` threads per row, as a power of two number of warps in ``[1, MAX_WARPS]``."""
    return max(1, min(MAX_WARPS, _pow2_floor(THREADS_PER_ROW * block_m // max(1, warp_size))))


def bi100_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """Pick the ``bi100`` backend's tile for ``shape`` on ``device`` (see the module docstring)."""
    limits = device_limits(device)
    block_m, block_n = starting_tile(shape)
    heads = packed_heads(shape, block_m)
    block_m = rows_for(shape, block_m, heads, limits)
    heads = min(heads, block_m)
    stages = max(1, min(MAX_STAGES, limits.max_stages))
    config = TileConfig(block_m=block_m, block_n=block_n, num_warps=warps_for(block_m, limits.warp_size),
                        num_stages=stages, heads_per_tile=heads, split_masks=True)
    budget = limits.max_shared_mem
    elem = shape.element_size
    if config.num_stages > 1 and config.shared_mem_bytes(shape.head_size, elem) > budget:
        config = config.with_(num_stages=1)
    config = shrink_to_fit(config, shape, device, budget)
    return config.with_(num_warps=warps_for(config.block_m, limits.warp_size))
