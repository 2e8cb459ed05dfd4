"""Fuzzing a backend against the reference: seeded random batches over the full ranges of the interface.

Every case is a random :class:`~pagedprefill.testing.BatchSpec` built in two steps:

1. a **compile key** (:class:`CompileKey`): everything that selects a compiled kernel. The dtype, head size,
   block size, head counts, cache layout and split-layout ``x``, FP8 cache format and scale form, the options
   (ALiBi, softcap, sinks, sliding window, ``causal=False``, ``skip_decode``, ``fp8_out_scale``,
   ``k = v = None``), the workload class the tiling policies key on, and how Triton specialises the integer
   arguments that vary with the lengths (equal to 1, a multiple of 16, or neither: sequences, tokens, cache
   blocks, block-table width, window);
2. the **case** within that key: query and context lengths (0 and 1 included), a shuffled block table with
   junk in unused columns, the window's value, softcap and ``sm_scale`` values, FP8 scales, ``b_start_loc``
   with ``B`` or ``B + 1`` entries, and N(0, 1) data; every other case has NaN in every cache slot no sequence
   holds (``BatchSpec.nan_unused_slots``). Lengths are adjusted to the key's integer states, so
   every case of a key launches the same compiled kernel.

Optional features are drawn only where the backend lists them in ``supported_features``.

Two presets, chosen by :class:`FuzzSizes`:

* ``FuzzSizes.cpu()`` (the CPU, Triton's interpreter): tiny token counts, any head size 1..256, any block size
  1..544, and a new compile key for every case (compiling costs nothing in the interpreter).
* ``FuzzSizes.gpu()``: longer sequences (contexts spanning many key tiles, some prefills past 256 tokens) and
  a menu of ``keys`` compile keys (24 by default) that the cases cycle through, so a run compiles at most that
  many kernels (a few seconds each) however many cases it has.

Each case is rebuilt from ``(seed, index)`` alone (:meth:`FuzzGenerator.spec`), so one failing case reruns on
its own; every failure prints the command that does it::

    python -m pagedprefill.testing.fuzz --backend sm80 --device cuda --mode gpu --seed 0 --case 1234

Whole runs::

    python -m pagedprefill.testing.fuzz --backend sm80 --device cuda --cases 2000 --seed 0
    TRITON_INTERPRET=1 python -m pagedprefill.testing.fuzz --backend generic --device cpu --cases 300

print a progress line at least every 15 s and end with ``fuzz: N cases, F failures`` (exit status 1 when
F > 0). On a GPU the compile keys' kernels are first compiled side by side in ``--compile-workers`` processes
(:func:`precompile`; Triton keeps what they compile in its on-disk cache), so a fresh machine spends seconds,
not minutes, before the first case.

A run of many cases can be shared among processes on one GPU (each case's reference and checks take host
time): ``--compile-only`` compiles the keys' kernels once, then each of N processes runs its share of the same
case stream with ``--shard K/N --compile-workers 0`` (the cases whose index leaves K modulo N), so that a
failure's reproducer is the one a single run prints::

    python -m pagedprefill.testing.fuzz --engine --cases 5000 --compile-only
    python -m pagedprefill.testing.fuzz --engine --cases 5000 --shard 0/4 --compile-workers 0   # ... 3/4

Each problem is checked with ``validate_problem(problem, "full")``, run on the backend directly (selection
bypassed, as :class:`~pagedprefill.testing.ConformanceSuite` does) and compared element by element with the
reference computed in float32 (:func:`~pagedprefill.testing.assert_matches_reference`).

This module does not need pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from ..api import get_registry, select_backend
from ..device import DeviceInfo, interpreter_enabled
from ..features import check_runnable
from ..registry import Backend, UnsupportedFeatureError
from ..types import FEATURES, FP8_QUERY_COMPUTE_DTYPES
from ..validation import validate_problem
from ..workloads import BatchSpec, make_problem
from .cases import DEFAULT_TOLERANCES, assert_matches_reference

#: Head sizes of the GPU preset: the Hopper kernel's four (96 its padded head) and others that take the portable kernel.
GPU_HEAD_SIZES = (1, 24, 64, 80, 96, 128, 256)
#: Block sizes drawn often (engine defaults); others are drawn uniformly from 1..544.
COMMON_BLOCK_SIZES = (1, 2, 8, 16, 32, 64, 128, 256, 544)
COMMON_HEAD_SIZES = (1, 8, 16, 24, 32, 40, 64, 72, 80, 96, 112, 128, 160, 192, 256)
MAX_BLOCK_SIZE = 544
#: Page sizes of the engine cases (:attr:`FuzzSizes.engine`): those serving engines allocate, the largest the
#: fuzz draws, and pages of a whole key tile and more.
ENGINE_BLOCK_SIZES = (16, 32, 64, 128, 256, 544)
MAX_HEAD_SIZE = 256
MAX_GQA_RATIO = 64
#: Policies call a batch "long" when its sequences bring more than this many new tokens on average
#: (:attr:`pagedprefill.ProblemShape.workload`).
SHORT_WORKLOAD_TOKENS = 256


@dataclass(frozen=True)
class FuzzSizes:
    """Ranges of the random batches and the number of compile keys.

    Attributes:
        mode: ``"cpu"`` or ``"gpu"``, the preset these sizes come from (named in reproducers).
        max_seqs: sequences per batch (1..max_seqs; an empty batch is drawn now and then).
        max_query_len, max_context_len: new and cached tokens per sequence.
        long_query_len: new tokens per sequence of "long" workload keys (0: no such keys).
        max_kv_heads: KV heads (1..max_kv_heads); the GQA ratio is drawn from 1..64 and capped so that
            ``num_heads <= max_heads``.
        max_heads: query heads.
        head_sizes: head sizes to draw from; None draws from all of 1..256.
        dtypes: query dtypes.
        full_length_heads: None, or a head count above which the token and sequence ranges shrink in
            proportion: keeps the interpreter's cost per case, which grows with heads times tokens, about flat.
        keys: None (every case draws its own compile key) or the size of the menu of compile keys the cases
            cycle through (the number of kernels a GPU run compiles).
        scale: the factor token counts were scaled by (:meth:`scaled`; named in reproducers).
        engine: every case the serving engine's call (``k = v = None``, where the backend runs it), on pages of
            :data:`ENGINE_BLOCK_SIZES` or any size from 16 to the largest, on batches that mix decode rows,
            speculative rows and chunks (:meth:`engine_mode`; named in reproducers).
    """

    mode: str = "cpu"
    max_seqs: int = 3
    max_query_len: int = 8
    max_context_len: int = 96
    long_query_len: int = 0
    max_kv_heads: int = 2
    max_heads: int = 64
    head_sizes: Optional[tuple[int, ...]] = None
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.float32)
    full_length_heads: Optional[int] = 4
    keys: Optional[int] = None
    scale: float = 1.0
    engine: bool = False

    def engine_mode(self) -> FuzzSizes:
        """These sizes with every case the serving engine's call (:attr:`engine`)."""
        return dataclasses.replace(self, engine=True)

    @classmethod
    def cpu(cls) -> FuzzSizes:
        """Tiny batches for Triton's CPU interpreter, every head and block size, a new key per case."""
        return cls()

    @classmethod
    def gpu(cls) -> FuzzSizes:
        """Larger batches, bf16 too, head sizes from :data:`GPU_HEAD_SIZES`, a menu of 24 compile keys."""
        return cls(mode="gpu", max_seqs=6, max_query_len=160, max_context_len=700, long_query_len=600,
                   max_kv_heads=4, max_heads=128, head_sizes=GPU_HEAD_SIZES,
                   dtypes=(torch.float16, torch.bfloat16, torch.float32), full_length_heads=None, keys=24)

    @classmethod
    def preset(cls, mode: str) -> FuzzSizes:
        if mode not in ("cpu", "gpu"):
            raise ValueError(f"mode: expected 'cpu' or 'gpu', got {mode!r}")
        return cls.cpu() if mode == "cpu" else cls.gpu()

    @classmethod
    def for_device(cls, device: Union[str, torch.device]) -> FuzzSizes:
        return cls.cpu() if torch.device(device).type == "cpu" else cls.gpu()

    def scaled(self, factor: float) -> FuzzSizes:
        """The same ranges with token counts multiplied by ``factor`` (at least 1 token each)."""
        return dataclasses.replace(self, max_query_len=max(1, round(self.max_query_len * factor)),
                                   max_context_len=max(1, round(self.max_context_len * factor)),
                                   long_query_len=round(self.long_query_len * factor), scale=self.scale * factor)

    def cli_args(self) -> str:
        """The command-line options of :func:`main` that select these sizes."""
        base = FuzzSizes.preset(self.mode)
        args = f"--mode {self.mode}"
        if self.scale != 1.0:
            args += f" --scale {self.scale:g}"
        if self.keys != base.keys:
            args += f" --keys {self.keys or 0}"
        if self.engine:
            args += " --engine"
        return args


