"""Fuzzing the selected backend against the reference on the GPU: ``--pagedprefill-fuzz`` random cases (default
2000) drawn from a menu of ``FuzzSizes.gpu().keys`` compile keys, so the run compiles at most that many kernels
(see :mod:`pagedprefill.testing.fuzz`). Those kernels are compiled first, side by side in several processes
(:func:`~pagedprefill.testing.fuzz.precompile`), and the run loads them from Triton's on-disk cache.

A progress line reaches the terminal at least every 15 s without ``-s``; each failure prints at once a one-line
command that reruns exactly that case::

    pytest packages/core/tests/gpu/test_fuzz_gpu.py --pagedprefill-device=cuda --pagedprefill-fuzz=2000

``--pagedprefill-fuzz-engine=N`` adds N cases of the serving engine's call (``FuzzSizes.engine``: k = v = None on
pages of 16 and up, batches of decode, speculative and chunk rows; on GPUs the small batches split their keys).
"""

from __future__ import annotations

import pytest
from pagedprefill.testing.fuzz import FuzzSizes, ProgressPrinter, default_compile_workers, precompile, run_fuzz


def test_fuzz_matches_reference(gpu, gpu_backend, pagedprefill_fuzz, terminal_line):
    fuzz(gpu, gpu_backend, FuzzSizes.gpu(), pagedprefill_fuzz, terminal_line)


def test_engine_fuzz_matches_reference(gpu, gpu_backend, pagedprefill_fuzz_engine, terminal_line):
    if not pagedprefill_fuzz_engine:
        pytest.skip("the engine's fuzz runs when asked for: --pagedprefill-fuzz-engine=N (e.g. 5000)")
    fuzz(gpu, gpu_backend, FuzzSizes.gpu().engine_mode(), pagedprefill_fuzz_engine, terminal_line)


def fuzz(gpu, gpu_backend, sizes: FuzzSizes, pagedprefill_fuzz: int, terminal_line) -> None:
    """``pagedprefill_fuzz`` cases of ``sizes`` on the selected backend, its kernels compiled first."""
    terminal_line(f"fuzz: backend={gpu_backend.name} device={gpu} cases={pagedprefill_fuzz} seed=0, "
                  f"{sizes.keys} compile keys")
    workers = default_compile_workers()
    with ProgressPrinter(pagedprefill_fuzz, terminal_line) as printer:  # lines even during long compiles
        printer.activity = f"compiling the compile keys' kernels in {workers} processes"
        warm = precompile(gpu_backend.name, gpu, sizes, 0, pagedprefill_fuzz, workers,
                          features=gpu_backend.supported_features)
        printer.activity = ""
        terminal_line(warm.summary())
        result = run_fuzz(gpu_backend, gpu, cases=pagedprefill_fuzz, seed=0, sizes=sizes, progress=printer)
    terminal_line(f"{result.details()}\n{result.summary()}\nwith the compiles: {warm.seconds + result.seconds:.0f} s")
    assert result.cases == pagedprefill_fuzz
    assert not result.failures, "\n".join(f.one_line() for f in result.failures[:20])
    assert result.kernel_variants <= sizes.keys
    if result.compiled_kernels is not None:  # what Triton compiled: no more than the keys drawn
        assert result.compiled_kernels <= result.kernel_variants, result.details()
