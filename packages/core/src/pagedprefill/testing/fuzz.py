"""Fuzzing a backend against the reference: seeded random batches over the full ranges of the interface.

Each case is a random :class:`~pagedprefill.testing.BatchSpec`: ragged query lengths (0 and 1 included),
context lengths (0 included), block sizes 1..544, head sizes 1..256, GQA ratios 1..64
(``num_heads = num_kv_heads * ratio``), sliding windows (1 included), ALiBi, softcap, sinks, ``sm_scale``,
FP8 e4m3/e5m2 caches with float or tensor scales, both cache layouts, ``b_start_loc`` with ``B`` or ``B + 1``
entries, empty batches, fp16/fp32 and, on GPUs, bf16. :func:`run_fuzz` builds each problem with
:func:`~pagedprefill.testing.make_problem`, checks it with ``validate_problem(problem, "full")``, runs the
backend directly (selection bypassed, as :class:`~pagedprefill.testing.ConformanceSuite` does) and compares
the output with the reference (:func:`~pagedprefill.testing.assert_matches_reference`).

Two modes, chosen by :class:`FuzzSizes`:

* ``FuzzSizes.cpu()`` (the default on the CPU, for Triton's interpreter): tiny token counts, any head size
  1..256, any block size 1..544, at most 64 query heads. Every case may be a new kernel specialisation,
  which costs nothing in the interpreter.
* ``FuzzSizes.gpu()`` (the default on GPUs): longer sequences, and a bounded number of kernel
  specialisations, since each one is compiled (seconds each). Head sizes come from
  :data:`GPU_HEAD_SIZES` = {1, 24, 64, 80, 128, 256}, and the generator tracks the specialisation each case
  launches (:func:`kernel_variant_key`: the kernel's constexprs, the tile the policy picks for the workload
  class, and Triton's integer specialisation of the extents, i.e. whether a value is 1 or a multiple of 16).
  Once ``max_variants`` (56 by default) distinct ones have been drawn, later cases reuse the compiled ones:
  new lengths, data, block tables, scales and ``sm_scale`` within an already drawn feature combination. So a
  GPU run compiles fewer than ~60 kernels however many cases it runs (``FuzzResult.compiled_kernels`` counts
  what Triton actually compiled, where it can be read).

Token counts scale with :meth:`FuzzSizes.scaled` (``--scale`` on the command line)::

    python -m pagedprefill.testing.fuzz --backend generic --device cuda --cases 2000 --seed 0
    TRITON_INTERPRET=1 python -m pagedprefill.testing.fuzz --backend generic --device cpu --cases 300

prints progress every ``--every`` cases and a final line ``fuzz: N cases, F failures`` (exit status 1 when
F > 0). Every failure is printed with its spec, whose ``seed`` rebuilds the exact problem.

This module does not need pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from ..api import get_registry, select_backend
from ..device import DeviceInfo, interpreter_enabled
from ..registry import Backend, UnsupportedFeatureError
from ..validation import validate_problem
from ..workloads import BatchSpec, make_problem
from .cases import DEFAULT_TOLERANCES, assert_matches_reference

#: Head sizes of the GPU mode (each one is a kernel specialisation).
GPU_HEAD_SIZES = (1, 24, 64, 80, 128, 256)
#: Block sizes drawn often (engine defaults); others are drawn uniformly from 1..544.
COMMON_BLOCK_SIZES = (1, 2, 8, 16, 32, 64, 128, 256, 544)
COMMON_HEAD_SIZES = (1, 8, 16, 24, 32, 40, 64, 72, 80, 96, 112, 128, 160, 192, 256)
MAX_BLOCK_SIZE = 544
MAX_HEAD_SIZE = 256
MAX_GQA_RATIO = 64


@dataclass(frozen=True)
class FuzzSizes:
    """Ranges of the random batches and the GPU mode's bound on kernel specialisations.

    Attributes:
        max_seqs: sequences per batch (0..max_seqs; an empty batch is drawn now and then).
        max_query_len, max_context_len: new and cached tokens per sequence.
        max_kv_heads: KV heads (1..max_kv_heads); the GQA ratio is drawn from 1..64 and capped so that
            ``num_heads <= max_heads``.
        max_heads: query heads.
        head_sizes: head sizes to draw from; None draws from all of 1..256.
        dtypes: query dtypes.
        full_length_heads: None, or a head count above which the token and sequence ranges shrink in
            proportion (``num_heads = 4 * full_length_heads`` draws a quarter of them): keeps the interpreter's
            cost per case, which grows with heads times tokens, about flat across GQA ratios.
        max_variants: None (no bound: the CPU interpreter compiles nothing) or the number of distinct kernel
            specialisations the cases may launch (see :func:`kernel_variant_key`).
    """

    max_seqs: int = 3
    max_query_len: int = 8
    max_context_len: int = 32
    max_kv_heads: int = 2
    max_heads: int = 64
    head_sizes: Optional[tuple[int, ...]] = None
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.float32)
    full_length_heads: Optional[int] = 4
    max_variants: Optional[int] = None

    @classmethod
    def cpu(cls) -> FuzzSizes:
        """Tiny batches for Triton's CPU interpreter, every head and block size."""
        return cls()

    @classmethod
    def gpu(cls) -> FuzzSizes:
        """Larger batches, bf16 too, head sizes from :data:`GPU_HEAD_SIZES`, at most 56 specialisations."""
        return cls(max_seqs=6, max_query_len=160, max_context_len=700, max_kv_heads=4, max_heads=128,
                   head_sizes=GPU_HEAD_SIZES, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                   full_length_heads=None, max_variants=56)

    @classmethod
    def for_device(cls, device: Union[str, torch.device]) -> FuzzSizes:
        return cls.cpu() if torch.device(device).type == "cpu" else cls.gpu()

    def scaled(self, factor: float) -> FuzzSizes:
        """The same ranges with token counts multiplied by ``factor`` (at least 1 token each)."""
        return dataclasses.replace(self, max_query_len=max(1, round(self.max_query_len * factor)),
                                   max_context_len=max(1, round(self.max_context_len * factor)))


