"""The Hopper kernel's schedule flags as one table: a row per flag (:class:`Flag`) with its default, what it does,
where it applies (its rule, as data: :class:`Where`), where it is on and the figure that decided it.

:data:`DEFAULTS`, the names :func:`.schedule.parse` accepts, the resolution of a call's flags (:func:`applied`, in
the table's order, so that a rule reads the flags resolved before it) and the table docs/backends/sm80.md shows
(:func:`flag_table`) all come from :data:`FLAGS`. Figures are the H200's, against the schedule without the flag on
the same data (docs/performance.md has them with the runs that measured them, and the variants that lost).

Triton-free: the policy and the launcher both read it through :mod:`.schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.types import KVCacheDType, KVLayout

#: Keys per chunk of the producer's key loads (``KEY_LOADS``), and under ``WIDE_KEY_CHUNKS``.
KEY_CHUNK, WIDE_KEY_CHUNK = 32, 64


def key_chunk(flags: dict) -> int:
    """Keys per chunk of the producer's key loads under resolved ``flags``: 0 without ``KEY_LOADS``."""
    if not flags["KEY_LOADS"]:
        return 0
    return WIDE_KEY_CHUNK if flags["WIDE_KEY_CHUNKS"] else KEY_CHUNK


#: What :attr:`Where.cache` names: a cache in the input's 16-bit type, any FP8 cache, or e4m3 only.
CACHES = {"16-bit": lambda cache: not cache.is_fp8, "fp8": lambda cache: cache.is_fp8,
          "e4m3": lambda cache: cache is KVCacheDType.FP8_E4M3}


class Where(NamedTuple):
    """Where a flag can be on: every field that is set must hold for the call and its tile (tiles hold a power of
    two of keys, so that the bounds below say what the prose around them does)."""

    layout: Optional[KVLayout] = None
    cache: Optional[str] = None  # one of CACHES
    dtype: Optional[torch.dtype] = None  # the type the call computes in
    warps: Optional[int] = None  # the tile's warps
    min_keys: Optional[int] = None  # keys per tile, at least
    max_keys: Optional[int] = None  # keys per tile, at most
    max_key_chunks: Optional[int] = None  # the key loads' chunks per tile (key_chunk), at most
    heads_over: Optional[int] = None  # head sizes above it
    min_block: Optional[int] = None  # cache pages of at least this many tokens
    full_head: bool = False  # a head size that fills its power-of-two tile (not head size 96)
    padded_head: bool = False  # a head size narrower than its power-of-two tile (96)
    padded_requires: tuple[str, ...] = ()  # at a padded head, flags that must have resolved on
    fp8_query: bool = False
    kv_in_cache: bool = False  # every key a cache page's (k = v = None)
    one_walk: bool = False  # each tile's keys walked by one program (no key splits)
    requires: tuple[str, ...] = ()  # flags that must have resolved on (earlier rows of FLAGS)
    unless: tuple[str, ...] = ()  # flags that must have resolved off (earlier rows of FLAGS)

    def holds(self, shape: ProblemShape, config: TileConfig, flags: dict) -> bool:
        """Whether calls of ``shape`` on ``config`` are here, with ``flags`` the flags resolved so far."""
        block_n = config.block_n
        return ((self.layout is None or shape.layout is self.layout)
                and (self.cache is None or CACHES[self.cache](shape.kv_cache_dtype))
                and (self.dtype is None or shape.dtype == self.dtype)
                and (self.warps is None or config.num_warps == self.warps)
                and (self.min_keys is None or block_n >= self.min_keys)
                and (self.max_keys is None or block_n <= self.max_keys)
                and (self.max_key_chunks is None or block_n <= self.max_key_chunks * key_chunk(flags))
                and (self.heads_over is None or shape.head_size > self.heads_over)
                and (self.min_block is None or shape.block_size >= self.min_block)
                and (not self.full_head or shape.head_size == shape.head_size_padded)
                and (not self.padded_head or shape.head_size < shape.head_size_padded)
                and (shape.head_size == shape.head_size_padded or all(flags[name] for name in self.padded_requires))
                and (not self.fp8_query or shape.fp8_query)
                and (not self.kv_in_cache or shape.kv_in_cache)
                and (not self.one_walk or config.key_splits == 1)
                and all(flags[name] for name in self.requires)
                and not any(flags[name] for name in self.unless))

    def describe(self) -> str:
        """The rule in words, for the docs' table."""
        cache = {"16-bit": "a 16-bit cache", "fp8": "an FP8 cache", "e4m3": "an e4m3 cache"}
        layout = {KVLayout.NHD: "the NHD layout", KVLayout.SPLIT: "the split layout"}
        parts = [layout[self.layout] if self.layout else "", cache[self.cache] if self.cache else "",
                 f"{str(self.dtype).split('.')[-1]} calls" if self.dtype else "",
                 f"tiles of {self.warps} warps" if self.warps else "",
                 f"tiles of {self.min_keys} keys" if self.min_keys and self.min_keys == self.max_keys else "",
                 f"tiles of at least {self.min_keys} keys" if self.min_keys and self.min_keys != self.max_keys else "",
                 f"tiles of at most {self.max_keys} keys" if self.max_keys and self.min_keys != self.max_keys else "",
                 f"tiles of at most {self.max_key_chunks} chunks of key loads" if self.max_key_chunks else "",
                 f"head sizes above {self.heads_over}" if self.heads_over else "",
                 f"pages of at least {self.min_block} tokens" if self.min_block else "",
                 "head sizes that fill the tile" if self.full_head else "",
                 "head sizes narrower than the tile" if self.padded_head else "",
                 *(f"at a padded head with `{name}`" for name in self.padded_requires),
                 "an FP8 query" if self.fp8_query else "", "every key in the cache" if self.kv_in_cache else "",
                 "one program per tile's keys (no key splits)" if self.one_walk else "",
                 *(f"with `{name}`" for name in self.requires),
                 *(f"without `{name}`" for name in self.unless)]
        return ", ".join(part for part in parts if part) or "every call"


