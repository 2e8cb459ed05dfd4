"""Tiling policy of the sm80 backend: measured tables first, rules for what the tables lack.

Lookup order for a problem key (see :func:`pagedprefill.tuning.table_key`):

1. the user's table written by ``pagedprefill tune`` on this GPU (:func:`pagedprefill.tuning.user_table_path`);
2. the table shipped in this package (``tuned/<capability>.json``), measured by the maintainers;
3. rules, drawn from the H200 measurements behind ``tuned/sm90.json``: 128-row tiles (two warpgroups, so
   Hopper's warpgroup MMA is used), 64 keys per step, page-wise cache addressing, query heads of a KV group
   packed two per tile (four for short queries) so each K/V tile serves several heads, and pipelining
   depth from the device's shared memory.

Every portable tile goes through :func:`pagedprefill.tiling.shrink_to_fit` against the device's shared memory,
so sm80 (163 KiB), sm86/sm89 (99 KiB) and sm90 (227 KiB) parts all get tiles they can hold; a Hopper tile is
checked against that kernel's own model instead (:func:`pagedprefill_sm80.hopper.schedule.shared_bytes`).

Which kernel runs the tile (:func:`choose_kernel`): on sm90, the warp-specialised Hopper kernel
(:mod:`pagedprefill_sm80.hopper`) for the shapes it takes and was measured faster on (``auto``, the
default: :data:`HOPPER_WINS`), or for every shape it takes when ``PAGEDPREFILL_SM80_KERNEL=hopper`` asks for
it; ``portable`` forces core's kernel everywhere. The kernel is chosen first, then its tile: a table entry
names the kernel it was measured on (``pagedprefill tune`` measures the chosen kernel's tiles,
:func:`search_space`), and only entries of the chosen kernel count; the Hopper kernel's rule is
:func:`hopper_config`. Some routes also set the Hopper kernel's schedule flags (:func:`hopper_schedule`). A
Hopper launch too small to fill the GPU splits each tile's keys (:func:`pagedprefill.tiling.key_splits_for`).
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Optional

from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig, key_splits_for, pack_heads, settle, shrink_to_fit
from pagedprefill.tuning import load_table, lookup, table_key, user_table_path
from pagedprefill.types import KVCacheDType, KVLayout

from .hopper.schedule import FP8_CACHES, route_flags, shape_unfit_reason

#: Environment variable that picks the kernel on sm90: ``auto`` (the policy's choice), ``hopper`` or ``portable``.
KERNEL_ENV = "PAGEDPREFILL_SM80_KERNEL"
KERNEL_CHOICES = ("auto", "hopper", "portable")
#: Whether ``auto`` picks the Hopper kernel where it fits and measured faster (:data:`HOPPER_WINS`): on an H200
#: the three backends' conformance suites pass with it forced, and it is faster than the portable kernel on
#: the bench rows it takes (docs/performance.md).
HOPPER_BY_DEFAULT = True
#: ``(head size, cache dtype)`` pairs on which ``auto`` picks it: where it beat the portable kernel on the H200,
#: same data, same run: at head size 128 with a cache in the input dtype 1.17-1.45 x on NHD and 1.23-1.50 x on
#: the split layout; 64: 1.03 x (NHD) and 1.15 x (split); 96: 1.44 x and 1.39 x; 256: 1.05 x and 1.19 x. FP8
#: caches, with the producer widening each tile once (the FP8 prefix-cached row, NHD / split): e4m3 at head size
#: 64 1.18 / 1.19 x, at 96 1.83 / 1.45 x, at 128 1.19 / 1.15 x; e5m2 at 64 1.13 / 1.07 x, at 96 1.58 / 1.34 x, at
#: 128 1.57 / 1.54 x.
#: ``(layout, head size, cache dtype)`` routes the Hopper kernel is built for but ``auto`` does not take yet,
#: whatever :data:`HOPPER_WINS` says, because they have not yet passed the suites on a GPU
#: (``PAGEDPREFILL_SM80_KERNEL=hopper`` runs them). Empty: every route has.
UNVERIFIED: frozenset = frozenset()
HOPPER_WINS = frozenset({*((head_size, KVCacheDType.AUTO) for head_size in (64, 96, 128, 256)),
                         *((head_size, cache) for head_size in (64, 96, 128) for cache in FP8_CACHES)})


#: Head sizes at which the split layout's short calls of a 16-bit cache take 128-key tiles, like its long ones.
WIDE_SHORT_SPLIT_HEAD_SIZES = (64, 96, 128)


def hopper_schedule(shape: ProblemShape, block_n: Optional[int] = None) -> dict:
    """Schedule flags the policy sets for the Hopper kernel's calls of ``shape`` on tiles of ``block_n`` keys (by
    default :func:`hopper_config`'s): :func:`pagedprefill_sm80.hopper.schedule.route_flags`."""
    return route_flags(shape, hopper_config(shape).block_n if block_n is None else block_n)