def _int_state(value: int) -> str:
    """How Triton specialises an integer argument: equal to 1, a multiple of 16, or neither."""
    return "1" if value == 1 else ("16" if value % 16 == 0 else "n")


def kernel_variant_key(spec: BatchSpec) -> Optional[tuple]:
    """What decides which compiled kernel a backend launches for ``spec`` (None: nothing is launched).

    The constexprs (head size, dtypes, layout, features, GQA group), the block size and head counts (which fix
    every stride), Triton's integer specialisation (1 / multiple of 16 / other) of the extents that vary with
    the lengths (sequences, tokens, cache blocks, block-table width, window), and the workload class that
    tiling policies key their tiles on (see :attr:`pagedprefill.ProblemShape.workload`).
    """
    qlens, clens = list(spec.query_lens), list(spec.context_lens)
    B, T = len(qlens), sum(qlens)
    if B == 0 or T == 0:
        return None
    bs = spec.block_size
    blocks = [-(-c // bs) for c in clens]
    num_blocks = max(1, sum(blocks) + spec.spare_blocks)
    width = max(blocks + [1])
    mean = T / B
    workload = "short" if min(mean, max(qlens)) <= 256 else "long"
    fp8 = spec.kv_cache_dtype != "auto"
    window = spec.sliding_window or 0
    return (spec.num_heads, spec.num_kv_heads, spec.head_size, bs, str(spec.dtype), spec.kv_cache_dtype,
            spec.layout, spec.alibi, spec.softcap > 0, spec.sinks, fp8 and spec.scale_as_tensor,
            _int_state(window) if window else None, _int_state(B), _int_state(T), _int_state(num_blocks),
            _int_state(width), workload)


#: The first feature combinations of every stream reach the ends of the ranges (then the draws are free).
_FIRST_PROFILES = (
    {"num_kv_heads": 1, "num_heads": MAX_GQA_RATIO},
    {"block_size": MAX_BLOCK_SIZE},
    {"block_size": 1},
    {"head_size": MAX_HEAD_SIZE, "dtype": torch.float32},
    {"head_size": 1},
)

#: Fields of a BatchSpec that select a kernel specialisation (everything else varies freely within one).
_PROFILE_FIELDS = ("num_heads", "num_kv_heads", "head_size", "block_size", "dtype", "kv_cache_dtype", "layout",
                   "alibi", "softcap", "sinks", "scale_as_tensor")


class FuzzGenerator:
    """Seeded stream of random :class:`BatchSpec` s; the same ``(seed, sizes)`` always gives the same stream.

    With ``sizes.max_variants`` set, at most that many distinct :func:`kernel_variant_key` s are drawn (the
    GPU mode); later cases redraw lengths within already drawn feature combinations until their key is one
    that was launched before.
    """

    def __init__(self, seed: int = 0, sizes: Optional[FuzzSizes] = None):
        self.seed = seed
        self.sizes = sizes or FuzzSizes.cpu()
        self.rng = random.Random(seed)
        self.index = 0
        self.variants: set = set()
        self._profiles: list[dict] = []
        self._drawn_profiles = 0

    def __iter__(self):
        return self

    def __next__(self) -> BatchSpec:
        return self.next_spec()

    # -- drawing -------------------------------------------------------------------------------------------
    def _head_size(self) -> int:
        rng, choices = self.rng, self.sizes.head_sizes
        if choices:
            return rng.choice(choices)
        return rng.choice(COMMON_HEAD_SIZES) if rng.random() < 0.5 else rng.randint(1, MAX_HEAD_SIZE)

    def _block_size(self) -> int:
        rng = self.rng
        r = rng.random()
        if r < 0.35:
            return rng.choice(COMMON_BLOCK_SIZES)
        if r < 0.7:
            return rng.randint(1, 12)
        return rng.randint(1, MAX_BLOCK_SIZE)

    def _profile(self) -> dict:
        """The fields that select a kernel specialisation."""
        rng, sizes = self.rng, self.sizes
        hkv = rng.randint(1, sizes.max_kv_heads)
        cap = max(1, min(MAX_GQA_RATIO, sizes.max_heads // hkv))
        r = rng.random()
        if r < 0.8:  # the common ratios; large groups are rarer (their cost grows with the heads)
            ratio = rng.choice([x for x in (1, 2, 3, 4) if x <= cap] or [1])
        elif r < 0.88:
            ratio = min(8, cap)
        elif r < 0.92:
            ratio = cap  # the largest group that fits (64 with one KV head)
        else:
            ratio = rng.randint(1, cap)
        kv = rng.choice(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])
        profile = dict(
            num_heads=hkv * ratio, num_kv_heads=hkv, head_size=self._head_size(), block_size=self._block_size(),
            dtype=rng.choice(list(sizes.dtypes)), kv_cache_dtype=kv, layout=rng.choice(["nhd", "split"]),
            alibi=rng.random() < 0.25,
            softcap=rng.choice([1.0, 5.0, 30.0, round(rng.uniform(0.5, 50.0), 3)]) if rng.random() < 0.2 else 0.0,
            sinks=rng.random() < 0.25,
            scale_as_tensor=kv != "auto" and rng.random() < 0.5,
            sliding_window=rng.random() < 0.4,  # on/off here; the value is drawn with the lengths
        )
        if self._drawn_profiles < len(_FIRST_PROFILES):
            forced = _FIRST_PROFILES[self._drawn_profiles]
            if forced.get("num_heads", 0) <= sizes.max_heads and forced.get("dtype", sizes.dtypes[0]) in sizes.dtypes:
                if not sizes.head_sizes or forced.get("head_size", sizes.head_sizes[0]) in sizes.head_sizes:
                    profile.update(forced)
        self._drawn_profiles += 1
        return profile

    def _lengths(self, profile: dict, seed: int) -> BatchSpec:
        """A spec of ``profile`` with random lengths, window value, ``sm_scale`` and metadata form."""
        rng, sizes = self.rng, self.sizes
        bs = profile["block_size"]
        max_q, max_c = sizes.max_query_len, sizes.max_context_len
        if sizes.full_length_heads and profile["num_heads"] > sizes.full_length_heads:
            shrink = sizes.full_length_heads / profile["num_heads"]
            max_q, max_c = max(2, round(max_q * shrink)), max(1, round(max_c * shrink))
            max_seqs = max(1, round(sizes.max_seqs * shrink))
        else:
            max_seqs = sizes.max_seqs
        n = 0 if rng.random() < 0.02 else rng.randint(1, max_seqs)
        qlens, clens = [], []
        for _ in range(n):
            r = rng.random()
            qlens.append(0 if r < 0.12 else 1 if r < 0.35 else rng.randint(2, max(2, max_q)))
            r = rng.random()
            if r < 0.3:
                clens.append(0)
            elif r < 0.4 and bs <= max_c:  # exactly whole blocks
                clens.append(bs * rng.randint(1, max_c // bs))
            else:
                clens.append(rng.randint(1, max_c))
        window = None
        if profile["sliding_window"]:
            longest = max((q + c for q, c in zip(qlens, clens)), default=1)
            window = 1 if rng.random() < 0.2 else rng.randint(1, longest + 8)
        spare = rng.randint(0, 3)
        if sizes.max_variants is not None:  # keep the cache extent from adding specialisations
            used = sum(-(-c // bs) for c in clens)
            spare = next((s for s in (1, 2, 3) if (used + s) % 16 and used + s != 1), 1)
        fields = {k: v for k, v in profile.items() if k != "sliding_window"}
        return BatchSpec(
            query_lens=tuple(qlens), context_lens=tuple(clens), sliding_window=window,
            sm_scale=None if rng.random() < 0.7 else round(rng.uniform(0.02, 1.0), 4),
            start_loc_entries="B" if rng.random() < 0.3 else "B+1", spare_blocks=spare, seed=seed, **fields)

    def next_spec(self) -> BatchSpec:
        """The next case's spec."""
        seed = self.seed * 1_000_003 + self.index
        self.index += 1
        budget = self.sizes.max_variants
        if budget is None:
            return self._lengths(self._profile(), seed)
        full = len(self.variants) >= budget
        if not self._profiles or (not full and self.rng.random() < 0.5):
            profile = self._profile()
        else:
            profile = self.rng.choice(self._profiles)
        spec = None
        for attempt in range(200):
            spec = self._lengths(profile, seed)
            key = kernel_variant_key(spec)
            if key is None or key in self.variants or len(self.variants) < budget:
                break
            if attempt % 10 == 9 and self._profiles:
                profile = self.rng.choice(self._profiles)
        key = kernel_variant_key(spec)
        if key is not None:
            self.variants.add(key)
            if profile not in self._profiles:
                self._profiles.append(profile)
        return spec


# -- running --------------------------------------------------------------------------------------------------

@dataclass
class FuzzFailure:
    """One case whose output did not match the reference (or that raised)."""

    index: int
    spec: BatchSpec
    message: str

    def describe(self) -> str:
        return f"case {self.index} [{self.spec.describe()} seed={self.spec.seed}]: {self.message}"


@dataclass
class FuzzResult:
    """Counts of a fuzz run.

    Attributes:
        cases: cases run (each built, validated, run and compared).
        failures: the cases that did not match the reference, with their specs.
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


def run_fuzz(
    backend: Union[str, Backend, None] = None,
    device: Union[str, torch.device] = "cpu",
    cases: int = 200,
    seed: int = 0,
    sizes: Union[FuzzSizes, str, None] = None,
    progress: Optional[Callable[[int, FuzzResult], None]] = None,
    tolerances: Optional[dict] = None,
    max_failures: Optional[int] = None,
) -> FuzzResult:
    """Run ``cases`` random cases on ``backend`` (a name, an instance, or None for the selected one).

    Args:
        backend: the backend to fuzz; it is run directly, selection bypassed.
        device: where the problems live.
        cases: number of cases.
        seed: the seed of the case stream (:class:`FuzzGenerator`).
        sizes: a :class:`FuzzSizes`, ``"cpu"``, ``"gpu"``, or None for the device's default.
        progress: called as ``progress(done, result)`` after each case.
        tolerances: ``{dtype: (atol, rtol)}``, default :data:`~pagedprefill.testing.DEFAULT_TOLERANCES`.
        max_failures: stop after that many failures (None: run every case).

    Returns:
        A :class:`FuzzResult`; ``result.failures`` lists every failing case with its spec.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if sizes is None or isinstance(sizes, str):
        sizes = {None: FuzzSizes.for_device(device), "cpu": FuzzSizes.cpu(), "gpu": FuzzSizes.gpu()}[sizes]
    chosen = _resolve_backend(backend, device)
    info = DeviceInfo.detect(device)
    tolerances = tolerances or DEFAULT_TOLERANCES
    result = FuzzResult(backend=chosen.name, device=str(device), seed=seed)
    generator = FuzzGenerator(seed, sizes)
    variants: set = set()
    compiled_before = _compiled_kernel_count(device)
    start = time.perf_counter()
    for index in range(cases):
        spec = generator.next_spec()
        variants.add(kernel_variant_key(spec))
        try:
            problem = make_problem(spec, device)
            validate_problem(problem, "full")
            try:
                chosen.check_problem(problem, info)
            except UnsupportedFeatureError:
                result.unsupported += 1
                result.cases += 1
                continue
            chosen.run(problem, info)
            atol, rtol = tolerances[spec.dtype]
            assert_matches_reference(problem.out, problem, atol, rtol, label=f"{chosen.name}/fuzz/{index}")
        except Exception as exc:  # a mismatch (AssertionError) or any error the backend raised
            message = f"{type(exc).__name__}: {exc}"
            result.failures.append(FuzzFailure(index, spec, message if len(message) < 2000 else message[:2000]))
        result.cases += 1
        if progress is not None:
            progress(index + 1, result)
        if max_failures is not None and len(result.failures) >= max_failures:
            break
    result.seconds = time.perf_counter() - start
    result.kernel_variants = len(variants - {None})
    compiled_after = _compiled_kernel_count(device)
    if compiled_before is not None and compiled_after is not None:
        result.compiled_kernels = compiled_after - compiled_before
    return result


# -- command line ---------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedprefill.testing.fuzz",
                                     description="Fuzz a backend against the reference on random paged batches.")
    parser.add_argument("--backend", default=None, help="backend name (default: the one selected for the device)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--cases", type=int, default=2000, help="number of random cases (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case stream (default 0)")
    parser.add_argument("--mode", choices=("cpu", "gpu"), default=None,
                        help="size preset (default: cpu on the CPU, gpu on GPUs; see the module docs)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply token counts by this factor")
    parser.add_argument("--max-variants", type=int, default=None,
                        help="bound on kernel specialisations (gpu mode default 56; 0 = no bound)")
    parser.add_argument("--every", type=int, default=100, help="print progress every N cases (default 100)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"fuzz: --device={device} but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    sizes = FuzzSizes.for_device(device) if args.mode is None else getattr(FuzzSizes, args.mode)()
    if args.max_variants is not None:
        sizes = dataclasses.replace(sizes, max_variants=args.max_variants or None)
    if args.scale != 1.0:
        if not (math.isfinite(args.scale) and args.scale > 0):
            parser.error(f"--scale: expected a positive number, got {args.scale}")
        sizes = sizes.scaled(args.scale)
    backend = _resolve_backend(args.backend, device)
    reasons = backend.supports(DeviceInfo.detect(device))
    if reasons:
        print(f"fuzz: backend {backend.name!r} cannot run on {device}: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    print(f"fuzz: backend={backend.name} device={device} cases={args.cases} seed={args.seed} sizes={sizes}",
          flush=True)
    start = time.perf_counter()

    def report(done: int, result: FuzzResult) -> None:
        if args.every > 0 and (done % args.every == 0 or done == args.cases):
            print(f"fuzz: {done}/{args.cases} cases, {len(result.failures)} failures, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)

    result = run_fuzz(backend, device, args.cases, args.seed, sizes, progress=report)
    for failure in result.failures:
        print(f"FAIL {failure.describe()}", flush=True)
    print(result.details())
    print(result.summary())
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
