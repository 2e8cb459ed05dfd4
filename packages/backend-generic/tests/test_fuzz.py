"""Fuzzing the generic backend against the reference in Triton's CPU interpreter (tiny random batches over the
full ranges: see :mod:`pagedprefill.testing.fuzz`). The GPU fuzz runs in ``packages/core/tests/gpu``."""

import pytest
from pagedprefill import DeviceInfo, get_registry
from pagedprefill.backends.reference import ReferenceBackend
from pagedprefill.testing.fuzz import GPU_HEAD_SIZES, FuzzGenerator, FuzzSizes, kernel_variant_key, run_fuzz

#: Cases of the CPU run: about 70 s on two cores (the interpreter's cost grows with heads times tokens).
CPU_CASES = 220


def test_fuzz_matches_reference_in_the_interpreter(pagedprefill_device):
    if pagedprefill_device.type != "cpu":
        pytest.skip("the CPU fuzz runs in Triton's interpreter; on GPUs: pytest packages/core/tests/gpu "
                    "(nox -s production) or python -m pagedprefill.testing.fuzz --backend generic --device cuda")
    reasons = get_registry().get("generic").supports(DeviceInfo.detect(pagedprefill_device))
    if reasons:
        pytest.skip(f"the generic backend cannot run on the CPU here: {'; '.join(reasons)}")
    result = run_fuzz("generic", pagedprefill_device, cases=CPU_CASES, seed=0, sizes=FuzzSizes.cpu())
    print(f"\n{result.details()}\n{result.summary()}")
    assert result.cases == CPU_CASES
    assert result.unsupported == 0
    assert result.kernel_variants > CPU_CASES // 2  # nearly every case is a new shape/feature combination
    assert not result.failures, "\n".join(f.describe() for f in result.failures)


def test_fuzz_streams_cover_the_ranges_and_bound_gpu_specialisations():
    """The case streams themselves (no kernel runs): reproducible from the seed, reaching the ends of every range,
    and the GPU stream launching at most ``max_variants`` kernel specialisations however long it runs."""
    for sizes, n in ((FuzzSizes.cpu(), 1500), (FuzzSizes.gpu(), 3000)):
        generator = FuzzGenerator(7, sizes)
        specs = [generator.next_spec() for _ in range(n)]
        assert specs == [s for s, _ in zip(FuzzGenerator(7, sizes), range(n))]
        qlens = {q for s in specs for q in s.query_lens}
        clens = {c for s in specs for c in s.context_lens}
        assert {0, 1} <= qlens and 0 in clens
        assert any(not s.query_lens for s in specs)  # empty batches
        assert {1, 544} <= {s.block_size for s in specs}
        assert {1, 256} <= {s.head_size for s in specs}
        assert {1, 64} <= {s.num_heads // s.num_kv_heads for s in specs}
        assert max(s.num_heads for s in specs) <= sizes.max_heads
        assert 1 in {s.sliding_window for s in specs}
        assert {"fp8_e4m3", "fp8_e5m2", "auto"} == {s.kv_cache_dtype for s in specs}
        assert {"nhd", "split"} == {s.layout for s in specs}
        assert set(sizes.dtypes) == {s.dtype for s in specs}
        for flag in ("alibi", "sinks", "scale_as_tensor"):
            assert {True, False} == {getattr(s, flag) for s in specs}, flag
        assert any(s.softcap for s in specs) and any(s.sm_scale for s in specs)
        assert {"B", "B+1"} == {s.start_loc_entries for s in specs}
        variants = {kernel_variant_key(s) for s in specs} - {None}
        if sizes.max_variants is None:
            assert len(variants) > n // 2
        else:
            assert len(variants) <= sizes.max_variants
            assert {s.head_size for s in specs} <= set(GPU_HEAD_SIZES)
        print(f"{n} specs: {len(variants)} kernel variants, {len({s.head_size for s in specs})} head sizes, "
              f"{len({s.block_size for s in specs})} block sizes")


class _OffByALittle(ReferenceBackend):
    """The reference with every written element moved by 0.05: the fuzz must report each case it wrote."""

    name = "off_by_a_little"

    def run(self, problem, device):
        super().run(problem, device)
        problem.out.add_(0.05)


def test_fuzz_reports_every_wrong_case():
    n = 40
    result = run_fuzz(_OffByALittle(), "cpu", cases=n, seed=3, sizes=FuzzSizes.cpu())
    generator = FuzzGenerator(3, FuzzSizes.cpu())
    with_tokens = [i for i in range(n) if sum(generator.next_spec().query_lens) > 0]
    assert result.cases == n
    assert [f.index for f in result.failures] == with_tokens
    assert all("seed=" in f.describe() and "Tensor-likes are not close" in f.message for f in result.failures)
    assert result.summary() == f"fuzz: {n} cases, {len(with_tokens)} failures"
