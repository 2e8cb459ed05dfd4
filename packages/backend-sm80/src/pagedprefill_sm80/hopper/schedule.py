"""The Hopper kernel's schedule: which variant of its loops a call compiles to, and whether a call fits it.

Triton-free, so that the policy (which decides) and the launcher (which executes) both import it without
importing each other or Triton. A schedule is a set of named flags, each a row of :data:`.flags.FLAGS` (its
default, what it does, where it applies and the figure that decided it; docs/backends/sm80.md shows that table).
The policy sets some per route (:data:`SPLIT_ROUTES`, read by :func:`route_flags`), and :func:`resolve` applies
the table's rules for one call's shape and tile; the launch passes the resolved flags to the kernel as one
constexpr (:class:`Schedule`, with the producer's warps and the partitions' registers from :data:`PARTITIONS`),
and the shared-memory model (:func:`shared_bytes`) and the fit checks (:func:`shape_unfit_reason`) read the same
resolution.

An FP8 cache is always widened by the producer warpgroup, once per tile, into the 16-bit ring both
consumers read.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.types import KVCacheDType, KVLayout

from .flags import DEFAULTS, FLAGS, WIDE_KEY_CHUNK, applied, key_chunk

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


class SplitRoute(NamedTuple):
    """The flags the policy sets on the split layout's calls of one cache kind (``"16-bit"`` or ``"fp8"``) and
    head sizes, on tiles of more than :data:`WIDE_TILE` keys (``wide``) or of at most that many, and why."""

    cache: str
    head_sizes: tuple[int, ...]
    wide: bool
    flags: tuple[str, ...]
    why: str


#: Keys per tile above which a split route is ``wide``: two 64-key chunks of key loads, or 128 FP8 keys whose
#: values fit the V ring.
WIDE_TILE = WIDE_KEY_CHUNK

#: The flags the policy sets, by route; the NHD layout takes none, and a split route not listed none either: the
#: 16-bit cache at head sizes 64 and 96 on tiles of up to 64 keys keeps the copies (32-key chunks of key loads
#: were 0.89 and 0.98 x), and so does an FP8 cache at head size 96 (its padded head's columns would need zeros
#: written). Key loads are a 16-bit cache's only: with an FP8 cache the copies were faster (0.82 x).
SPLIT_ROUTES: tuple[SplitRoute, ...] = (
    SplitRoute("16-bit", (128,), False, ("KEY_LOADS", "VALUES_FIRST", "EARLY_KEYS"),
               "key loads with value boxes first 1.01-1.23 x the copies; loaded early 1.03-1.09 x"),
    SplitRoute("16-bit", (256,), False, ("KEY_LOADS", "VALUES_FIRST"),
               "key loads with value boxes first 1.01-1.23 x the copies; loaded early 0.985 x on its 32-key tiles"),
    SplitRoute("16-bit", (64, 96, 128), True, ("KEY_LOADS", "VALUES_FIRST", "WIDE_KEY_CHUNKS", "EARLY_KEYS"),
               "64-key chunks 1.09-1.18 x on 128-key tiles, 1.12 and 1.18 x the copies at head sizes 64 and 96; "
               "loaded early 1.03-1.09 x"),
    SplitRoute("fp8", (64, 128), False, ("FP8_BOXES",), "page boxes 1.16 x the copies at head size 128, level at 64"),
    SplitRoute("fp8", (64, 128), True, ("FP8_BOXES", "WIDEN_TO_V"),
               "values widened into the V ring 1.03 x over 64-key tiles beside a V^T ring, 1.16 x at head size 64 "
               "(0.94 x on 64-key tiles)"),
)
_ROUTE_FLAGS = {(route.cache, head_size, route.wide): route.flags for route in SPLIT_ROUTES
                for head_size in route.head_sizes}


class Partition(NamedTuple):
    """The producer partition's warps and registers per thread, and the consumers' registers per thread beside it
    (``setmaxnreg``): the producer's threads and two consumer warpgroups' share the SM's 65,536."""

    producer_warps: int
    producer_regs: int
    consumer_regs: int


