"""The Hopper kernel's schedule: which variant of its loops a call compiles to, and whether a call fits it.

Triton-free, so that the policy (which decides) and the launcher (which executes) both import it without
importing each other or Triton. A schedule is a set of named flags, each a row of :data:`.flags.FLAGS` (its
default, what it does, where it applies and the figure that decided it; docs/backends/sm80.md shows that table),
updated per route by :func:`route_flags` and resolved for one call's shape and tile by :func:`resolve`, which
applies the table's rules; the launch passes the resolved flags to the kernel as one constexpr
(:class:`Schedule`), and the shared-memory model (:func:`shared_bytes`) and the fit checks
(:func:`shape_unfit_reason`) read the same resolution.

An FP8 cache is always widened by the producer warpgroup, once per tile, into the 16-bit ring both
consumers read.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.types import KVCacheDType, KVLayout

from .flags import DEFAULTS, WIDE_KEY_CHUNK, applied, key_chunk

#: Head sizes the kernel is built for: powers of two (its register tensors need them), and in the NHD layout the
#: sizes of :data:`PADDED_HEADS`.
HEAD_SIZES = (64, 96, 128, 256)
#: Head sizes run on a tile of the next power of two: rank-3 TMA boxes read the columns past the head as zeros,
#: the queries' too, so those columns add nothing to the scores, and they are not stored.
PADDED_HEADS = {96: 128}
#: TMA coordinates are 32-bit.
MAX_ROWS = 2**31 - 1
#: FP8 cache formats the kernel reads: widened to the input dtype exactly, scales folded.
FP8_CACHES = (KVCacheDType.FP8_E4M3, KVCacheDType.FP8_E5M2)

#: Schedule flags read from the environment at each bind (``"KEY_LOADS=1,EARLY_KEYS=0"``), over the route's
#: flags and under a caller's own: for running a suite or the bench under a schedule that is not a route's
#: choice. Plans bound before it changed keep the flags they were bound with.
SCHEDULE_ENV = "PAGEDPREFILL_SM80_SCHEDULE"

#: Head sizes at which the split layout's 16-bit cache is read by key loads with value boxes first on every
#: tile ...
KEY_LOAD_HEAD_SIZES = (128, 256)
#: ... and at which it is on tiles of more than 64 keys only, where the loads take 64 keys per chunk (32 keys
#: per chunk were slower than the copies at these head sizes).
WIDE_KEY_LOAD_HEAD_SIZES = (64, 96)
#: Head sizes at which those key loads are issued before their tile's buffer is free (at head size 256, on
#: 32-key tiles, that measured 0.985 x).
EARLY_KEY_HEAD_SIZES = (64, 96, 128)

#: Registers per thread (``setmaxnreg``) of the producer partition and of the consumers beside it, by what the
#: producer holds: 128 producer threads and 256 consumer threads share the SM's 65,536.
CONSUMER_REGS = 240
WIDE_PRODUCER_REGS, WIDE_CONSUMER_REGS = 56, 224  # a quarter of the copy addresses per lane
WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS = 80, 216  # a 16-byte slice of each tile it loads or widens
WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS = 112, 200  # two 64-key chunks of key loads


class Schedule(NamedTuple):
    """A call's resolved schedule as the kernel takes it (one constexpr): the flags, the chunk of the key loads
    (0 without them), and the producer's warps and the partitions' registers."""

    HEAVY_FIRST: bool
    PINGPONG: bool
    IDLE_HALF: bool
    KEY_LOADS: int
    VALUES_FIRST: bool
    EARLY_KEYS: bool
    F32_WIDENING: bool
    FP8_BOXES: bool
    WIDEN_TO_V: bool
    FUSED_SCALE: bool
    FP8_SCORES: bool
    LAZY_RESCALE: bool
    PRODUCER_WARPS: int
    PRODUCER_REGS: int
    CONSUMER_REGS: int


def route_flags(shape: ProblemShape, block_n: int) -> dict:
    """The flags the policy sets for calls of ``shape`` on tiles of ``block_n`` keys, over :data:`DEFAULTS`.

    The split layout with a 16-bit cache reads its cached keys with a producer warpgroup's loads, value boxes
    first (``KEY_LOADS``, ``VALUES_FIRST``): at head sizes 128 and 256 on every tile (1.01-1.23 x over the
    16-byte copies), at 64 and 96 on tiles of more than 64 keys, 64 keys per chunk (``WIDE_KEY_CHUNKS``: 1.12 and
    1.18 x, where 32 keys per chunk were 0.89 and 0.98 x); up to head size 128 loaded before the tile's buffer is
    free (``EARLY_KEYS``: 1.03-1.09 x on the split rows). Not with an FP8 cache, where the copies were faster
    (0.82 x): its keys and values come by page boxes (``FP8_BOXES``: 1.16 x at head size 128, level at 64), and
    on tiles of more than 64 keys its values are widened into the V ring (``WIDEN_TO_V``: 1.03 x over 64-key
    tiles beside a V^T ring, 1.16 x at head size 64; 0.94 x on 64-key tiles).
    """
    if shape.layout is not KVLayout.SPLIT:
        return {}
    if shape.kv_cache_dtype.is_fp8:
        if shape.head_size != shape.head_size_padded:
            return {}
        return dict(FP8_BOXES=True, WIDEN_TO_V=True) if block_n > 64 else dict(FP8_BOXES=True)
    wide_chunks = block_n > WIDE_KEY_CHUNK
    if shape.head_size in KEY_LOAD_HEAD_SIZES or (wide_chunks and shape.head_size in WIDE_KEY_LOAD_HEAD_SIZES):
        flags = dict(KEY_LOADS=True, VALUES_FIRST=True)
        if wide_chunks:
            flags["WIDE_KEY_CHUNKS"] = True
        if shape.head_size in EARLY_KEY_HEAD_SIZES:
            flags["EARLY_KEYS"] = True
        return flags
    return {}


def parse(text: str) -> dict:
    """Schedule flags written as ``"PINGPONG=1,EARLY_KEYS=0"``, checked against :data:`DEFAULTS`' names."""
    flags = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in DEFAULTS or value not in ("0", "1"):
            raise ValueError(f"schedule: expected NAME=0 or NAME=1 with NAME one of {', '.join(DEFAULTS)}, "
                             f"got {item!r}")
        flags[name] = value == "1"
    return flags


