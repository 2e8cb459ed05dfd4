"""What the backends' conformance suites run in Triton's interpreter, with and without the runs they share.

Loads each conformance suite of this repository's backends (``packages/backend-*/tests/test_*conformance.py``)
and, without running a kernel, lists what each case of the shared tests launches: the batch, the kernel and the
tile as the interpreter runs it. Without sharing every suite runs all of its cases; with it, a case is run by
one suite only, the first of ``SHARED_SUITES`` that runs it that way (``ConformanceSuite.shared_owner``). The
check: the (case, kernel, tile) combinations run are the same both ways, and only the smoke cases run twice.

    python ci/interpreter_runs.py            # the table, and exit status 1 if a combination is lost
    python ci/interpreter_runs.py --skipped  # also each case a suite leaves to another, and to which
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the suites decide as in the interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
from pagedprefill.testing.cases import CASES, MULTI_TILE_CASES, SPLIT_KEY_CASES, SPLIT_KEY_COUNTS  # noqa: E402
from pagedprefill.testing.conformance import (  # noqa: E402
    CASE_TEST,
    MULTI_TILE_TEST,
    SPLIT_KEYS_TEST,
    ConformanceSuite,
)
from pagedprefill.testing.shared_runs import SHARED_SUITES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Run:
    """One case of a shared test in one suite: what it launches (None: skipped or refused whatever the others
    run) and the suite it leaves the case to (None: it runs the case itself)."""

    suite: str
    test: str
    case: str
    splits: Optional[int]
    launches: Optional[tuple]
    owner: Optional[str]

    @property
    def name(self) -> str:
        return f"{self.suite}::{self.test}[{self.case if self.splits is None else f'{self.case}-{self.splits}'}]"


def suites(root: Path = ROOT) -> list[ConformanceSuite]:
    """An instance of every conformance suite class of the backends of ``SHARED_SUITES`` under ``root``."""
    found = []
    for path in sorted(root.glob("packages/backend-*/tests/test_*conformance.py")):
        spec = importlib.util.spec_from_file_location(f"conformance_{path.parent.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, ConformanceSuite) and value.__name__.startswith("Test") \
                    and value.__module__ == module.__name__ and value.backend in SHARED_SUITES:
                found.append(value())
    return found


def items() -> list[tuple[str, str, Optional[int]]]:
    """Every case of the shared tests, as pytest parametrises them."""
    return ([(CASE_TEST, case, None) for case in sorted(CASES)]
            + [(MULTI_TILE_TEST, case, None) for case in sorted(MULTI_TILE_CASES)]
            + [(SPLIT_KEYS_TEST, case, splits) for case in sorted(SPLIT_KEY_CASES) for splits in SPLIT_KEY_COUNTS])


def runs(all_suites: list[ConformanceSuite], size: str = "small") -> list[Run]:
    """Each case of each suite (:func:`items`) with its launches and its owner. A suite whose device skips it in
    the interpreter (sm80's Hopper class) launches nothing."""
    out = []
    for suite in all_suites:
        name = f"{suite.backend}:{type(suite).__name__}"
        for test, case, splits in items():
            try:
                launches = suite.launches(test, case, CPU, size, splits)
                shared = suite.shared_owner(test, case, CPU, size, splits)
            except pytest.skip.Exception:
                launches, shared = None, None
            out.append(Run(name, test, case, splits, launches, None if shared is None else shared[0]))
    return out


def coverage(all_runs: list[Run]) -> dict:
    """The counts before and after sharing, per suite and in all: the runs made, and the distinct (case,
    kernel, tile) combinations among them (the test and the batches count: two tests of one batch differ)."""
    def key(run: Run) -> tuple:
        return run.test, run.launches

    before = [run for run in all_runs if run.launches is not None]
    after = [run for run in before if run.owner is None]
    twice = Counter(key(run) for run in after)
    return {
        "suites": {suite: {"cases": sum(r.suite == suite for r in all_runs),
                           "before": sum(r.suite == suite for r in before),
                           "after": sum(r.suite == suite for r in after)}
                   for suite in dict.fromkeys(r.suite for r in all_runs)},
        "before": len(before), "after": len(after),
        "distinct_before": {key(run) for run in before}, "distinct_after": {key(run) for run in after},
        "repeated_after": sorted(run.name for run in after if twice[key(run)] > 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=("small", "large"))
    parser.add_argument("--skipped", action="store_true", help="list each case a suite leaves to another")
    args = parser.parse_args(argv)
    all_runs = runs(suites(), args.size)
    counts = coverage(all_runs)
    print(f"{'suite':<40} {'cases':>6} {'run before':>11} {'run after':>10}")
    for suite, row in counts["suites"].items():
        print(f"{suite:<40} {row['cases']:>6} {row['before']:>11} {row['after']:>10}")
    distinct_before, distinct_after = len(counts["distinct_before"]), len(counts["distinct_after"])
    print(f"runs: {counts['before']} before, {counts['after']} after; distinct (case, kernel, tile) combinations: "
          f"{distinct_before} before, {distinct_after} after")
    if counts["repeated_after"]:
        print("run by more than one suite (smoke cases): " + ", ".join(counts["repeated_after"]))
    if args.skipped:
        for run in all_runs:
            if run.owner is not None:
                print(f"  {run.name}: run by {run.owner}")
    if counts["distinct_before"] != counts["distinct_after"]:
        print(f"{len(counts['distinct_before'] - counts['distinct_after'])} combinations are run by no suite",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