def kernel_preference() -> str:
    """The kernel asked for through :data:`KERNEL_ENV` (``auto`` when unset)."""
    wanted = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if wanted not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}: expected one of {', '.join(KERNEL_CHOICES)}, got {wanted!r}")
    return wanted


def shipped_table(device: DeviceInfo) -> dict[str, TileConfig]:
    name = f"sm{device.capability[0]}{device.capability[1]}.json"
    path = resources.files("pagedprefill_sm80") / "tuned" / name
    return load_table(path) if path.is_file() else {}


def rule_config(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """The rule used when no table has the key."""
    d = shape.head_size_padded
    wide = shape.element_size <= 2
    block_m = 128 if wide else 64
    block_n = 64 if d <= 128 or wide else 32
    warps = 4 if (d <= 64 or block_m == 64) else 8
    stages = 3 if device.max_shared_mem >= 160 * 1024 and d <= 128 else 2
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                      heads_per_tile=pack_heads(shape, block_m, portable_packing(shape), device.num_sms))


def portable_packing(shape: ProblemShape) -> int:
    """The portable kernel's preferred head packing, measured on the H200 at a group of 4 (the bench's shape):
    four heads per tile on short calls, two on long ones at head size 128, one at other head sizes.
    :func:`pagedprefill.tiling.pack_heads` moves off it where another count fills the GPU better."""
    if shape.workload == "short":
        return 4
    return 2 if shape.head_size_padded == 128 else 1


#: Groups the Hopper kernel packs whole into its tiles on long calls (``ci/gpu/heads_sweep.py`` on an H100,
#: 2026-12-07: the engine's call on the models suite's prefix-cached and chunked rows). Groups of up to 4 keep the
#: packing measured at the bench's group of 4, and 6 its two heads per tile (level with six, rows as full);
#: larger groups (MQA with dozens of heads) would leave a tile a handful of tokens: Falcon-7B's 71 heads in one
#: tile of one token ran at 0.63 x two heads per tile.
WHOLE_GROUP_SIZES = (5, 7, 8)


def hopper_packing(shape: ProblemShape, measured: Optional[int] = None) -> int:
    """The Hopper kernel's preferred head packing for calls of ``shape``: on long calls the whole group for the
    groups of :data:`WHOLE_GROUP_SIZES` (a group of 8: 1.02-1.14 x two heads per tile on the prefix-cached rows,
    1.01 x on the chunked one; 5 and 7: 1.01-1.02 x one head per tile on the prefix-cached rows at TP 2-8, 1.00 and
    0.96 x at TP 1, 1.05 and 1.10 x on the chunked ones), else
    ``measured`` (a table entry's, tuned at a group of 4) or the rule's two heads; on short calls ``measured`` or
    four. :func:`pagedprefill.tiling.pack_heads` moves off it where another count fills the GPU better."""
    if shape.workload == "short":
        return measured or 4
    if shape.group_size in WHOLE_GROUP_SIZES:
        return shape.group_size
    return measured or 2