def from_environment() -> dict:
    """The flags :data:`SCHEDULE_ENV` sets (none when it is unset); a malformed value is an error naming it."""
    try:
        return parse(os.environ.get(SCHEDULE_ENV, ""))
    except ValueError as exc:
        raise ValueError(f"{SCHEDULE_ENV}: {exc}") from None


def resolve(shape: ProblemShape, config: TileConfig, schedule: Optional[dict] = None) -> dict:
    """The flags calls of ``shape`` with ``config`` are compiled with: :data:`DEFAULTS` updated by
    :func:`route_flags`, then by :data:`SCHEDULE_ENV` and then by ``schedule``, less what does not apply to them
    and plus what they always take (each flag's rule in :data:`.flags.FLAGS`)."""
    asked = {**DEFAULTS, **route_flags(shape, config.block_n), **from_environment(), **(schedule or {})}
    return applied(asked, shape, config)


def partition_registers(flags: dict, split: bool, fp8: bool, num_warps: int) -> tuple[int, int]:
    """Registers per thread of the producer partition and of the consumers under resolved ``flags``
    (``setmaxnreg``): what the producer holds decides its share."""
    if flags["WIDE_KEY_CHUNKS"]:  # two 64-key chunks of key loads
        return WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS
    if fp8 or flags["KEY_LOADS"]:  # a warpgroup holding slices of tiles
        return WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS
    if flags["WIDE_PRODUCER"]:
        return WIDE_PRODUCER_REGS, WIDE_CONSUMER_REGS
    # The producer warp of the split layout holds a tile of 16-byte copy addresses.
    return 96 if split and num_warps == 8 else 24, CONSUMER_REGS


def kernel_schedule(flags: dict, shape: ProblemShape, config: TileConfig) -> Schedule:
    """The resolved ``flags`` as the kernel's constexpr, with the producer's warps and the registers."""
    split, fp8 = shape.layout is KVLayout.SPLIT, shape.kv_cache_dtype.is_fp8
    producer_regs, consumer_regs = partition_registers(flags, split, fp8, config.num_warps)
    producer_warps = 4 if ((flags["WIDE_PRODUCER"] or flags["KEY_LOADS"]) and split) or fp8 else 1
    return Schedule(HEAVY_FIRST=flags["HEAVY_FIRST"], PINGPONG=flags["PINGPONG"],
                    IDLE_HALF=flags["IDLE_HALF"], KEY_LOADS=key_chunk(flags),
                    VALUES_FIRST=flags["VALUES_FIRST"], EARLY_KEYS=flags["EARLY_KEYS"],
                    F32_WIDENING=flags["F32_WIDENING"], FP8_BOXES=flags["FP8_BOXES"], WIDEN_TO_V=flags["WIDEN_TO_V"],
                    FUSED_SCALE=flags["FUSED_SCALE"], FP8_SCORES=flags["FP8_SCORES"],
                    LAZY_RESCALE=flags["LAZY_RESCALE"], PRODUCER_WARPS=producer_warps,
                    PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs)