@dataclass(frozen=True)
class Flag:
    """One schedule flag: its value before a route's flags and a caller's apply, what it does, where it is on (and
    why not elsewhere), the figure that decided it, where it can apply (``applies``) and where it is on whatever
    is asked (``forced``)."""

    name: str
    default: bool
    what: str
    where: str
    measured: str
    applies: Where = Where()
    forced: Optional[Where] = None


SPLIT, NHD = KVLayout.SPLIT, KVLayout.NHD

#: Every flag, in the order they resolve.
FLAGS: tuple[Flag, ...] = (
    Flag("HEAVY_FIRST", True,
         "each sequence's last query tiles, which see the most keys under a causal mask, start first",
         "every call",
         "at least as fast as index order on every row, up to 4%"),
    Flag("PINGPONG", True,
         "each consumer warpgroup a partition of its own with half of the tile's rows, so that one's softmax runs "
         "while the other's MMAs do",
         "every policy tile (all have 128 rows over 8 warps); two consumer partitions need two warpgroups' rows",
         "1.00-1.21 x the lockstep loop of one 8-warp partition",
         Where(warps=8)),
    Flag("HEAD_PANELS", True,
         "a padded head (96 columns of a 128-wide tile) computed as two panels of 64 and 32 columns: `Q K^T` as "
         "two chained MMAs over them, `P V` into an accumulator per panel, each panel stored apart, so that the "
         "32 zero columns cost no MMA (a quarter of the work otherwise) and the accumulator holds 96 columns, not "
         "128",
         "head size 96, every route (NHD and split, 16-bit and FP8 caches, split keys)",
         "H100, the models suite's Phi-3-mini rows, flag on against off in alternating processes: prefix-cached "
         "1.05 / 1.07 x (engine / classic call: 435.8 vs 416.3 TFLOP/s), chunked 1.09 x (458.0 vs 419.6), the "
         "default suite's D96 row 1.06 x NHD (444.9 vs 420.6), 1.07 x split; decode level (1.00-1.02 x)",
         Where(padded_head=True)),
    Flag("WIDE_BOXES", False,
         "with `HEAD_PANELS`: a padded head's NHD pages (and new tokens) as 2-D TMA boxes of the tile's 128 columns "
         "from the head's first, which bring the next head's first 32 columns into the columns no panel reads, "
         "instead of boxes of a rank-3 view `[rows, heads, 96]` that fill them with zeros: the loads of head size "
         "128's plain boxes (the last head's box ends past the row and reads zeros there)",
         "nowhere until sm80's suites pass with it on a GPU (`UNVERIFIED_FLAGS`): head size 96's MHA decode "
         "streams at about half of head size 128's GB/s on the same grid, and the rank-3 boxes are what its loads "
         "do differently. Its first run through sm80's suite (forced) had 4 failures in the model-heads sweep, not "
         "yet read (at least two of them in parts without a padded head)",
         "H100, 2026-12-08, engine form against the policy in alternating rounds: Phi-3-mini decode 128 x 2k 1.15 x "
         "(1831 vs 1586 GB/s) at TP 1, 1.10 x at TP 8; prefix-cached and chunked 1.01 x",
         Where(layout=NHD, padded_head=True, requires=("HEAD_PANELS",))),
    Flag("IDLE_HALF", True,
         "with `PINGPONG`: the second consumer, when its half of the tile holds no query row (a decode or "
         "speculative row's tile: 4 rows of 128 at a group of 4 heads; a sequence's short last tile), runs no MMA "
         "and hands each buffer back as it lands, so that such a tile costs the tensor cores one warpgroup's MMAs "
         "instead of two",
         "tiles of up to 128 keys at head sizes 64, 128 and 256, and at 96 with `HEAD_PANELS`; not where the "
         "consumers' registers are full: on head size 64's 256-key tiles its branch spilled a register and cost the "
         "D64 row 2.7%, and at head size 96 with its accumulator 128 columns wide it spills 16 bytes",
         "engine form: mixed step 1.12 x (285.7 vs 255.4 TFLOP/s), decode 256 x 4k 1.14 x (4103 vs 3609 GB/s), "
         "speculative 128 x 4 1.10 x, decode 4 x 128k 1.12 x, 16 x 32k 1.11 x, speculative 2 x 8 on 64k 1.07 x; "
         "split form 1.06-1.11 x on those rows; prefill rows level (0.99-1.02 x)",
         Where(max_keys=128, padded_requires=("HEAD_PANELS",), requires=("PINGPONG",))),
    Flag("SOFTMAX_UNDER_PV", True,
         "each consumer issues tile j's `Q K^T` and tile j-1's `P V` together and runs tile j's softmax while `P V` "
         "is in flight, rescaling the accumulator once it lands; the ring's K and V buffers have barriers of their "
         "own, so that a tile's keys are handed back when its scores are in and its values when its `P V` is "
         "done, and the producer refills each as soon as it is free",
         "the NHD layout's 16-bit cache at head sizes 128 and 256, where the consumers waited for their own MMAs a "
         "third of their time (at 256 `ptxas` keeps the shared memory's base address in 40 bytes of local "
         "memory, read at each partition's start and in the barrier waits' retry paths). Not at head size 96, "
         "where its form over the panels (two `P V`s in flight) measured 0.93 x on Phi-3-mini's prefix-cached "
         "row and 0.91 x chunked, nor at 64 (level: 0.99-1.00 x; its 256-key tiles' two score tiles spill 624 "
         "bytes), nor with pages of 8 tokens, whose producer spills 76 bytes issuing a tile's boxes twice (keys, "
         "then values). It rescales on every tile: `LAZY_RESCALE`'s vote beside the scores and P of two tiles "
         "spilled 4 bytes",
         "H100, 2026-12-07, against the flag off in alternating rounds of one process (engine / classic NHD "
         "call): prefix-cached 1.08 / 1.04 x (566.8 vs 524.2 TFLOP/s), pages of 128 1.11 / 1.06 x, chunked 1.05 "
         "/ 1.10 x, many short 1.05 / 1.03 x, the mixed step 1.06 / 1.06 x, long prefill 1.05 / 0.97 x, head size "
         "256 1.04 / 1.04 x, decode level",
         Where(layout=NHD, cache="16-bit", max_keys=128, heads_over=96, full_head=True, min_block=16,
               requires=("PINGPONG",))),
    Flag("WIDE_PRODUCER", False,
         "the producer a warpgroup of four warps sharing the split layout's 16-byte key copies (56 registers per "
         "producer thread, 224 per consumer thread)",
         "the split layout at head size 256 whatever is asked, where one producer warp spills its copy addresses; "
         "the policy's `KEY_LOADS` give that producer warpgroup its registers there, so that it decides the "
         "producer only under `KEY_LOADS=0`. Only the split layout's copies are shared among the producer's warps "
         "(NHD is all TMA, which one thread issues)",
         "0.97 x on the split prefix-cached row (355.1 vs 365.8 TFLOP/s)",
         Where(layout=SPLIT), forced=Where(heads_over=128)),
    Flag("KEY_LOADS", False,
         "a producer warpgroup reads the split layout's cached keys with 16-byte loads and stores them into the K "
         "ring, 32 keys at a time, the next chunk's loads issued before this one's stores, instead of 16-byte "
         "asynchronous copies: each copy was an L2 request of its own (six times the NHD layout's requests, the "
         "L2's tag lookups at 80% of peak), where loads are merged into one request per 128-byte line (80 "
         "registers per producer thread, 216 per consumer thread)",
         "the split layout's 16-bit cache: head sizes 128 and 256, and 64 and 96 on tiles of more than 64 keys "
         "(`schedule.SPLIT_ROUTES`); not with an FP8 cache, where the copies were faster (0.82 x)",
         "with `VALUES_FIRST`, 1.01-1.23 x the copies at head sizes 128 and 256",
         Where(layout=SPLIT, min_keys=KEY_CHUNK)),
    Flag("VALUES_FIRST", False,
         "with `KEY_LOADS`: a cached tile's V^T boxes issued before its keys are loaded, so that they land while "
         "the producer waits on the keys (the ring's barriers then take two arrivals)",
         "with `KEY_LOADS`, where the values are boxes (an FP8 cache's values are copies)",
         "1.22 x over `KEY_LOADS` alone at head size 256, 1.08 x on many short",
         Where(cache="16-bit", requires=("KEY_LOADS",))),
    Flag("WIDE_KEY_CHUNKS", False,
         "with `KEY_LOADS`: 64 keys per chunk instead of 32, so that a whole 128-key tile is in flight (112 "
         "registers per producer thread, 200 per consumer thread)",
         "the split layout's 16-bit cache on tiles of more than 64 keys, which hold more than one such chunk; not "
         "with an FP8 cache, whose producer's registers also hold the widening",
         "1.09-1.18 x on the split rows of 128-key tiles; at head sizes 64 and 96, 1.12 and 1.18 x over the "
         "copies, where 32-key chunks were 0.89 and 0.98 x",
         Where(cache="16-bit", min_keys=2 * WIDE_KEY_CHUNK, requires=("KEY_LOADS",))),
    Flag("EARLY_KEYS", False,
         "with `KEY_LOADS`: each cached tile's keys loaded into the producer's registers (the two chunks it holds "
         "anyway) before it waits for the tile's buffer, so that their latency passes while the consumers still "
         "hold it",
         "the split layout's key loads at head sizes 64-128; not at head size 256 (32-key tiles: 0.985 x), nor "
         "with an FP8 cache, which the producer widens through its own ring",
         "1.03-1.09 x on the split rows",
         Where(cache="16-bit", max_key_chunks=2, requires=("KEY_LOADS",))),
    Flag("F32_WIDENING", True,
         "FP8 tiles widened through float16 and float32 (packed additions and conversions) instead of straight to "
         "bfloat16, which compiles for sm90 to one scalar `F2F.BF16.F16` per element on the pipe the softmax's "
         "exponentials take; the same bits",
         "every bfloat16 call with an FP8 cache (to float16 the widening is one packed conversion)",
         "1.50 x (NHD, 458.5 vs 305.2 TFLOP/s) and 1.26 x (split) on the FP8 row; the special-function pipe's "
         "load 47% to 25%",
         Where(cache="fp8", dtype=torch.bfloat16)),
    Flag("FP8_BOXES", False,
         "the split layout's FP8 cache into the FP8 ring by unswizzled TMA page boxes (a head's values "
         "`[D, block]`, its keys `[D / 16, block, 16]`), each landing on a whole block of the ring, instead of "
         "16-byte copies",
         "the split layout's FP8 cache at head sizes 64 and 128; head size 96 (padded in the tile: its columns "
         "past the head would need zeros written) and a key cache not contiguous from its block dimension in (the "
         "launch checks) keep the copies",
         "1.16 x (365.0 vs 313.9 TFLOP/s), 1.20 x with 32-slot pages, level at head size 64",
         Where(layout=SPLIT, cache="fp8", full_head=True)),
    Flag("WIDEN_TO_V", False,
         "the split layout's FP8 values widened into the V ring, transposed, where the new tokens' values land, "
         "instead of into a V^T ring of their own: NHD's rings, so that 128 keys in 2 stages fit (224 KiB against "
         "289) and `P V` runs asynchronously as in NHD",
         "the split layout's FP8 calls on tiles of more than 64 keys (long calls at head sizes 64 and 128)",
         "1.03 x over 64 keys beside a V^T ring, 1.16 x at head size 64; 0.94 x on 64-key tiles",
         Where(layout=SPLIT, cache="fp8")),
    Flag("FUSED_SCALE", True,
         "without softcap and ALiBi, the row maximum taken on the raw scores and scaled once per row (the scale is "
         "positive: the same maximum), and each key's scale and subtraction of the maximum one fused multiply-add "
         "(`FMUL` 400 to 148 and `FADD` 520 to 264 at head size 64); with softcap or ALiBi the code is as without "
         "it",
         "every call without softcap and ALiBi",
         "1.01-1.15 x on every row timed, D64 NHD 436.7 vs 378.5 TFLOP/s"),
    Flag("FP8_SCORES", True,
         "an FP8 e4m3 query on an e4m3 cache holding every key (`k = v = None`): `Q K^T` on FP8 warpgroup MMAs "
         "(`m64n128k32 .e4m3.e4m3`, twice the 16-bit rate), the query tile and the K ring in e4m3 as they are "
         "(NHD: the keys' boxes land in the K ring, no FP8 ring for them; split: the producer lays the FP8 keys "
         "out for the MMA), so that the producer widens only the values; `P V` stays 16-bit. 80 / 48 KiB less "
         "shared memory at head size 128 (NHD / split)",
         "FP8 queries on an e4m3 cache, `k = v = None`, head sizes 64 and 128 (a new token's 16-bit key would need "
         "a 16-bit query; a padded head's boxes are 16-bit only)",
         "against the query widened as it is loaded: 1.26-1.28 x on NHD's prefix-cached row (577.8 vs 453.3), "
         "1.13 x split, 1.16 x at pages of 128, 1.28 x on the long prefill, 1.10 x at head size 64; the same "
         "error against a float64 oracle (2.2-2.4e-3 relative L2, 1k to 128k keys)",
         Where(cache="e4m3", full_head=True, fp8_query=True, kv_in_cache=True)),
    Flag("LAZY_RESCALE", True,
         "a row's running max moves only when a tile's maximum passes it by more than 8 (log2 units, "
         "`consumer.RESCALE_GROWTH`: P's entries stay at most 2^8), and each consumer rescales its accumulator "
         "only on a tile where one of its rows' max moved, decided by a vote of its rows (a reduction across its "
         "four warps: two more barriers per tile), instead of 64 multiplies per thread on every tile",
         "the engine's call (`k = v = None`) on a 16-bit NHD cache, tiles of at most 128 keys walked by one "
         "program, where `SOFTMAX_UNDER_PV` does not apply (head size 96, pages of 8 tokens); with the split "
         "layout's copy addresses beside them the consumers spill on its vote (ALiBi 56 bytes, a window 24, "
         "softcap 20)",
         "on the engine suite (H100, 2026-12-07, three alternating rounds): 1.01-1.04 x on the engine call's "
         "prefill rows, level on decode; where it is off it measured 0.86-1.01 x with an FP8 cache, 0.98-1.03 x "
         "with the new tokens' K/V passed apart, 0.97-0.99 x on 256-key tiles (head size 64), 0.95 x with split "
         "keys",
         Where(layout=NHD, cache="16-bit", max_keys=128, kv_in_cache=True, one_walk=True,
               unless=("SOFTMAX_UNDER_PV",))),
)