def hopper_config(shape: ProblemShape, sms: Optional[int] = None) -> TileConfig:
    """The Hopper kernel's tile: 128 rows over two consumer warpgroups, the query heads of a KV group packed as
    :func:`hopper_packing` prefers unless another count fills the ``sms`` multiprocessors better
    (:func:`pagedprefill.tiling.pack_heads`). Keys per step and ring depth, from the H200 timings
    (docs/performance.md):

    * head size up to 128, cache in the input dtype, NHD layout or a long prefill: 128 keys per step in a 2-deep
      ring (half the per-step work outside the MMAs: block-table reads, masks, the softmax's row reductions);
    * head size 64 in the NHD layout, long calls: 256 keys per step in a 3-deep ring (208 KiB), the widest
      warpgroup MMA (1.07 x over 128 keys on the prefix-cached row; 2 stages 1.05 x);
    * the split layout's short calls: 64 keys in a 3-deep ring (128 keys were 3.5% slower on its many-short
      row); at head sizes 64, 96 and 128 with a 16-bit cache, whose producer loads 128-key tiles in 64-key
      chunks, 128 keys in a 2-deep ring (the many-short row: 379.8 vs 367.6 TFLOP/s at head size 128, 284.6 vs
      244.9 at 64, 323.5 vs 278.2 at 96);
    * an FP8 cache: 128 keys in a 2-deep ring, like the input dtype (1.14 x over 64 keys; 64 keys with a third
      stage were level with two);
    * head size 256: 64 keys in a 2-deep ring (the accumulator and K/V tiles are twice as large); 32 keys in
      the split layout, whose V^T ring takes the room of a third K/V tile;
    * an FP8 cache in the split layout, long calls at head sizes 64 and 128: 128 keys in a 2-deep ring, its
      cached values widened into the V ring (:func:`hopper_schedule`; 1.03 x over 64 keys beside a V^T ring at
      head size 128, 1.16 x at 64). Its short calls, and head size 96, whose padded head takes the copies: 64
      keys in a 2-deep ring (its FP8 ring beside the V^T ring, 161 KiB; 128 keys would take 289 KiB). On the
      many-short row with an FP8 cache, 128 keys were 0.97 x; at head size 96 the copies' producer spills beside
      the V ring.
    """
    heads = pack_heads(shape, 128, hopper_packing(shape), sms)
    split, fp8 = shape.layout is KVLayout.SPLIT, shape.kv_cache_dtype.is_fp8
    if shape.head_size_padded > 128 and split:
        block_n, stages = 32, 2  # beside the split layout's own V^T ring (164 KiB)
    elif shape.head_size_padded > 128 or (split and fp8 and (
            shape.workload == "short" or shape.head_size != shape.head_size_padded)):
        block_n, stages = 64, 2
    elif shape.head_size_padded <= 64 and not split and shape.workload == "long" and not fp8:
        block_n, stages = 256, 3
    elif not split or shape.workload == "long" or shape.head_size in WIDE_SHORT_SPLIT_HEAD_SIZES:
        # (an FP8 cache: NHD, and the split layout's long calls at head sizes 64 and 128)
        block_n, stages = 128, 2
    else:
        block_n, stages = 64, 3
    return TileConfig(block_m=128, block_n=block_n, num_warps=8, num_stages=stages, heads_per_tile=heads,
                      kernel="hopper")


def hopper_unfit_reason(shape: ProblemShape, device: DeviceInfo) -> Optional[str]:
    """Why the Hopper kernel does not run calls of ``shape`` on ``device``, or None when it does."""
    if device.capability != (9, 0):
        return f"needs compute capability 9.0 (warpgroup MMA, TMA), the device has " \
               f"{device.capability[0]}.{device.capability[1]}"
    triton_version = _triton_version()
    if triton_version[:2] != GLUON_TRITON:
        # Gluon is experimental: its API moves between Triton releases.
        return f"is written in Gluon for Triton {GLUON_TRITON[0]}.{GLUON_TRITON[1]}, this Triton is " \
               f"{'.'.join(map(str, triton_version))}"
    return shape_unfit_reason(shape, hopper_config(shape), device.max_shared_mem)


#: The Triton release whose Gluon the Hopper kernel is written and tested against.
GLUON_TRITON = (3, 6)


def _triton_version() -> tuple:
    import triton

    return tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3] if part.isdigit())


def choose_kernel(shape: ProblemShape, device: DeviceInfo) -> tuple[str, str]:
    """``(kernel, why)``: the kernel the policy runs calls of ``shape`` on, and the reason, for ``info``,
    the bench and tests."""
    wanted = kernel_preference()
    if wanted == "portable":
        return "portable", f"{KERNEL_ENV}=portable"
    unfit = hopper_unfit_reason(shape, device)
    if unfit is not None:
        return "portable", f"the Hopper kernel {unfit}"
    if wanted == "hopper":
        return "hopper", f"{KERNEL_ENV}=hopper"
    if (shape.layout, shape.head_size, shape.kv_cache_dtype) in UNVERIFIED:
        return "portable", f"the Hopper kernel reads head size {shape.head_size} with kv_cache_dtype=" \
                           f"{shape.kv_cache_dtype.value!r} in the {shape.layout} layout only when asked for " \
                           f"({KERNEL_ENV}=hopper) until it has passed the suites on a GPU"
    if HOPPER_BY_DEFAULT and (shape.head_size, shape.kv_cache_dtype) in HOPPER_WINS:
        return "hopper", "the Hopper kernel takes this shape and is the faster one"
    if HOPPER_BY_DEFAULT:
        return "portable", f"the Hopper kernel has not measured faster at head size {shape.head_size} with " \
                           f"kv_cache_dtype={shape.kv_cache_dtype.value!r}"
    return "portable", f"the Hopper kernel runs only when asked for ({KERNEL_ENV}=hopper) until it is verified"


