"""Where a kernel's warps wait, from the profiler's per-instruction stall samples (no GPU needed to read them).

The per-kernel stall reasons (``profile_rows.sh``) say how long warps wait, not on what: on the Hopper kernel
the "barrier" reason adds up the warps idle at the CTA's barrier (the padding warps of the producer's warpgroup,
the producer once its loads are issued) and the consumers waiting for their own warpgroup MMAs
(``WARPGROUP.DEPBAR``) alike. This reads the profiler's source page of one launch (SASS, CSV) and sums the
samples by the kind of instruction the warps stood at:

- **MMA wait**: ``WARPGROUP.DEPBAR``, a warpgroup waiting for its own MMAs to finish;
- **CTA barrier**: ``BAR.SYNC`` without a thread count (every warp of the CTA) and the instruction after it,
  where warps with nothing left to do wait for the others;
- **named barrier**: ``BAR.SYNC`` of a thread count (a warpgroup's own) and the instruction after it;
- **tile wait**: an mbarrier wait (``SYNCS.PHASECHK``) and its retry branch: a consumer waiting for a tile to
  land, or the producer for a buffer to be handed back (the kinds do not tell the partitions apart);
- **MMA issue**: ``HGMMA`` and ``WARPGROUP.ARRIVE``;
- **other**: everything else (the softmax, addressing, the epilogue).

Each kind's share of all samples, its largest stall reasons, and its share of the samples outside the CTA
barrier (what the working warps do).

Usage::

    ncu -k regex:hopper_prefill --launch-skip 3 --launch-count 1 --section SourceCounters -o rep \\
        python3 ci/gpu/profile_workload.py "long prefill" --suite engine --engine
    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 ci/gpu/stall_sites.py rep.csv [more.csv ...]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

KINDS = ("MMA wait", "CTA barrier", "named barrier", "tile wait", "MMA issue", "other")
SAMPLES = "Warp Stall Sampling (All Samples)"


def kind_of(source: str, previous: str) -> str:
    """The kind (:data:`KINDS`) of the SASS instruction ``source``, which follows ``previous``."""
    if "WARPGROUP.DEPBAR" in source:
        return "MMA wait"
    for text in (source, previous):
        barrier = re.search(r"\bBAR\.SYNC(?:\.DEFER_BLOCKING)?\s+(0x[0-9a-f]+|\d+)\s*(,)?", text)
        if barrier:
            return "named barrier" if barrier.group(2) else "CTA barrier"
    if "SYNCS.PHASECHK" in source or ("BRA" in source and "SYNCS.PHASECHK" in previous):
        return "tile wait"
    if "HGMMA" in source or "WARPGROUP.ARRIVE" in source:
        return "MMA issue"
    return "other"


def read(path: str) -> tuple[str, list[dict]]:
    """The kernel's name and the rows of the profiler's source-page CSV at ``path``."""
    with open(path, newline="") as fh:
        lines = list(csv.reader(fh))
    start = next((i for i, row in enumerate(lines) if "Source" in row and SAMPLES in row), None)
    if start is None:
        raise SystemExit(f"stall_sites: {path}: no header with 'Source' and {SAMPLES!r}: expected the profiler's "
                         "source page as CSV (--page source --csv --print-source sass)")
    kernel = next((row[1] for row in lines[:start] if len(row) > 1 and row[0] == "Kernel Name"), "?")
    header = lines[start]
    return kernel, [dict(zip(header, row)) for row in lines[start + 1:] if len(row) == len(header)]


def summarise(rows: list[dict]) -> dict:
    """``{kind: (samples, {reason: samples})}`` over ``rows``."""
    reasons = [name for name in (rows[0] if rows else {}) if name.startswith("stall_") and "Not Issued" not in name]
    out = {kind: [0, {}] for kind in KINDS}
    previous = ""
    for row in rows:
        kind = kind_of(row["Source"], previous)
        previous = row["Source"]
        out[kind][0] += int(row[SAMPLES] or 0)
        for reason in reasons:
            out[kind][1][reason] = out[kind][1].get(reason, 0) + int(row[reason] or 0)
    return {kind: (n, by) for kind, (n, by) in out.items()}


def report(path: str) -> str:
    kernel, rows = read(path)
    summary = summarise(rows)
    total = sum(n for n, _ in summary.values()) or 1
    working = (total - summary["CTA barrier"][0]) or 1
    lines = [f"{path}: {kernel}, {total} samples", "| where warps stood | of all samples | of the working warps' | "
             "largest reasons |", "| --- | ---: | ---: | --- |"]
    for kind in KINDS:
        n, by = summary[kind]
        top = sorted(((v, r) for r, v in by.items() if v), reverse=True)[:3]
        reasons = ", ".join(f"{r.removeprefix('stall_')} {v / max(n, 1) * 100:.0f}%" for v, r in top)
        share = "-" if kind == "CTA barrier" else f"{n / working * 100:.1f}%"
        lines.append(f"| {kind} | {n / total * 100:.1f}% | {share} | {reasons} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+", help="the profiler's source page of one launch, as CSV")
    args = parser.parse_args(argv)
    print("\n\n".join(report(path) for path in args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
