"""Prove that the CPU sessions' pins resolve on the public package index alone.

Usage: ``python ci/check_pins.py [--index-url URL] REQUIREMENT...`` with the requirements the tests session
installs. pip's resolver runs with ``--dry-run`` under ``ci/constraints-cpu.txt``, against the public index
only: every pip configuration file and every ``PIP_*`` variable that names an index, a wheel folder or a
constraint is set aside, so that a machine's local wheels (a CPU build of torch, say) cannot hide a pin the
public index cannot satisfy. Only metadata is fetched: the index's metadata files where it serves them, else
byte ranges of the wheels (pip's ``fast-deps``). A pip without ``fast-deps`` on an index without metadata
files would download whole wheels (gigabytes for torch's CUDA stack); pip 23.2, the one CI's venvs get, has
the feature.

The resolution must give the GPU machines' tested pair (:data:`TESTED_PAIR`): the public index has no CPU
build of torch for Linux, so its torch is the CUDA build, and that build's Triton requirement must be the
Triton the kernels are compiled and tested with.

Exit status: 0 when the pins resolve to the tested pair, and also (with the reason printed) when the index
cannot be reached, as on a machine without network: nothing can be proved then. 1 when the index answers
and the pins do not resolve, or resolve to another pair.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "ci" / "constraints-cpu.txt"
PUBLIC_INDEX = "https://pypi.org/simple"

#: The torch and Triton releases the GPU machines run (docs/performance.md), which the public index must
#: resolve the pins to: Triton exactly (its Gluon API moves between releases), torch by release series (a
#: patch release of the same series keeps the same Triton requirement).
TESTED_PAIR = {"torch": "2.11.0", "triton": "3.6.0"}


def tested(name: str, version: str) -> bool:
    """Whether ``version`` of ``name`` is the tested one (torch: the same ``major.minor`` series)."""
    want = TESTED_PAIR[name]
    if name == "torch":
        return version.split("+")[0].split(".")[:2] == want.split(".")[:2]
    return version == want

#: pip settings kept from the environment: how to reach an index (certificates, proxy, timeouts), not which.
TRANSPORT = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES",
             "PIP_DISABLE_PIP_VERSION_CHECK"}

#: What pip prints when it cannot reach an index (as opposed to reaching it and finding a conflict).
NETWORK_ERRORS = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded",
                  "Temporary failure in name resolution", "Name or service not known", "SSLError",
                  "ProxyError", "Network is unreachable", "Connection refused")


def public_env() -> dict[str, str]:
    """The environment with pip's local configuration set aside (``os.devnull`` as the configuration file
    makes pip read no configuration file at all)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in TRANSPORT}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def unreachable(index_url: str, timeout: float = 20.0) -> str | None:
    """Why ``index_url`` cannot be reached, or None when it answers."""
    try:
        with urllib.request.urlopen(f"{index_url.rstrip('/')}/pip/", timeout=timeout) as response:
            response.read(1)
    except (urllib.error.URLError, OSError) as error:
        return f"{type(error).__name__}: {getattr(error, 'reason', error)}"
    return None


def resolve(requirements: list[str], index_url: str, report: Path) -> subprocess.CompletedProcess:
    """pip's resolution of ``requirements`` under the constraints, written to ``report`` (pip's JSON)."""
    base = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--index-url", index_url, "--report", str(report), "-c", str(CONSTRAINTS), *requirements]
    # fast-deps: where the index serves no metadata files, read the metadata from byte ranges of the wheels
    # instead of downloading them (torch's CUDA stack is gigabytes). A pip without the feature refuses it.
    proc = subprocess.run([*base[:4], "--use-feature=fast-deps", *base[4:]], capture_output=True, text=True,
                          env=public_env())
    if proc.returncode and "fast-deps" in proc.stderr and "invalid choice" in proc.stderr:
        proc = subprocess.run(base, capture_output=True, text=True, env=public_env())
    return proc


def resolved_versions(report: Path) -> dict[str, str]:
    """Project name -> version of everything pip would install, from its ``--report``."""
    data = json.loads(report.read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in data["install"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-url", default=PUBLIC_INDEX, help=f"the public index (default {PUBLIC_INDEX})")
    parser.add_argument("requirements", nargs="+", help="what the tests session installs (paths, extras)")
    args = parser.parse_args(argv)
    requirements = [str(ROOT / r) if (ROOT / r.split("[")[0]).exists() else r for r in args.requirements]

    reason = unreachable(args.index_url)
    if reason:
        print(f"check_pins: skipped: the public index {args.index_url} cannot be reached ({reason}); "
              f"the pins in {CONSTRAINTS.relative_to(ROOT)} were not checked against it")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = resolve(requirements, args.index_url, report)
        elapsed = time.monotonic() - start
        output = proc.stdout + proc.stderr
        if proc.returncode:
            if any(marker in output for marker in NETWORK_ERRORS):
                print(f"check_pins: skipped: the public index {args.index_url} stopped answering during the "
                      f"resolution; the pins were not checked against it. pip said:\n{output.strip()}")
                return 0
            print(f"check_pins: FAILED: the pins in {CONSTRAINTS.relative_to(ROOT)} do not resolve on "
                  f"{args.index_url} alone ({elapsed:.0f} s). pip said:\n{output.strip()}")
            return 1
        versions = resolved_versions(report)
    got = {name: versions.get(name, "absent") for name in TESTED_PAIR}
    if not all(tested(name, version) for name, version in got.items()):
        print(f"check_pins: FAILED: on {args.index_url} alone the pins resolve to "
              f"{', '.join(f'{n} {v}' for n, v in got.items())}, expected the tested pair "
              f"{', '.join(f'{n} {v}' for n, v in TESTED_PAIR.items())}")
        return 1
    print(f"check_pins: the pins resolve on {args.index_url} alone to "
          f"{', '.join(f'{n} {v}' for n, v in got.items())} (numpy {versions.get('numpy', 'absent')}), "
          f"in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
