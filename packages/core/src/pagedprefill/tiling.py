"""Tiling-policy types shared by all backends.

A backend's policy maps a :class:`ProblemShape` (what a call looks like, without its data) and a
:class:`~pagedprefill.device.DeviceInfo` to a :class:`TileConfig`. Policies are plain callables, so a
table-driven policy, a rule set or a tuned lookup all fit the :class:`TilingPolicy` protocol.

Shared-memory model (:meth:`TileConfig.shared_mem_bytes`). Triton stages the operands of ``tl.dot`` in
shared memory. Per program the kernel holds:

* the Q tile, ``block_m x D_pad`` elements (loaded once, staged for the first dot);
* a K tile and a V tile, ``block_n x D_pad`` each, multiplied by ``num_stages`` when the loop is software
  pipelined (each stage is one buffer of both);
* the probability tile P, ``block_m x block_n`` elements, converted through shared memory to feed the
  second dot.

``D_pad`` is the head size rounded up to a power of two (at least 16), and the element size is that of the
compute dtype (FP8 caches are dequantised to the query dtype before the dot). The model is an upper
estimate: the compiler may reuse buffers and allocate less; the GPU tests compare it with what Triton
reports for compiled kernels.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional, Protocol, runtime_checkable

import torch

from .device import DeviceInfo
from .types import FP8_QUERY_DTYPES, KVCacheDType, KVLayout, PrefillProblem


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_head_size(head_size: int) -> int:
    """Head size as the kernels hold it in registers: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_power_of_2(head_size))