#: The register split by what the producer holds (:func:`producer_holds`).
PARTITIONS = {
    "key chunks": Partition(4, 112, 200),  # two 64-key chunks of key loads (WIDE_KEY_CHUNKS)
    "tile slices": Partition(4, 80, 216),  # a 16-byte slice of each tile it loads (KEY_LOADS) or widens (FP8)
    "shared copies": Partition(4, 56, 224),  # a quarter of the split layout's copy addresses per lane
    "copy addresses": Partition(1, 96, 240),  # one warp holding a tile of the split layout's 16-byte copy addresses
    "boxes": Partition(1, 24, 240),  # one warp issuing TMA boxes
}
CONSUMER_REGS = PARTITIONS["boxes"].consumer_regs
WIDE_PRODUCER_REGS, WIDE_CONSUMER_REGS = PARTITIONS["shared copies"][1:]
WIDENING_PRODUCER_REGS, WIDENING_CONSUMER_REGS = PARTITIONS["tile slices"][1:]
WIDE_CHUNK_PRODUCER_REGS, WIDE_CHUNK_CONSUMER_REGS = PARTITIONS["key chunks"][1:]


def producer_holds(flags: dict, shape: ProblemShape, config: TileConfig) -> str:
    """What the producer holds under resolved ``flags``, as :data:`PARTITIONS` names it: that decides its share of
    the registers."""
    if flags["WIDE_KEY_CHUNKS"]:
        return "key chunks"
    if shape.kv_cache_dtype.is_fp8 or flags["KEY_LOADS"]:
        return "tile slices"
    if flags["WIDE_PRODUCER"]:
        return "shared copies"
    return "copy addresses" if shape.layout is KVLayout.SPLIT and config.num_warps == 8 else "boxes"


class Schedule(NamedTuple):
    """A call's resolved schedule as the kernel takes it (one constexpr): the flags, the chunk of the key loads
    (0 without them), and the producer's warps and the partitions' registers."""

    HEAVY_FIRST: bool
    PINGPONG: bool
    HEAD_PANELS: bool
    WIDE_BOXES: bool
    IDLE_HALF: bool
    SOFTMAX_UNDER_PV: bool
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
    """The flags the policy sets for calls of ``shape`` on tiles of ``block_n`` keys, over :data:`DEFAULTS`: the
    :data:`SPLIT_ROUTES` row of the call's route, in the table's order."""
    if shape.layout is not KVLayout.SPLIT:
        return {}
    cache = "fp8" if shape.kv_cache_dtype.is_fp8 else "16-bit"
    names = _ROUTE_FLAGS.get((cache, shape.head_size, block_n > WIDE_TILE), ())
    return {flag.name: True for flag in FLAGS if flag.name in names}


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


def kernel_schedule(flags: dict, shape: ProblemShape, config: TileConfig) -> Schedule:
    """The resolved ``flags`` as the kernel's constexpr, with the producer's warps and the registers
    (:data:`PARTITIONS`)."""
    partition = PARTITIONS[producer_holds(flags, shape, config)]
    return Schedule(HEAVY_FIRST=flags["HEAVY_FIRST"], PINGPONG=flags["PINGPONG"],
                    HEAD_PANELS=flags["HEAD_PANELS"], WIDE_BOXES=flags["WIDE_BOXES"],
                    IDLE_HALF=flags["IDLE_HALF"], SOFTMAX_UNDER_PV=flags["SOFTMAX_UNDER_PV"],
                    KEY_LOADS=key_chunk(flags),
                    VALUES_FIRST=flags["VALUES_FIRST"], EARLY_KEYS=flags["EARLY_KEYS"],
                    F32_WIDENING=flags["F32_WIDENING"], FP8_BOXES=flags["FP8_BOXES"], WIDEN_TO_V=flags["WIDEN_TO_V"],
                    FUSED_SCALE=flags["FUSED_SCALE"], FP8_SCORES=flags["FP8_SCORES"],
                    LAZY_RESCALE=flags["LAZY_RESCALE"], PRODUCER_WARPS=partition.producer_warps,
                    PRODUCER_REGS=partition.producer_regs, CONSUMER_REGS=partition.consumer_regs)


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