def tuned_config(shape: ProblemShape, device: DeviceInfo, kernel: str) -> Optional[TileConfig]:
    """The measured tile for ``shape`` on ``kernel``: the user's table first, then the shipped one, each read for
    entries measured on that kernel only (a table tuned before the kernel was chosen holds the other's tiles)."""
    tables = [load_table(user_table_path("sm80", device)), shipped_table(device)]
    return lookup(table_key(shape, device), *({k: c for k, c in t.items() if c.kernel == kernel} for t in tables))


def sm80_policy(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    kernel, _ = choose_kernel(shape, device)
    if kernel == "hopper":
        config = tuned_config(shape, device, kernel)
        if config is None or shape_unfit_reason(shape, config, device.max_shared_mem) is not None:
            config = hopper_config(shape, device.num_sms)
        else:  # a table's key has no group: its entry's packing was tuned at the bench's group of 4
            preferred = hopper_packing(shape, config.heads_per_tile)
            config = config.with_(heads_per_tile=pack_heads(shape, config.block_m, preferred, device.num_sms))
        # Its fit was checked against the Hopper kernel's own shared-memory model (shape_unfit_reason): the
        # portable kernel's (shrink_to_fit) counts buffers this kernel does not allocate and would drop a stage
        # from a tile that fits (128 keys in 3 stages at head size 128: 225 KiB).
        config = settle(config, shape)
        # Launches too small to fill the GPU (decode rows, few sequences on long contexts) split each tile's keys.
        return config.with_(key_splits=key_splits_for(shape, config, device))
    return portable_config(shape, device)


def portable_config(shape: ProblemShape, device: DeviceInfo) -> TileConfig:
    """The portable kernel's tile for ``shape``: its measured entry, else :func:`rule_config`, shrunk to the
    device's shared memory."""
    config = tuned_config(shape, device, "portable")
    if config is None:
        config = rule_config(shape, device)
    else:  # a table's key has no group: its entry's packing is the preferred one
        config = config.with_(heads_per_tile=pack_heads(shape, config.block_m, config.heads_per_tile,
                                                        device.num_sms))
    return shrink_to_fit(config, shape, device)


def hopper_search_space(shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
    """The Hopper kernel's candidates: its rule's tile first, then 64 or 128 keys per step in 2- or 3-deep rings
    on 128 rows (and 256 keys in a 3-deep ring at head size 64 in the NHD layout), with its rule's head packing
    and without, where the kernel takes them and they fit the device's shared memory
    (:func:`pagedprefill_sm80.hopper.schedule.shared_bytes`)."""
    rule = hopper_config(shape, device.num_sms)
    out = [rule]
    steps = [(64, 3), (128, 2), (64, 2), (128, 3)]
    if shape.head_size_padded <= 64 and shape.layout is KVLayout.NHD:
        steps.append((256, 3))
    for block_n, stages in steps:
        for heads in sorted({1, rule.heads_per_tile}):
            cfg = rule.with_(block_n=block_n, num_stages=stages, heads_per_tile=heads)
            if cfg not in out and shape_unfit_reason(shape, cfg, device.max_shared_mem) is None:
                out.append(cfg)
    return out


def search_space(shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
    """Candidates for ``pagedprefill tune``, on the kernel the policy chooses for ``shape`` (:func:`choose_kernel`):
    the Hopper kernel's (:func:`hopper_search_space`), or the portable kernel's tiles that won somewhere on the
    H200 or that the rules pick, with and without GQA packing, that fit the device. Kept small (each candidate
    costs a compile of a few seconds), so that the default keys tune in minutes."""
    if choose_kernel(shape, device)[0] == "hopper":
        return hopper_search_space(shape, device)
    group = shape.group_size
    heads = sorted({1, min(group, 4 if shape.workload == "short" else 2)})
    shapes = [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
              (128, 32, 4, 2), (64, 32, 4, 3)]  # the last two for parts with less shared memory (sm86, sm89)
    out = []
    for block_m, block_n, warps, stages in shapes:
        for h in heads:
            cfg = TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, heads_per_tile=h)
            if cfg.fits(shape.head_size, shape.element_size, device) and cfg not in out:
                out.append(cfg)
    rule = rule_config(shape, device)
    if rule not in out and rule.fits(shape.head_size, shape.element_size, device):
        out.append(rule)
    return out
