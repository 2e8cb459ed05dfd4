"""The conformance plugin runs the random sweep's parts first, interleaved across suites."""


pytest_plugins = ["pytester"]


def test_sweep_parts_are_collected_first_and_interleaved(pytester):
    pytester.makepyfile(
        test_suites="""
        from pagedprefill.testing import ConformanceSuite

        class TestA(ConformanceSuite):
            backend = "reference"

        class TestB(ConformanceSuite):
            backend = "reference"

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", "--pagedprefill-device=cpu")
    ids = [line for line in result.outlines if "::" in line]
    sweeps = [i for i, line in enumerate(ids) if "test_random_sweep" in line]
    assert sweeps and sweeps == list(range(len(sweeps))), "the sweep parts come first"
    first_parts = [ids[i].split("::")[1] + ids[i][ids[i].index("["):] for i in sweeps[:4]]
    assert first_parts == ["TestA[0]", "TestB[0]", "TestA[1]", "TestB[1]"]
    assert ids[-1].endswith("::test_plain"), "the other tests keep their order, after the sweeps"


def worksteal_runs(items: list, workers: int) -> list:
    """Each worker's initial run of ``items`` under ``--dist worksteal`` (even contiguous runs)."""
    runs, start, left = [], 0, len(items)
    for i in range(workers):
        size = left // (workers - i)
        runs.append(items[start:start + size])
        start, left = start + size, left - size
    return runs


def test_sweep_parts_head_each_workers_initial_run():
    """Under pytest-xdist each worker starts on a sweep part (two where there are more parts than workers), in
    both distribution modes, and nothing is lost or reordered."""
    from pagedprefill.testing.plugin import spread_first

    parts = [f"part{i}" for i in range(16)]
    rest = [f"test{i}" for i in range(355)]
    for workers in (2, 12, 14, 16):
        out = spread_first(parts, rest, workers, "worksteal")
        assert sorted(out) == sorted(parts + rest) and [x for x in out if x in rest] == rest
        for run in worksteal_runs(out, workers):
            kinds = [x.startswith("part") for x in run]
            # Each run starts with its share of the parts, and no part waits behind a worker's other tests.
            assert kinds[0] and kinds == sorted(kinds, reverse=True), (workers, run[:3])
            assert sum(kinds) <= -(-len(parts) // workers), (workers, run[:3])
    for workers in (2, 16):
        out = spread_first(parts, rest, workers, "load")
        run = max(len(out) // workers // 4, 2)
        assert all(out[i * run].startswith("part") for i in range(workers)), workers
    assert spread_first(parts, rest, 1) == parts + rest  # one process: the parts first


def test_sweep_parts_start_every_xdist_worker(pytester):
    """A live run with two workers under ``--dist worksteal``: each worker's first test is a sweep part, after
    ``-k`` deselection."""
    import pytest

    pytest.importorskip("xdist", reason="pytest-xdist is not installed: the live run needs its workers")
    pytester.makepyfile(
        test_suites="""
        import pytest
        from pagedprefill.testing import ConformanceSuite

        class TestA(ConformanceSuite):
            backend = "reference"

        @pytest.mark.parametrize("n", range(40))
        def test_plain(n):
            pass
        """
    )
    result = pytester.runpytest("-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal",
                                "-k", "random_sweep or plain", "--pagedprefill-device=cpu", "--pagedprefill-sweep=2")
    result.assert_outcomes(passed=42, skipped=6)
    first = {}
    for line in result.outlines:
        if line.startswith("[gw") and ("PASSED" in line or "SKIPPED" in line):
            first.setdefault(line.split("]")[0], line)
    assert len(first) == 2 and all("test_random_sweep" in line for line in first.values()), first
