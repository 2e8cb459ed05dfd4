"""The tests a run cut by its time limit did not finish, by node id, so that a later run takes only those.

A GPU suite often outlives one command's time limit. Run it with ``-v`` (``pytest -v``, with or without xdist:
each finished test's outcome and node id is then a line of the log); when it was cut, this collects the same
tests again (``pytest --collect-only -q`` with the arguments after ``--``), drops every test the logs say
finished (passed, failed, skipped, errored, xfailed or xpassed) and writes the others' node ids, one per line.

Node ids can hold spaces (parameter ids), so read the file into an array, never through word splitting::

    python3 ci/gpu/unfinished_tests.py run1.log --out rest.txt -- packages/backend-sm80/tests --pagedprefill-device=cuda
    mapfile -t IDS < rest.txt
    python3 -m pytest -v -n 12 "${IDS[@]}" --pagedprefill-device=cuda > run2.log

The ids written are relative to the working directory (run it where the next run starts); a log's ids are
matched from their ``tests/`` folder on, so a log written from another working directory (the package's folder,
the repository's root) still counts.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Iterable

OUTCOMES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
_OUTCOME = "|".join(OUTCOMES)
#: ``[gw3] [ 12%] PASSED path::test[id]`` (xdist with ``-v``).
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOME}) (\S.*::.*?)\s*$")
#: ``path::test[id] PASSED [ 12%]`` or ``path::test[id] SKIPPED (reason) [ 12%]`` (``-v`` without xdist).
_PLAIN_LINE = re.compile(rf"^(\S.*::.*?) ({_OUTCOME})(?: \(.*\))?(?:\s+\[\s*\d+%\])?\s*$")
#: ``PASSED path::test[id]`` or ``FAILED path::test[id] - reason`` (the short summary of ``-rA``/``-rfEs``): the
#: id ends at its parameters' closing bracket, which a reason after `` - `` may follow.
_SUMMARY_LINE = re.compile(rf"^({_OUTCOME}) (\S+?::[^\s\[]*(?:\[.*?\])?)(?: - .*)?\s*$")


def match_key(node_id: str) -> str:
    """``node_id`` from its ``tests/`` folder on: the same test whatever directory pytest ran from."""
    path, sep, rest = node_id.partition("::")
    at = path.rfind("tests/")
    return (path[at:] if at >= 0 else path) + sep + rest


def finished_ids(lines: Iterable[str]) -> set:
    """The match keys (:func:`match_key`) of the tests whose outcome a pytest log's ``lines`` report."""
    done = set()
    for line in lines:
        line = line.rstrip("\n")
        for pattern, group in ((_XDIST_LINE, 2), (_PLAIN_LINE, 1), (_SUMMARY_LINE, 2)):
            found = pattern.match(line)
            if found:
                done.add(match_key(found.group(group)))
                break
    return done


def collected_ids(lines: Iterable[str]) -> list:
    """The node ids of ``pytest --collect-only -q``'s output ``lines``, in its order."""
    return [line.rstrip("\n") for line in lines if "::" in line and not line.startswith(" ")]


def unfinished(collected: list, finished: set) -> list:
    """The ``collected`` node ids that no log reported as finished."""
    return [node for node in collected if match_key(node) not in finished]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="logs of the cut runs (pytest -v)")
    parser.add_argument("--out", metavar="PATH", help="write the unfinished node ids here (default: stdout)")
    args = parser.parse_args(own)
    if not pytest_args:
        parser.error("give the cut run's pytest arguments after --, e.g. -- packages/backend-sm80/tests")
    finished = set()
    for log in args.logs:
        with open(log, errors="replace") as fh:
            finished |= finished_ids(fh)
    # Ids relative to the working directory, where the next run starts (a package's own pytest settings would
    # make them relative to its folder instead).
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"--rootdir={os.getcwd()}", *pytest_args], capture_output=True, text=True)
    collected = collected_ids(proc.stdout.splitlines())
    if not collected:
        print(f"pytest collected no tests (exit status {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    rest = unfinished(collected, finished)
    text = "".join(node + "\n" for node in rest)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    print(f"{len(collected)} collected, {len(collected) - len(rest)} finished in the logs, {len(rest)} unfinished",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
