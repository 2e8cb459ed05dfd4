"""The Hopper kernel's schedule: which variant of its loops a call compiles to, and whether a call fits it.

Triton-free, so that the policy (which decides) and the launcher (which executes) both import it without
importing each other or Triton. A schedule is a set of named flags (:data:`DEFAULTS`), updated per route by
:func:`route_flags` and resolved for one call's shape and tile by :func:`resolve`; the launch passes the
resolved flags to the kernel as one constexpr (:class:`Schedule`), and the shared-memory model
(:func:`shared_bytes`) and the fit checks (:func:`shape_unfit_reason`) read the same resolution.

The flags, each measured on the H200 against the schedule without it (docs/performance.md, "What was tried",
has the figures of these and of the variants that lost and were removed):

* ``HEAVY_FIRST``: each sequence's last query tiles (the most keys under a causal mask) go first.
* ``PINGPONG``: each of the two consumer warpgroups is a partition of its own with half of the tile's rows, so
  that one's softmax runs under the other's MMAs (tiles of 8 warps).
* ``IDLE_HALF`` (under ``PINGPONG``): the second consumer, when its half of the tile holds no query row (a
  decode or speculative row's tile, a sequence's short last tile), runs no MMA and only hands each buffer back.
  Decode rows in a padded tile of 128 rows are otherwise bound by MMAs on rows that do not exist, as long as
  a prefill tile's: 1.10-1.14 x on the decode and speculative rows, 1.12 x on a mixed step; off where the
  consumers' registers are full (256-key tiles, head size 96), where its branch spills.
* ``WIDE_PRODUCER`` (split layout): a producer warpgroup instead of one warp shares the 16-byte copies of the
  cached keys; always at head size 256, where one warp spills its copy addresses.
* ``KEY_LOADS`` (split layout, 16-bit cache): a producer warpgroup reads the cached keys with 16-byte loads and
  stores them (the L1 merges loads into one L2 request per 128-byte line; each asynchronous copy is a request
  of its own); ``VALUES_FIRST`` issues a tile's value boxes before its keys are loaded, ``WIDE_KEY_CHUNKS``
  loads 64 keys per chunk instead of 32 on tiles of more than 64 keys, ``EARLY_KEYS`` loads a tile's keys
  before its buffer is free.
* ``F32_WIDENING`` (FP8 cache, bfloat16 call): the producer widens FP8 tiles through float16 and float32
  (packed conversions) instead of one scalar float16-to-bfloat16 conversion per element on the pipe the
  softmax's exponentials take.
* ``FP8_BOXES`` (split layout, FP8 cache, a head size that is a power of two): cached keys and values by
  unswizzled TMA page boxes instead of 16-byte copies; ``WIDEN_TO_V`` widens the cached values into the V
  ring, transposed, which frees the V^T ring's room for 128-key tiles.
* ``FUSED_SCALE`` (no softcap, no ALiBi): each row's maximum on the raw scores, and each key's scale and
  subtraction of the maximum as one fused multiply-add.
* ``FP8_SCORES`` (an FP8 e4m3 query on an e4m3 cache holding every key, ``k = v = None``): ``Q K^T`` on FP8
  warpgroup MMAs (twice the 16-bit rate), the query and the cached keys in shared memory as they are, so that
  the producer widens only the values; ``P V`` stays 16-bit. Against the query widened as it is loaded: 1.26 x
  (NHD) and 1.13 x (split) on the prefix-cached row, 1.10 x at head size 64, with the same error against a
  float64 oracle (2.2-2.4e-3 relative L2 from 1k to 128k keys).
* ``LAZY_RESCALE``: a row's running max moves only when a tile's maximum exceeds it by more than
  :data:`~.consumer.RESCALE_GROWTH` (8 in log2 units), and a consumer rescales its accumulator only on tiles
  where one of its rows' max moved (a vote of its rows); on the other tiles the 64 multiplies per thread are
  skipped. On for the engine's call on a 16-bit NHD cache (every key in the cache), tiles of at most 128 keys
  and one walk per tile; docs/backends/sm80.md has its A/B.

An FP8 cache is always widened by the producer warpgroup, once per tile, into the 16-bit ring both
consumers read.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.types import KVCacheDType, KVLayout

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

#: Every flag, with its value before a route's flags and the resolution apply.
DEFAULTS = dict(HEAVY_FIRST=True, PINGPONG=True, IDLE_HALF=True, WIDE_PRODUCER=False, KEY_LOADS=False,
                VALUES_FIRST=False, WIDE_KEY_CHUNKS=False, EARLY_KEYS=False, F32_WIDENING=True, FP8_BOXES=False,
                WIDEN_TO_V=False, FUSED_SCALE=True, FP8_SCORES=True, LAZY_RESCALE=True)

#: Schedule flags read from the environment at each bind (``"KEY_LOADS=1,EARLY_KEYS=0"``), over the route's
#: flags and under a caller's own: for running a suite or the bench under a schedule that is not a route's
#: choice. Plans bound before it changed keep the flags they were bound with.
SCHEDULE_ENV = "PAGEDPREFILL_SM80_SCHEDULE"

#: Keys per chunk of the producer's key loads (``KEY_LOADS``), and under ``WIDE_KEY_CHUNKS``.
KEY_CHUNK, WIDE_KEY_CHUNK = 32, 64

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
    and plus what they always take."""
    flags = {**DEFAULTS, **route_flags(shape, config.block_n), **from_environment(), **(schedule or {})}
    split, fp8 = shape.layout is KVLayout.SPLIT, shape.kv_cache_dtype.is_fp8
    # Two consumer partitions need two warpgroups' worth of rows.
    flags["PINGPONG"] = bool(flags["PINGPONG"]) and config.num_warps == 8
    # Not where the consumers' registers are full: on 256-key tiles (head size 64, NHD) the idle branch spills a
    # register and cost the D64 row 2.7 %; at head size 96 it spills 16 bytes.
    flags["IDLE_HALF"] = (bool(flags["IDLE_HALF"]) and flags["PINGPONG"] and config.block_n <= 128
                          and shape.head_size not in PADDED_HEADS)
    # Only the split layout's copies are shared among the producer's warps (NHD is all TMA, one thread issues);
    # at head size 256 they take a warpgroup: one producer warp spills its copy addresses there.
    flags["WIDE_PRODUCER"] = (bool(flags["WIDE_PRODUCER"]) or shape.head_size > 128) and split
    # The producer warpgroup's loads take 32 keys at a time ...
    flags["KEY_LOADS"] = bool(flags["KEY_LOADS"]) and split and config.block_n >= 32
    # ... and their tiles' value boxes first, where there are boxes (an FP8 cache's values are copies) ...
    flags["VALUES_FIRST"] = bool(flags["VALUES_FIRST"]) and flags["KEY_LOADS"] and not fp8
    # ... and 64 at a time where a tile holds more than one such chunk (a 16-bit cache: the FP8 producer's
    # registers also hold the widening) ...
    flags["WIDE_KEY_CHUNKS"] = (bool(flags["WIDE_KEY_CHUNKS"]) and flags["KEY_LOADS"] and not fp8
                                and config.block_n > WIDE_KEY_CHUNK)
    # ... and loaded before their buffer is free, where the tile is one or two chunks (the registers the loads
    # hold anyway); not FP8's, which the producer widens through its own ring.
    flags["EARLY_KEYS"] = (bool(flags["EARLY_KEYS"]) and flags["KEY_LOADS"] and not fp8
                           and config.block_n <= 2 * key_chunk(flags))
    # Through float32 where the producer widens FP8 tiles to bfloat16 (to float16 it is one packed conversion).
    flags["F32_WIDENING"] = bool(flags["F32_WIDENING"]) and fp8 and shape.dtype == torch.bfloat16
    # Page boxes for the split layout's FP8 cache at head sizes that fill the tile (a padded head's columns past
    # it would need zeros written).
    flags["FP8_BOXES"] = bool(flags["FP8_BOXES"]) and split and fp8 and shape.head_size not in PADDED_HEADS
    flags["WIDEN_TO_V"] = bool(flags["WIDEN_TO_V"]) and split and fp8
    flags["FUSED_SCALE"] = bool(flags["FUSED_SCALE"])
    flags["FP8_SCORES"] = bool(flags["FP8_SCORES"]) and fp8_scores_fit(shape)
    flags["HEAVY_FIRST"] = bool(flags["HEAVY_FIRST"])
    # Where it won (the engine's call: every key in an NHD 16-bit cache, one walk per tile of at most 128 keys:
    # 1.01-1.04 x on its prefill rows); with the split layout's copy addresses beside them the consumers spill on
    # its vote (alibi 56 bytes, a window 24, softcap 20). Elsewhere it measured level or slower: an FP8 cache
    # 0.86-1.01 x, the new tokens' K/V passed apart 0.98-1.03 x, 256-key tiles 0.97-0.99 x, split keys 0.95 x.
    flags["LAZY_RESCALE"] = (bool(flags["LAZY_RESCALE"]) and not split and not fp8 and shape.kv_in_cache
                             and config.block_n <= 128 and config.key_splits == 1)
    return flags


def fp8_scores_fit(shape: ProblemShape) -> bool:
    """Whether calls of ``shape`` can take ``FP8_SCORES``: an FP8 query (e4m3) and an e4m3 cache holding every key
    (``k = v = None``: a new token's 16-bit key would need a 16-bit query), at a head size that fills the tile (a
    padded head's boxes are 16-bit only)."""
    return (shape.fp8_query and shape.kv_in_cache and shape.kv_cache_dtype is KVCacheDType.FP8_E4M3
            and shape.head_size not in PADDED_HEADS)


def key_chunk(flags: dict) -> int:
    """Keys per chunk of the producer's key loads under resolved ``flags``: 0 without ``KEY_LOADS``."""
    if not flags["KEY_LOADS"]:
        return 0
    return WIDE_KEY_CHUNK if flags["WIDE_KEY_CHUNKS"] else KEY_CHUNK


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