def int_state(value: int) -> str:
    """How Triton specialises an integer argument: equal to 1, a multiple of 16, or neither."""
    return "1" if value == 1 else ("16" if value % 16 == 0 else "n")


@dataclass(frozen=True)
class CompileKey:
    """What selects the compiled kernel a case launches (cases of one key differ only in lengths and data).

    ``spec`` holds the key's fields of a :class:`BatchSpec` (its lengths, window value and data seed are
    placeholders); the ``*_state`` fields are Triton's specialisation (:func:`int_state`) of the integer
    arguments that vary with the lengths, and ``workload`` the class the tiling policies key their tiles on.
    """

    spec: BatchSpec
    window: bool
    seqs_state: str
    tokens_state: str
    blocks_state: str
    width_state: str
    window_state: str
    workload: str


def kernel_variant_key(spec: BatchSpec) -> Optional[tuple]:
    """What decides which compiled kernel a backend launches for ``spec`` (None: nothing is launched).

    The constexprs (head size, dtypes, layout and ``x``, features, GQA group), the block size and head counts
    (which fix every stride), Triton's specialisation (1 / multiple of 16 / other) of the extents that vary
    with the lengths, and the workload class tiling policies key their tiles on.
    """
    qlens, clens = list(spec.query_lens), list(spec.context_lens)
    B, T = len(qlens), sum(qlens)
    if B == 0 or T == 0:
        return None
    bs = spec.block_size
    cached = [c + q for c, q in zip(clens, qlens)] if spec.kv_in_cache else clens
    blocks = [-(-c // bs) for c in cached]
    num_blocks = max(1, sum(blocks) + spec.spare_blocks)
    width = max(blocks + [1]) + spec.extra_columns
    workload = "short" if min(T / B, max(qlens)) <= SHORT_WORKLOAD_TOKENS else "long"
    window = spec.sliding_window or 0
    return (spec.num_heads, spec.num_kv_heads, spec.head_size, bs, str(spec.dtype), spec.kv_cache_dtype,
            spec.layout, spec.x if spec.layout == "split" else None, spec.alibi, spec.softcap > 0, spec.sinks,
            spec.kv_cache_dtype != "auto" and spec.scale_as_tensor, spec.causal, spec.skip_decode,
            spec.fp8_out_scale is not None, spec.kv_in_cache, spec.fp8_query,
            int_state(window) if window else None, int_state(B), int_state(T), int_state(num_blocks),
            int_state(width), workload)


#: The first keys of every stream reach the ends of the ranges (then the draws are free).
_FIRST_PROFILES = (
    {"num_kv_heads": 1, "num_heads": MAX_GQA_RATIO},
    {"block_size": MAX_BLOCK_SIZE},
    {"block_size": 1},
    {"head_size": MAX_HEAD_SIZE, "dtype": torch.float32},
    {"head_size": 1},
)


class FuzzGenerator:
    """Seeded random :class:`BatchSpec` s: :meth:`spec` ``(index)`` depends only on ``(seed, sizes, features,
    index)``, so any case is rebuilt on its own; iterating yields cases 0, 1, 2, ...

    ``features`` are the optional features (:data:`pagedprefill.types.FEATURES`) cases may use: the backend's
    ``supported_features``.
    """

    def __init__(self, seed: int = 0, sizes: Optional[FuzzSizes] = None, features: frozenset = FEATURES):
        self.seed = seed
        self.sizes = sizes or FuzzSizes.cpu()
        self.features = frozenset(features)
        self.index = 0
        self.keys: list[CompileKey] = []
        if self.sizes.keys is not None:
            self.keys = [self._key(random.Random(f"{seed}:key:{k}"), k) for k in range(self.sizes.keys)]

    def __iter__(self):
        return self

    def __next__(self) -> BatchSpec:
        return self.next_spec()

    def next_spec(self) -> BatchSpec:
        """The next case's spec."""
        spec = self.spec(self.index)
        self.index += 1
        return spec

    def spec(self, index: int) -> BatchSpec:
        """Case ``index`` of the stream."""
        rng = random.Random(f"{self.seed}:case:{index}")
        key = self.keys[index % len(self.keys)] if self.keys else self._key(rng, index)
        return self._case(rng, key, seed=self.seed * 1_000_003 + index)

    # -- compile keys --------------------------------------------------------------------------------------
    def _head_size(self, rng: random.Random) -> int:
        choices = self.sizes.head_sizes
        if choices:
            return rng.choice(choices)
        return rng.choice(COMMON_HEAD_SIZES) if rng.random() < 0.5 else rng.randint(1, MAX_HEAD_SIZE)

    def _block_size(self, rng: random.Random) -> int:
        if self.sizes.engine:  # the page sizes serving engines use, and any other from 16 up
            return rng.choice(ENGINE_BLOCK_SIZES) if rng.random() < 0.6 else rng.randint(16, MAX_BLOCK_SIZE)
        r = rng.random()
        if r < 0.35:
            return rng.choice(COMMON_BLOCK_SIZES)
        if r < 0.7:
            return rng.randint(1, 12)
        return rng.randint(1, MAX_BLOCK_SIZE)

    def _key(self, rng: random.Random, ordinal: int) -> CompileKey:
        sizes, features = self.sizes, self.features
        hkv = rng.randint(1, sizes.max_kv_heads)
        cap = max(1, min(MAX_GQA_RATIO, sizes.max_heads // hkv))
        r = rng.random()
        if r < 0.8:  # every group of the models' shards (1-8); larger groups are rarer (their cost grows with them)
            ratio = rng.choice([x for x in range(1, 9) if x <= cap] or [1])
        elif r < 0.88:
            ratio = min(8, cap)
        elif r < 0.92:
            ratio = cap  # the largest group that fits (64 with one KV head)
        else:
            ratio = rng.randint(1, cap)
        kv = rng.choice(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])
        fields = dict(
            num_heads=hkv * ratio, num_kv_heads=hkv, head_size=self._head_size(rng),
            block_size=self._block_size(rng), dtype=rng.choice(list(sizes.dtypes)), kv_cache_dtype=kv,
            layout=rng.choice(["nhd", "split"]), alibi=rng.random() < 0.25,
            softcap=1.0 if rng.random() < 0.2 else 0.0,  # on/off here; the value is drawn per case
            sinks=rng.random() < 0.25, scale_as_tensor=kv != "auto" and rng.random() < 0.5,
            causal=not ("non_causal" in features and rng.random() < 0.15),
            skip_decode="skip_decode" in features and rng.random() < 0.15,
            fp8_out_scale=1.0 if "fp8_out_scale" in features and rng.random() < 0.1 else None,
            kv_in_cache="kv_in_cache" in features and (sizes.engine or rng.random() < 0.15),
        )
        if ordinal < len(_FIRST_PROFILES) and not sizes.engine:
            forced = _FIRST_PROFILES[ordinal]
            if forced.get("num_heads", 0) <= sizes.max_heads and forced.get("dtype", sizes.dtypes[0]) in sizes.dtypes:
                if not sizes.head_sizes or forced.get("head_size", sizes.head_sizes[0]) in sizes.head_sizes:
                    fields.update(forced)
        if fields["layout"] == "split" and rng.random() < 0.5:  # any x dividing the head size
            x = rng.choice([1, 2, 4, 8, 16])
            if fields["head_size"] % x == 0:
                fields["x"] = x
        long = sizes.long_query_len > SHORT_WORKLOAD_TOKENS and rng.random() < 0.2
        # A single new token in the whole batch is a key of its own (T == 1), kept rare.
        tokens = rng.choices(["1", "16", "n"], weights=[0 if long else 1, 2.5, 6.5])[0]
        seqs = "1" if tokens == "1" and rng.random() < 0.5 else rng.choice(["1", "n", "n"])
        # A one-column table needs every sequence inside one block: not with k = v = None (new tokens are cached).
        width = "1" if not fields["kv_in_cache"] and rng.random() < 0.2 else "n"
        key = CompileKey(spec=BatchSpec(**fields), window=rng.random() < 0.4, seqs_state=seqs, tokens_state=tokens,
                         blocks_state=rng.choice(["16", "n", "n"]), width_state=width,
                         window_state=rng.choice(["1", "16", "n", "n"]), workload="long" if long else "short")
        # Drawn last, and only for a backend that runs it: every other draw of the key stays as it was. An FP8 q
        # beside nothing but FP8 tensors (FP8 output and cache, k = v = None) computes in bfloat16
        # (PrefillProblem.dtype): only where the sizes draw bfloat16 (not in Triton's CPU interpreter, whose
        # bfloat16 dot is not exact).
        only_fp8 = fields["fp8_out_scale"] is not None and fields["kv_in_cache"] and fields["kv_cache_dtype"] != "auto"
        if "fp8_query" in features and fields["dtype"] in FP8_QUERY_COMPUTE_DTYPES \
                and (not only_fp8 or torch.bfloat16 in sizes.dtypes):
            key = dataclasses.replace(key, spec=key.spec.replace(fp8_query=rng.random() < 0.15))
        return key

    # -- cases within a key ---------------------------------------------------------------------------------
    def _case(self, rng: random.Random, key: CompileKey, seed: int) -> BatchSpec:
        sizes, base = self.sizes, key.spec
        bs, kv_in_cache = base.block_size, base.kv_in_cache
        max_q, max_c, max_seqs = sizes.max_query_len, sizes.max_context_len, sizes.max_seqs
        if sizes.full_length_heads and base.num_heads > sizes.full_length_heads:
            shrink = sizes.full_length_heads / base.num_heads
            max_q, max_c = max(2, round(max_q * shrink)), max(1, round(max_c * shrink))
            max_seqs = max(1, round(max_seqs * shrink))
        if rng.random() < 0.02:  # an empty batch (no sequences, or none with new tokens): nothing launched
            n = rng.randint(0, 2)
            return base.replace(query_lens=(0,) * n, context_lens=tuple(rng.randint(0, max_c) for _ in range(n)),
                                seed=seed)
        long = key.workload == "long"
        n = 1 if key.seqs_state == "1" else rng.randint(2, max(2, 2 if long else max_seqs))
        if long:
            qlens = [rng.randint(SHORT_WORKLOAD_TOKENS + 1, sizes.long_query_len) for _ in range(n)]
        elif sizes.engine:  # one engine step: decode rows, speculative rows (2-8 tokens) and prefill chunks
            qlens = [0 if r < 0.05 else 1 if r < 0.35 else rng.randint(2, min(8, max(2, max_q))) if r < 0.6
                     else rng.randint(2, max(2, max_q)) for r in (rng.random() for _ in range(n))]
        else:
            qlens = [0 if r < 0.12 else 1 if r < 0.35 else rng.randint(2, max(2, max_q))
                     for r in (rng.random() for _ in range(n))]
        qlens = self._fit_tokens(rng, qlens, key.tokens_state, max_q)
        clens = []
        for _ in qlens:
            r = rng.random()
            c = 0 if r < 0.3 else bs * rng.randint(1, max(1, max_c // bs)) if r < 0.4 else rng.randint(1, max_c)
            if key.width_state == "1":
                c = min(c, bs)  # every context inside one block
            clens.append(c)
        cached = [c + q for c, q in zip(clens, qlens)] if kv_in_cache else clens
        blocks = [-(-c // bs) for c in cached]
        width = max(blocks + [1])
        extra = 0
        if key.width_state == "n":
            extra = rng.choice([0, 0, 1, 3])
            while int_state(width + extra) != "n":
                extra += 1
        used = sum(blocks)
        spare = rng.randint(0, 3)
        while int_state(max(1, used + spare)) != key.blocks_state:
            spare += 1
        window = None
        if key.window:
            longest = max(q + c for q, c in zip(qlens, clens))
            if key.window_state == "1":
                window = 1
            elif key.window_state == "16":
                window = 16 * rng.randint(1, max(1, (longest + 15) // 16))
            else:
                window = rng.randint(2, longest + 8)
                window += window % 16 == 0
        return base.replace(
            query_lens=tuple(qlens), context_lens=tuple(clens), sliding_window=window,
            softcap=round(rng.choice([1.0, 5.0, 30.0, rng.uniform(0.5, 50.0)]), 3) if base.softcap else 0.0,
            sm_scale=None if rng.random() < 0.7 else round(rng.uniform(0.02, 1.0), 4),
            fp8_out_scale=round(rng.uniform(0.005, 0.2), 4) if base.fp8_out_scale is not None else None,
            start_loc_entries="B" if rng.random() < 0.3 else "B+1", spare_blocks=spare, extra_columns=extra,
            seed=seed, nan_unused_slots=seed % 2 == 1)  # not drawn: every other draw stays as it was

    @staticmethod
    def _fit_tokens(rng: random.Random, qlens: list[int], state: str, max_q: int) -> list[int]:
        """``qlens`` changed so that their sum has Triton specialisation ``state`` (and is not 0)."""
        if state == "1":
            out = [0] * len(qlens)
            out[rng.randrange(len(qlens))] = 1
            return out
        total = sum(qlens)
        i = rng.randrange(len(qlens))
        if state == "16":
            qlens[i] += (-total) % 16 or (16 if total == 0 else 0)
        elif int_state(total) != "n" or total == 0:
            qlens[i] += 2 if total == 0 else 1
        return qlens


# -- running --------------------------------------------------------------------------------------------------

@dataclass
class FuzzFailure:
    """One case whose output did not match the reference (or that raised)."""

    index: int
    spec: BatchSpec
    message: str
    rerun: str = ""

    def describe(self) -> str:
        return f"case {self.index} [{self.spec.describe()} seed={self.spec.seed}]: {self.message}"

    def one_line(self) -> str:
        """The failure on one line: case, first line of the error, and the command that reruns exactly it."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else "?"
        return f"FAIL case {self.index}: {first[:300]} | rerun: {self.rerun}"


@dataclass
class FuzzResult:
    """Counts of a fuzz run.

    Attributes:
        cases: cases run (each built, validated, run and compared).
        failures: the cases that did not match the reference, with their specs and reruns.
        unsupported: cases the backend refused with ``UnsupportedFeatureError`` (declared limits; not run).
        kernel_variants: distinct kernel specialisations the cases launched (:func:`kernel_variant_key`).
        compiled_kernels: kernels Triton compiled during the run on the device, where Triton's cache can be
            read (None in the interpreter, which compiles nothing).
        seconds: wall time of the run.
    """

    backend: str
    device: str
    seed: int
    cases: int = 0
    failures: list[FuzzFailure] = field(default_factory=list)
    unsupported: int = 0
    kernel_variants: int = 0
    compiled_kernels: Optional[int] = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        extra = f", {self.unsupported} unsupported" if self.unsupported else ""
        return f"fuzz: {self.cases} cases, {len(self.failures)} failures{extra}"

    def details(self) -> str:
        compiled = "" if self.compiled_kernels is None else f", {self.compiled_kernels} kernels compiled"
        return (f"backend={self.backend} device={self.device} seed={self.seed}: {self.kernel_variants} kernel "
                f"variants{compiled}, {self.seconds:.1f} s")


def _compiled_kernel_count(device: torch.device) -> Optional[int]:
    """Kernels in Triton's in-process cache for ``device`` (None where it cannot be read)."""
    if device.type == "cpu" or interpreter_enabled():
        return None
    try:
        from ..triton.kernel import prefix_prefill_kernel

        caches = prefix_prefill_kernel.device_caches
        index = device.index if device.index is not None else torch.cuda.current_device()
        return len(caches[index][0]) if index in caches else 0
    except Exception:  # another Triton version, or no Triton: the count is informative only
        return None


def _resolve_backend(backend: Union[str, Backend, None], device: torch.device) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend is None:
        return select_backend(device)
    return get_registry().get(backend)


def rerun_command(backend: str, device: torch.device, sizes: FuzzSizes, seed: int, index: int) -> str:
    """The command line that reruns exactly case ``index`` of a run."""
    interp = "TRITON_INTERPRET=1 " if device.type == "cpu" else ""
    return (f"{interp}python -m pagedprefill.testing.fuzz --backend {backend} --device {device} "
            f"{sizes.cli_args()} --seed {seed} --case {index}")


def run_case(backend: Backend, info: DeviceInfo, device: torch.device, spec: BatchSpec,
             tolerances: Optional[dict] = None, label: str = "fuzz") -> bool:
    """Build, validate, run and compare one case; False when the backend refused it as unsupported.

    Raises AssertionError (a mismatch) or whatever the backend raised.
    """
    problem = make_problem(spec, device)
    validate_problem(problem, "full")
    try:
        check_runnable(backend, problem, info)
    except UnsupportedFeatureError:
        return False
    backend.run(problem, info)
    atol, rtol = (tolerances or DEFAULT_TOLERANCES)[spec.dtype]
    assert_matches_reference(problem.out, problem, atol, rtol, label=label)
    return True


def run_fuzz(
    backend: Union[str, Backend, None] = None,
    device: Union[str, torch.device] = "cpu",
    cases: int = 200,
    seed: int = 0,
    sizes: Union[FuzzSizes, str, None] = None,
    progress: Optional[Callable[[int, FuzzResult], None]] = None,
    tolerances: Optional[dict] = None,
    max_failures: Optional[int] = None,
    only: Optional[list[int]] = None,
) -> FuzzResult:
    """Run ``cases`` random cases on ``backend`` (a name, an instance, or None for the selected one).

    Args:
        backend: the backend to fuzz; it is run directly, selection bypassed.
        device: where the problems live.
        cases: number of cases (cases 0 .. cases - 1 of the stream).
        seed: the seed of the case stream (:class:`FuzzGenerator`).
        sizes: a :class:`FuzzSizes`, ``"cpu"``, ``"gpu"``, or None for the device's default.
        progress: called as ``progress(done, result)`` after each case (see :class:`ProgressPrinter`).
        tolerances: ``{dtype: (atol, rtol)}``, default :data:`~pagedprefill.testing.DEFAULT_TOLERANCES`.
        max_failures: stop after that many failures (None: run every case).
        only: run just these case indices (a reproducer) instead of ``range(cases)``.

    Returns:
        A :class:`FuzzResult`; ``result.failures`` lists every failing case with the command that reruns it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if sizes is None:
        sizes = FuzzSizes.for_device(device)
    elif isinstance(sizes, str):
        sizes = FuzzSizes.preset(sizes)
    chosen = _resolve_backend(backend, device)
    info = DeviceInfo.detect(device)
    result = FuzzResult(backend=chosen.name, device=str(device), seed=seed)
    generator = FuzzGenerator(seed, sizes, chosen.supported_features)
    variants: set = set()
    compiled_before = _compiled_kernel_count(device)
    start = time.perf_counter()
    indices = list(only) if only is not None else range(cases)
    for done, index in enumerate(indices, 1):
        spec = generator.spec(index)
        variants.add(kernel_variant_key(spec))
        try:
            if not run_case(chosen, info, device, spec, tolerances, label=f"{chosen.name}/fuzz/{index}"):
                result.unsupported += 1
        except Exception as exc:  # a mismatch (AssertionError) or any error the backend raised
            message = f"{type(exc).__name__}: {exc}"
            result.failures.append(FuzzFailure(index, spec, message if len(message) < 2000 else message[:2000],
                                               rerun_command(chosen.name, device, sizes, seed, index)))
        result.cases += 1
        result.seconds = time.perf_counter() - start
        if progress is not None:
            progress(done, result)
        if max_failures is not None and len(result.failures) >= max_failures:
            break
    result.seconds = time.perf_counter() - start
    result.kernel_variants = len(variants - {None})
    compiled_after = _compiled_kernel_count(device)
    if compiled_before is not None and compiled_after is not None:
        result.compiled_kernels = compiled_after - compiled_before
    return result


@dataclass
class PrecompileResult:
    """What :func:`precompile` did: the compile keys whose kernels it compiled, in how many processes and how
    long, and the processes that failed (their cases are rerun by the fuzz itself, which reports why)."""

    keys: int = 0
    workers: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        failed = f", {len(self.failed)} processes failed: {'; '.join(self.failed)}" if self.failed else ""
        return (f"fuzz: compiled the kernels of {self.keys} compile keys in {self.workers} processes, "
                f"{self.seconds:.0f} s{failed}")


def first_case_of_each_key(seed: int, sizes: FuzzSizes, cases: int, features: frozenset = FEATURES) -> list[int]:
    """For each compile key of the menu, the first of cases ``0 .. cases - 1`` that launches a kernel (empty
    batches launch none): running these compiles every kernel the run will launch."""
    if sizes.keys is None:
        return []
    generator = FuzzGenerator(seed, sizes, features)
    first: dict[int, int] = {}
    for index in range(cases):
        key = index % sizes.keys
        if key not in first and kernel_variant_key(generator.spec(index)) is not None:
            first[key] = index
        if len(first) == sizes.keys:
            break
    return sorted(first.values())


def precompile(backend: str, device: Union[str, torch.device], sizes: FuzzSizes, seed: int, cases: int,
               workers: int, timeout_s: float = 600.0, features: frozenset = FEATURES) -> PrecompileResult:
    """Compile the kernels of a GPU run's compile keys in ``workers`` processes at once, before the run.

    Compiling is CPU-bound and single-threaded per kernel, and a fresh machine compiles every key's kernels
    (a few seconds each) in the run's first cases, one after the other. Each process here runs a share of
    :func:`first_case_of_each_key` through this module's command line; Triton writes what they compile to its
    on-disk cache, from which the run then loads it. The processes' own results are not used: the run checks
    those cases again. Nothing happens with a new key per case (``sizes.keys`` None) or no ``workers``; on the
    CPU (Triton's interpreter, which compiles nothing) it would only run the cases twice, so callers skip it there.

    Args:
        backend: the backend's registry name (the processes look it up again).
        device, sizes, seed, cases: those of the run that follows.
        workers: processes at once (each takes ``1 / workers`` of the keys).
        timeout_s: a process still running after this long is stopped (its keys compile in the run instead).
        features: the backend's ``supported_features``, as the run draws them.
    """
    device = torch.device(device)
    indices = first_case_of_each_key(seed, sizes, cases, features)
    workers = max(0, min(workers, len(indices)))
    result = PrecompileResult(keys=len(indices), workers=workers)
    if workers == 0:
        result.keys = 0
        return result
    start = time.perf_counter()
    command = [sys.executable, "-m", "pagedprefill.testing.fuzz", "--backend", backend, "--device", str(device),
               *sizes.cli_args().split(), "--seed", str(seed), "--every", "1e9"]
    processes = []
    for w in range(workers):
        share = indices[w::workers]
        args = command + [arg for index in share for arg in ("--case", str(index))]
        processes.append((share, subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                  env=os.environ.copy())))
    for share, process in processes:
        try:
            _, err = process.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            result.failed.append(f"cases {share}: stopped after {timeout_s:.0f} s")
            continue
        # Exit status 1 without a traceback is a mismatch, which the run reports with its reproducer.
        text = (err or b"").decode(errors="replace")
        if process.returncode not in (0, 1) or "Traceback" in text:
            last = text.strip().splitlines()[-1:] or ["?"]
            result.failed.append(f"cases {share}: exit status {process.returncode}: {last[0][:200]}")
    result.seconds = time.perf_counter() - start
    return result


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)``: share K of N, ``0 <= K < N``; a malformed value is a ``ValueError`` saying so."""
    shard, _, count = text.partition("/")
    try:
        k, n = int(shard), int(count)
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise ValueError(f"expected K/N with 0 <= K < N (share K of N processes, e.g. 0/4), got {text!r}")
    return k, n


def shard_cases(cases: int, shard: tuple[int, int]) -> list[int]:
    """The indices among cases ``0 .. cases - 1`` that share ``(K, N)`` runs: those equal to K modulo N."""
    k, n = shard
    return list(range(k, cases, n))


class ProgressPrinter:
    """A ``progress`` callback for :func:`run_fuzz`: a line at least every ``every_s`` seconds (and after the
    last case), and each failure's one-line reproducer as soon as it happens. ``write`` prints one line.

    Used as a context manager it also keeps the lines coming while one case takes longer than ``every_s`` (a
    kernel compiling, say): a background thread then says which case is running and for how long, or, while
    :attr:`activity` is set (``"compiling 24 compile keys' kernels in 6 processes"``), what is going on. When
    cases finished since the last line, its line is the ordinary progress line instead.
    """

    def __init__(self, total: int, write: Callable[[str], None] = None, every_s: float = 15.0):
        self.total = total
        self.write = write or (lambda line: print(line, flush=True))
        self.every_s = every_s
        self._last = time.perf_counter()
        self._started = self._last
        self._failures = 0
        self._done = 0
        self._done_at_line = 0
        self._result: Optional[FuzzResult] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: What is going on before the first case (shown by the heartbeat instead of the running case).
        self.activity = ""

    def _line(self, line: str, done: Optional[int] = None) -> None:
        with self._lock:
            self._last = time.perf_counter()
            if done is not None:
                self._done_at_line = done
            self.write(line)

    def _progress_line(self, done: int, result: FuzzResult) -> str:
        return (f"fuzz: {done}/{self.total} cases, {len(result.failures)} failures, "
                f"{result.unsupported} unsupported, {result.seconds:.0f} s")

    def __call__(self, done: int, result: FuzzResult) -> None:
        self._done, self._result = done, result
        for failure in result.failures[self._failures:]:
            self._line(failure.one_line())
        self._failures = len(result.failures)
        if time.perf_counter() - self._last >= self.every_s or done == self.total:
            self._line(self._progress_line(done, result), done)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every_s / 4):
            if time.perf_counter() - self._last >= self.every_s:
                elapsed = time.perf_counter() - self._started
                done, result = self._done, self._result
                if self.activity:
                    self._line(f"fuzz: {self.activity}, {elapsed:.0f} s")
                elif done > self._done_at_line and result is not None:  # cases are finishing: no case is stuck
                    self._line(self._progress_line(done, result), done)
                else:
                    self._line(f"fuzz: {self._done}/{self.total} cases, case {self._done} still running "
                               f"(compiling or computing), {elapsed:.0f} s")

    def __enter__(self) -> ProgressPrinter:
        self._started = self._last = time.perf_counter()
        self._thread = threading.Thread(target=self._heartbeat, name="fuzz-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# -- command line ---------------------------------------------------------------------------------------------

def default_compile_workers() -> int:
    """Processes for :func:`precompile`: half the CPU cores (the run's own process and the GPU's driver threads
    keep the rest), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedprefill.testing.fuzz",
                                     description="Fuzz a backend against the reference on random paged batches.")
    parser.add_argument("--backend", default=None, help="backend name (default: the one selected for the device)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--cases", type=int, default=2000, help="number of random cases (default 2000)")
    parser.add_argument("--case", type=int, action="append", default=None,
                        help="run only this case index (repeatable): what a failure's reproducer does")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case stream (default 0)")
    parser.add_argument("--mode", choices=("cpu", "gpu"), default=None,
                        help="size preset (default: cpu on the CPU, gpu on GPUs; see the module docs)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply token counts by this factor")
    parser.add_argument("--keys", type=int, default=None,
                        help="number of compile keys the cases cycle through (gpu default 24; 0 = a new key per case)")
    parser.add_argument("--engine", action="store_true",
                        help="every case the serving engine's call: k = v = None, pages of 16 and up, mixed rows")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between progress lines (default 15)")
    parser.add_argument("--compile-workers", type=int, default=None, metavar="N",
                        help="on a GPU, compile the compile keys' kernels in N processes before the run (default: "
                             "half the CPU cores, at most 8; 0: compile in the run)")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run share K of N of the cases (those whose index is K modulo N), for N processes "
                             "on one GPU")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the compile keys' kernels of the run (on a GPU) and stop, for the shards "
                             "that follow")
    args = parser.parse_args(argv)
    shard = None
    if args.shard is not None:
        if args.case:
            parser.error("--shard: a reproducer's --case runs exactly its cases; pass one or the other")
        try:
            shard = parse_shard(args.shard)
        except ValueError as exc:
            parser.error(f"--shard: {exc}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"fuzz: --device={device} but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    sizes = FuzzSizes.for_device(device) if args.mode is None else FuzzSizes.preset(args.mode)
    if args.keys is not None:
        sizes = dataclasses.replace(sizes, keys=args.keys or None)
    if args.engine:
        sizes = sizes.engine_mode()
    if args.scale != 1.0:
        if not (math.isfinite(args.scale) and args.scale > 0):
            parser.error(f"--scale: expected a positive number, got {args.scale}")
        sizes = sizes.scaled(args.scale)
    backend = _resolve_backend(args.backend, device)
    reasons = backend.supports(DeviceInfo.detect(device))
    if reasons:
        print(f"fuzz: backend {backend.name!r} cannot run on {device}: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    only = args.case or (shard_cases(args.cases, shard) if shard else None)
    total = 0 if args.compile_only else len(only) if only is not None else args.cases
    share = f" shard={args.shard} of cases={args.cases}" if shard else ""
    print(f"fuzz: backend={backend.name} device={device} cases={total}{share} seed={args.seed} sizes={sizes}",
          flush=True)
    with ProgressPrinter(total, every_s=args.every) as printer:
        if not args.case and device.type != "cpu":  # a reproducer runs its cases only; the CPU compiles nothing
            workers = default_compile_workers() if args.compile_workers is None else args.compile_workers
            printer.activity = f"compiling the compile keys' kernels in {workers} processes"
            warm = precompile(backend.name, device, sizes, args.seed, args.cases, workers,
                              features=backend.supported_features)
            printer.activity = ""
            if warm.keys:
                print(warm.summary(), flush=True)
        if args.compile_only:
            return 0
        result = run_fuzz(backend, device, args.cases, args.seed, sizes, progress=printer, only=only)
    for failure in result.failures:
        print(f"FAIL {failure.describe()}", flush=True)
    print(result.details())
    print(result.summary())
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