@dataclass(frozen=True)
class ProblemShape:
    """The data-free description of a call that tiling policies decide on.

    ``max_query_len`` is the caller's hint (None when not given); ``num_tokens``/``num_seqs`` are the tensor
    extents, so a policy can tell a batch of short queries from a long prefill without reading lengths. Option
    values that no policy reads (the sliding window, say) are not part of it: a shape is the key under which
    a backend remembers its policy's tile, and such values would only split that memo. ``fp8_query``: ``q`` is
    FP8 (``dtype`` is then the 16-bit type the call computes in); ``kv_in_cache``: the new tokens' keys and
    values are read from the cache (``k = v = None``), so that every key tile is a cache page's.
    ``pages_per_seq``: the block table's width, which bounds every sequence's cached keys (None when unknown).
    """

    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    block_size: int = 16
    num_tokens: int = 0
    num_seqs: int = 1
    max_query_len: Optional[int] = None
    layout: KVLayout = KVLayout.NHD
    fp8_query: bool = False
    kv_in_cache: bool = False
    pages_per_seq: Optional[int] = None

    def __post_init__(self) -> None:
        # Spellings are accepted ("fp8_e4m3", "split"); the shape holds the enums, which compare equal to them.
        object.__setattr__(self, "kv_cache_dtype", KVCacheDType.parse(self.kv_cache_dtype))
        object.__setattr__(self, "layout", KVLayout(self.layout))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def head_size_padded(self) -> int:
        return padded_head_size(self.head_size)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def query_len_bound(self) -> int:
        """Best host-side upper bound of one sequence's new tokens (no device read)."""
        return self.max_query_len if self.max_query_len is not None else self.num_tokens

    def key_tiles_bound(self, block_n: int) -> Optional[int]:
        """Most key tiles of ``block_n`` keys one sequence can walk (its cached pages' and, when the new tokens'
        keys come separately, theirs), from the block table's width; None when the width is unknown."""
        if self.pages_per_seq is None:
            return None
        cached = -(-self.pages_per_seq * self.block_size // block_n)
        return cached if self.kv_in_cache else cached + -(-self.query_len_bound // block_n)

    @property
    def workload(self) -> str:
        """``"short"`` when sequences bring few new tokens on average (decode-like), else ``"long"``."""
        mean = self.num_tokens / max(1, self.num_seqs)
        return "short" if min(mean, self.query_len_bound) <= 256 else "long"


@dataclass(frozen=True)
class TileConfig:
    """How one launch is tiled.

    Attributes:
        block_m: rows of a query tile; each row is one (token, query head) pair.
        block_n: keys per inner-loop step.
        num_warps: warps per program (a power of two).
        num_stages: software-pipelining depth of the key loop (1 = none).
        heads_per_tile: query heads of one KV group packed into a tile, so their K/V tiles are read once.
            ``block_m // heads_per_tile`` tokens share a tile. 1 = one head per program.
        split_masks: run unmasked key tiles without mask arithmetic and masked tiles (diagonal, window
            edges, tails) separately. False applies every mask to every tile (smaller code).
        pagewise: address cached keys page by page (one block-table read per page, the block size known to
            the compiler) when the block size is a power of two that divides or is a multiple of ``block_n``
            (:func:`settle` turns it off otherwise); False looks the block table up per key, for any block size.
        fp32_dot: precision of the dots for float32 inputs: ``"ieee"`` (exact) or ``"tf32"`` (faster, about
            1e-3 relative error); 16-bit inputs are unaffected.
        kernel: which kernel runs the tile: ``"portable"`` is core's Triton kernel, which every Triton
            backend runs; a backend may name a kernel of its own (sm80's ``"hopper"``), and falls back to the
            portable kernel, with the same tile, for a call its own kernel cannot take.
        key_splits: programs that share each query tile's keys (flash-decoding): each attends to one of
            ``key_splits`` consecutive runs of the tile's key tiles and writes its rows' partial output and
            log-sum-exp, and a second launch combines them (:func:`key_splits_for`). 1 = no split.
    """

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 1
    heads_per_tile: int = 1
    split_masks: bool = True
    pagewise: bool = True
    fp32_dot: str = "ieee"
    kernel: str = "portable"
    key_splits: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}: expected a power of two >= 1, got {v}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"TileConfig: block_m and block_n must be >= 16 (tl.dot), got {self.block_m}, "
                             f"{self.block_n}")
        if self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages: expected >= 1, got {self.num_stages}")
        if self.fp32_dot not in ("ieee", "tf32"):
            raise ValueError(f"TileConfig.fp32_dot: expected 'ieee' or 'tf32', got {self.fp32_dot!r}")
        if not 1 <= self.key_splits <= MAX_KEY_SPLITS:
            raise ValueError(f"TileConfig.key_splits: expected 1..{MAX_KEY_SPLITS}, got {self.key_splits}")
        if not 1 <= self.heads_per_tile <= self.block_m:
            raise ValueError(f"TileConfig.heads_per_tile: expected 1..block_m={self.block_m}, "
                             f"got {self.heads_per_tile}")

    @property
    def tokens_per_tile(self) -> int:
        """New tokens per tile: ``block_m`` rows hold this many tokens of ``heads_per_tile`` heads each."""
        return self.block_m // self.heads_per_tile

    def shared_mem_bytes(self, head_size: int, element_size: int) -> int:
        """Estimated shared memory per program (see the module docstring for the model)."""
        d = padded_head_size(head_size)
        stages = max(1, self.num_stages)
        q_tile = self.block_m * d
        kv_tiles = 2 * self.block_n * d * stages
        p_tile = self.block_m * self.block_n
        return element_size * (q_tile + kv_tiles + p_tile)

    def fits(self, head_size: int, element_size: int, device: DeviceInfo) -> bool:
        return self.shared_mem_bytes(head_size, element_size) <= device.max_shared_mem

    def with_(self, **changes) -> TileConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "heads_per_tile": self.heads_per_tile,
                "split_masks": self.split_masks, "pagewise": self.pagewise, "fp32_dot": self.fp32_dot,
                "kernel": self.kernel, "key_splits": self.key_splits}


