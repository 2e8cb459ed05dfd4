"""Fuzzing the selected backend against the reference on the GPU: ``--pagedprefill-fuzz`` random cases (default
2000) over the full ranges, with at most ``FuzzSizes.gpu().max_variants`` kernel specialisations (see
:mod:`pagedprefill.testing.fuzz`)."""

from __future__ import annotations

import time

from pagedprefill.testing.fuzz import FuzzSizes, run_fuzz


def test_fuzz_matches_reference(gpu, gpu_backend, pagedprefill_fuzz):
    sizes = FuzzSizes.gpu()
    start = time.perf_counter()

    def progress(done, result):
        if done % 250 == 0:
            print(f"fuzz: {done}/{pagedprefill_fuzz} cases, {len(result.failures)} failures, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)

    result = run_fuzz(gpu_backend, gpu, cases=pagedprefill_fuzz, seed=0, sizes=sizes, progress=progress)
    print(f"\n{result.details()}\n{result.summary()}")
    assert result.cases == pagedprefill_fuzz
    assert not result.failures, "\n".join(f.describe() for f in result.failures[:20])
    assert result.kernel_variants <= sizes.max_variants
    if result.compiled_kernels is not None:  # what Triton compiled: no more than the specialisations counted
        assert result.compiled_kernels <= result.kernel_variants, result.details()
