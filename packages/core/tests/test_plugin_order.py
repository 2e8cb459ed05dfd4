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