@runtime_checkable
class TilingPolicy(Protocol):
    """``(problem shape, device) -> TileConfig``; each backend ships one."""

    def __call__(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig: ...


def pagewise_possible(block_size: int, block_n: int) -> bool:
    """Whether page-wise addressing serves this block size: a power of two dividing, or a multiple of,
    ``block_n`` (so that a key tile covers whole pages or lies inside one)."""
    return block_size & (block_size - 1) == 0 and (block_n % block_size == 0 or block_size % block_n == 0)


def settle(config: TileConfig, shape: ProblemShape) -> TileConfig:
    """The config as the kernel will run it for ``shape``: no more packed heads than the group has, and
    page-wise addressing only where the block size allows it. The launcher executes what this returns."""
    heads = min(config.heads_per_tile, max(1, shape.group_size))
    pagewise = config.pagewise and pagewise_possible(shape.block_size, config.block_n)
    if heads != config.heads_per_tile or pagewise != config.pagewise:
        config = config.with_(heads_per_tile=heads, pagewise=pagewise)
    return config


#: Packings whose tiles do at least this share of the best packing's useful work (:func:`packing_score`) count as
#: level with it (:func:`pack_heads`).
PACKING_TOLERANCE = 0.97


def _packed_tiles(shape: ProblemShape, block_m: int, heads: int) -> tuple[int, float, int, int]:
    """``(group, mean new tokens per sequence, tiles per sequence, tiles per KV group)`` of a launch that packs
    ``heads`` heads of each KV group into tiles of ``block_m`` rows (no lengths are read)."""
    group = max(1, shape.group_size)
    heads = max(1, min(heads, group, block_m))
    tokens = max(1.0, shape.num_tokens / max(1, shape.num_seqs))
    return group, tokens, int(-(-tokens // (block_m // heads))), -(-group // heads)


def row_efficiency(shape: ProblemShape, block_m: int, heads: int) -> float:
    """The share of a launch's tile rows that hold a (new token, query head) pair when ``heads`` query heads of
    each KV group share a tile of ``block_m`` rows, for sequences of the shape's mean new tokens (no lengths are
    read). Rows go to waste three ways: a last chunk of the group with fewer heads than the others (a group of
    3 in chunks of 2), rows past ``(block_m // heads) * heads`` (3 heads in 128 rows leave 2), and the last,
    partial tile of each sequence's tokens."""
    group, tokens, tiles, chunks = _packed_tiles(shape, block_m, heads)
    return tokens * group / (tiles * chunks * block_m)


def packing_score(shape: ProblemShape, block_m: int, heads: int, sms: Optional[int] = None) -> float:
    """The share of the launch's capacity that does useful work with ``heads`` heads per tile: its
    :func:`row_efficiency` times, given the device's ``sms``, the :func:`wave_efficiency` of its programs (one
    per tile of each sequence's mean new tokens, KV head and chunk of the group), which decides the prefix-cached
    rows of a group of 3: 1600 programs of 42 tokens x 3 heads fill 12 waves of 132 and 16 programs of a 13th,
    where 1536 programs of 128 tokens x 1 head end in a wave 64% full (one head per tile measured 1.09 x)."""
    score = row_efficiency(shape, block_m, heads)
    if sms:
        _, _, tiles, chunks = _packed_tiles(shape, block_m, heads)
        score *= wave_efficiency(tiles * max(1, shape.num_seqs) * max(1, shape.num_kv_heads) * chunks, sms)
    return score


def pack_heads(shape: ProblemShape, block_m: int, preferred: int, sms: Optional[int] = None) -> int:
    """How many query heads of a KV group share a tile of ``block_m`` rows for calls of ``shape`` on a device of
    ``sms`` multiprocessors: any count from 1 to the group, not only one that divides it (the last tile's rows
    past its tokens stay empty).

    Every count is scored (:func:`packing_score`); those within :data:`PACKING_TOLERANCE` of the best are level,
    and of those, the ones whose rows are as full (:func:`row_efficiency`, within the same tolerance) stay: a
    count that leaves rows empty gains nothing when the waves hide the loss. ``preferred``, the policy's
    measured packing, is kept when it is among them; otherwise the largest of them (each K/V tile then serves
    more heads). A group of 3 on 1024-token prefix-cached sequences runs one head per tile (two would leave a
    quarter of the rows empty, three end the launch in a nearly empty wave), a group of 3 in 2048-token chunks
    all three, and a decode row packs its whole group into one tile.
    """
    group = max(1, shape.group_size)
    preferred = max(1, min(preferred, group, block_m))
    scores = {h: packing_score(shape, block_m, h, sms) for h in range(1, min(group, block_m) + 1)}
    best = max(scores.values())
    level = [h for h, score in scores.items() if score >= PACKING_TOLERANCE * best]
    rows = {h: row_efficiency(shape, block_m, h) for h in level}
    fullest = max(rows.values())
    level = [h for h in level if rows[h] >= PACKING_TOLERANCE * fullest]
    return preferred if preferred in level else max(level)


def launch_grid(shape: ProblemShape, config: TileConfig) -> tuple[int, int, int]:
    """Programs of one launch: ``(tiles of new tokens, KV heads x chunks of their query heads, key splits)``.

    Sequence ``s`` owns ``ceil(q_len / tokens_per_tile)`` tiles or one more; ``num_tokens // tokens_per_tile
    + num_seqs`` covers any batch without reading lengths on the host (surplus programs exit at once).
    ``config`` is :func:`settle`d for the shape (at most ``group_size`` packed heads).
    """
    chunks = -(-shape.group_size // config.heads_per_tile)
    tiles = query_tile_programs(shape.num_tokens, shape.num_seqs, config.tokens_per_tile)
    return tiles, shape.num_kv_heads * chunks, config.key_splits


def query_tile_programs(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    """Programs along a launch's first axis (its query tiles) for ``num_tokens`` new tokens of ``num_seqs``
    sequences in tiles of ``tokens_per_tile`` tokens (see :func:`launch_grid`)."""
    return num_tokens // tokens_per_tile + num_seqs


def launch_order(query_lens: Sequence[int], tokens_per_tile: int, heavy_first: bool = False,
                 skip_decode: bool = False) -> list[Optional[tuple[int, int]]]:
    """What each program along a launch's first axis takes, in program order: ``(sequence, first token of its
    query tile within the sequence)``, or None where the program has nothing to compute.

    The host's account of the kernels' building blocks :func:`~pagedprefill.triton.blocks.program_tile` (index
    order, reversed under ``heavy_first``) and :func:`~pagedprefill.triton.blocks.tile_sequence`, for new tokens
    packed in sequence order, ``query_lens[s]`` of sequence ``s``. Sequence ``s`` owns the tiles from
    ``start[s] // tokens_per_tile + s`` up to the next sequence's first: its ``ceil(query_lens[s] /
    tokens_per_tile)`` query tiles and at most one more (the last sequence, every tile left in the grid). Those
    past its tokens have nothing to compute, nor, under ``skip_decode``, those of a single-token (decode)
    sequence. The contexts do not change the order. Every query tile of every sequence is taken by exactly one
    program.
    """
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile: expected >= 1, got {tokens_per_tile}")
    starts = [0]
    for length in query_lens:
        if length < 0:
            raise ValueError(f"query_lens: expected lengths >= 0, got {list(query_lens)}")
        starts.append(starts[-1] + length)
    firsts = [start // tokens_per_tile + seq for seq, start in enumerate(starts[:-1])]
    programs = query_tile_programs(starts[-1], len(firsts), tokens_per_tile)
    order: list[Optional[tuple[int, int]]] = []
    for program in range(programs):
        tile = programs - 1 - program if heavy_first else program
        seq = bisect.bisect_right(firsts, tile) - 1
        tok0 = (tile - firsts[seq]) * tokens_per_tile
        length = query_lens[seq]
        done = tok0 >= length or (skip_decode and length == 1)
        order.append(None if done else (seq, tok0))
    return order


#: Most programs that may share one query tile's keys (:attr:`TileConfig.key_splits`).
MAX_KEY_SPLITS = 32
#: The share of the multiprocessors a split launch keeps busy in every wave, at least, where a split count
#: allows it: its programs do about the same work (each split takes the same number of key tiles), so a last
#: wave that is partly empty leaves the rest of the device idle for a whole program's time.
SPLIT_WAVE_EFFICIENCY = 0.9
#: Walks of at most this many key tiles are not split: a split launch and its combine cost more GPU time than the
#: walk they shorten. On an H100 (ci/gpu/split_sweep.py) 4 decode rows took 21.6 us unsplit against 25.4 in 4
#: splits on 1024 keys, and 34.8 against 29.0 on 2048 (17 tiles of 128): the split pays from about 16 tiles on.
UNSPLIT_WALK_TILES = 16
#: The most waves of programs a split launch makes (a bound on its partial rows, and on the work each split
#: repeats: its query tile's load and its partial row).
MAX_SPLIT_WAVES = 4


def split_scratch_bytes(shape: ProblemShape, key_splits: int) -> int:
    """Bytes of the partial rows a launch with ``key_splits`` splits writes: a float32 row of the padded head
    size and one log-sum-exp per (split, token, query head)."""
    return 4 * key_splits * shape.num_tokens * shape.num_heads * (shape.head_size_padded + 1)


def wave_efficiency(programs: int, sms: int) -> float:
    """The share of ``sms`` multiprocessors that ``programs`` programs of equal work keep busy over their waves."""
    return programs / (-(-programs // sms) * sms)


def key_splits_for(shape: ProblemShape, config: TileConfig, device: DeviceInfo) -> int:
    """How many programs should share each query tile's keys for calls of ``shape`` on ``config``'s tile.

    A launch with fewer programs than the device has multiprocessors (decode rows and few sequences: 4
    sequences x 8 KV heads are 32 programs for 132 multiprocessors) splits every tile's keys: the fewest splits
    whose programs fill their waves to :data:`SPLIT_WAVE_EFFICIENCY` (4 x 32 = 128 programs, one wave of 97%,
    rather than 9 x 32 = 288, two full waves and one of 18%), else the split count that fills them best. Decided
    from the shape alone (no lengths read, so no host synchronisation, and a fixed grid and scratch size:
    CUDA-graph safe); a sequence whose keys are fewer than the splits leaves the surplus programs empty, which
    write an empty partial row. No more splits than the key tiles the block table's width allows
    (:meth:`ProblemShape.key_tiles_bound`), and none where that is at most :data:`UNSPLIT_WALK_TILES`. At most
    :data:`MAX_KEY_SPLITS` splits and :data:`MAX_SPLIT_WAVES` waves, so the partial rows
    (:func:`split_scratch_bytes`) hold at most ``MAX_SPLIT_WAVES x SMs x block_m`` rows (69 MB at head size 256
    on an H200, 35 MB at 128).
    """
    tiles, heads, _ = launch_grid(shape, config.with_(key_splits=1))
    programs = tiles * heads
    sms = max(1, device.num_sms or 0)
    if programs == 0 or programs >= sms:  # nothing to launch, or enough programs to fill the device
        return 1
    most = min(MAX_KEY_SPLITS, MAX_SPLIT_WAVES * sms // programs)
    key_tiles = shape.key_tiles_bound(config.block_n)
    if key_tiles is not None:
        if key_tiles <= UNSPLIT_WALK_TILES:
            return 1
        most = min(most, key_tiles)
    best = 1
    for splits in range(1, most + 1):
        efficiency = wave_efficiency(splits * programs, sms)
        if efficiency >= SPLIT_WAVE_EFFICIENCY:
            return splits
        if efficiency > wave_efficiency(best * programs, sms):
            best = splits
    return best


def shrink_to_fit(config: TileConfig, shape: ProblemShape, device: DeviceInfo,
                  budget: Optional[int] = None) -> TileConfig:
    """Drop stages, then halve ``block_n``/``block_m`` until the config fits the shared-memory budget, and
    :func:`settle` the result for the shape.

    The shared rule every policy ends with, so no policy can hand a kernel a tile the device cannot hold.
    ``budget`` defaults to the device's shared memory per block (48 KiB when unknown).
    """
    elem = shape.element_size
    if budget is None:
        budget = device.max_shared_mem or 48 * 1024
    while config.shared_mem_bytes(shape.head_size, elem) > budget:
        if config.num_stages > 2:
            config = config.with_(num_stages=config.num_stages - 1)
        elif config.block_n > 16 and config.block_n >= config.block_m // 2:
            config = config.with_(block_n=config.block_n // 2)
        elif config.block_m > 16:
            config = config.with_(block_m=config.block_m // 2,
                                  heads_per_tile=min(config.heads_per_tile, config.block_m // 2))
        elif config.num_stages > 1:
            config = config.with_(num_stages=1)
        else:
            break
    return settle(config, shape)


def problem_shape(problem: PrefillProblem) -> ProblemShape:
    """The data-free description of ``problem`` that policies decide on."""
    return ProblemShape(
        head_size=problem.head_size,
        num_heads=problem.num_heads,
        num_kv_heads=problem.num_kv_heads,
        dtype=problem.dtype,
        kv_cache_dtype=problem.cache.dtype,
        block_size=problem.cache.block_size,
        num_tokens=problem.num_tokens,
        num_seqs=problem.batch.num_seqs,
        max_query_len=problem.batch.max_query_len,
        layout=problem.cache.layout,
        fp8_query=problem.q.dtype in FP8_QUERY_DTYPES,
        kv_in_cache=problem.kv_in_cache,
        pages_per_seq=problem.batch.block_table.shape[1],
    )