#: Every flag, with its value before a route's flags and the resolution apply.
DEFAULTS = {flag.name: flag.default for flag in FLAGS}

#: Flags that are built but have not yet passed the suites on a GPU or been timed there: off, and on no route of
#: the policy, until they have (``PAGEDPREFILL_SM80_SCHEDULE`` turns one on to check and time it).
UNVERIFIED_FLAGS: frozenset = frozenset({"WIDE_BOXES"})


def applied(asked: dict, shape: ProblemShape, config: TileConfig) -> dict:
    """``asked`` (a value for every flag) as calls of ``shape`` on ``config`` take it: each flag on where it is
    asked or forced and its rule holds, in the table's order."""
    flags: dict = {}
    for flag in FLAGS:
        on = bool(asked[flag.name]) or (flag.forced is not None and flag.forced.holds(shape, config, flags))
        flags[flag.name] = on and flag.applies.holds(shape, config, flags)
    return flags


def flag_table() -> str:
    """:data:`FLAGS` as the Markdown table docs/backends/sm80.md shows."""
    rows = ["| flag | default | what it does | applies to | where it is on | measured |",
            "| --- | --- | --- | --- | --- | --- |"]
    for flag in FLAGS:
        applies = flag.applies.describe()
        if flag.forced is not None:
            applies += f"; on whatever is asked at {flag.forced.describe()}"
        rows.append(f"| `{flag.name}` | {'on' if flag.default else 'off'} | {flag.what} | {applies} | {flag.where} "
                    f"| {flag.measured} |")
    return "\n".join(rows) + "\n"