def shared_bytes(shape: ProblemShape, config: TileConfig, schedule: Optional[dict] = None) -> int:
    """Bytes of shared memory the kernel allocates for calls of ``shape`` with ``config``: the Q tile, the K/V
    ring, the split layout's ring of V^T pages (unless its FP8 values are widened into the V ring), an FP8
    cache's own ring (the values alone where ``FP8_SCORES`` lands NHD keys in the K ring), and 1 KiB for the
    barriers (they take about 0.3 KiB). Within that margin of what Triton allocates for every policy tile
    (``ci/codegen_report.py``). ``schedule``: flags over the route's (:func:`resolve`)."""
    flags = resolve(shape, config, schedule)
    d = PADDED_HEADS.get(shape.head_size, shape.head_size)
    tile = config.block_n * d * 2  # one K or V tile in the input's 16-bit type
    scores_bytes = 1 if flags["FP8_SCORES"] else 2  # the Q tile and the K ring, FP8 under FP8_SCORES
    total = config.block_m * d * scores_bytes + config.num_stages * (tile + config.block_n * d * scores_bytes)
    if shape.layout is KVLayout.SPLIT and not flags["WIDEN_TO_V"]:
        total += config.num_stages * tile  # the cached values' V^T ring beside the new tokens' V ring
    if shape.kv_cache_dtype.is_fp8:
        fp8_tiles = 1 if flags["FP8_SCORES"] and shape.layout is KVLayout.NHD else 2
        total += config.num_stages * fp8_tiles * config.block_n * d  # the FP8 ring
    return total + 1024


def shape_unfit_reason(shape: ProblemShape, config: TileConfig, max_shared: Optional[int] = None) -> Optional[str]:
    """Why the Hopper kernel cannot take calls of this shape with this tile, or None when it can. With
    ``max_shared`` (the device's shared memory per block, bytes) the tile must also fit in it
    (:func:`shared_bytes`)."""
    if shape.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 inputs, not {shape.dtype}"
    if shape.kv_cache_dtype not in (KVCacheDType.AUTO, *FP8_CACHES):
        return f"reads caches in the input dtype or {' or '.join(map(str, FP8_CACHES))}, not " \
               f"{shape.kv_cache_dtype.value!r}"
    if shape.kv_cache_dtype.is_fp8 and shape.head_size > 128:
        return f"reads an FP8 cache for head sizes up to 128 only (its FP8 ring takes shared memory), not head " \
               f"size {shape.head_size}"
    if shape.head_size not in HEAD_SIZES:
        return f"is built for head sizes {HEAD_SIZES}, not {shape.head_size}"
    if shape.layout is KVLayout.SPLIT and shape.head_size > 128 and config.block_n > 32:
        return f"reads the split layout at head size {shape.head_size} with up to 32 keys per step (its V^T ring " \
               f"takes shared memory), not block_n={config.block_n}"
    page, block_n = shape.block_size, config.block_n
    smallest = 16 if shape.layout is KVLayout.SPLIT else 8  # a V^T page box is at least one 32-byte swizzle atom wide
    if page < smallest or page & (page - 1) or not (block_n % page == 0 or page % block_n == 0):
        return f"needs a power-of-two block size >= {smallest} that divides or is a multiple of " \
               f"block_n={block_n}, not {page}"
    if config.block_m != 16 * config.num_warps:
        return f"needs block_m = 16 x num_warps (one MMA row band per warp), not {config.block_m} with " \
               f"{config.num_warps} warps"
    if max_shared is not None and shared_bytes(shape, config) > max_shared:
        return f"needs {shared_bytes(shape, config)} bytes of shared memory with block_n={config.block_n} and " \
               f"num_stages={config.num_stages}, the device has {max_shared} per block"
    return None
