"""ci/gpu/stall_sites.py, which sums the profiler's per-instruction stall samples by the kind of instruction the
warps stood at: checked on a small source page written here, so that a change to its reading fails in CI, not
after a profile on the GPU."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "stall_sites.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb", "stall_wait",
          "stall_barrier (Not Issued)"]
#: (SASS, samples, barrier, long scoreboard, wait): one instruction of each kind, and the instruction after each
#: barrier, which takes that barrier's kind.
ROWS = [
    ("BAR.SYNC.DEFER_BLOCKING 0x1 ;", 2, 2, 0, 0),        # CTA barrier
    ("NOP ;", 40, 40, 0, 0),                               # after it: CTA barrier
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x280e0], R2 ;", 3, 0, 3, 0),  # tile wait
    ("@!P0 BRA 0x7ff0 ;", 7, 0, 7, 0),                     # its retry: tile wait
    ("WARPGROUP.ARRIVE ;", 1, 0, 0, 1),                    # MMA issue
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;", 4, 0, 0, 4),  # MMA issue
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", 30, 30, 0, 0),     # MMA wait
    ("MUFU.EX2 R18, R18 ;", 5, 0, 0, 5),                   # other
    ("BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;", 3, 3, 0, 0),   # named barrier
    ("SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR7+0x280e0], RZ ;", 5, 0, 0, 5),  # after it: named barrier
]


def load():
    spec = importlib.util.spec_from_file_location("stall_sites", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_page(path: Path, rows=ROWS) -> None:
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["Kernel Name", "hopper_prefill_kernel"])
        out.writerow(HEADER)
        for i, (sass, samples, barrier, long_sb, wait) in enumerate(rows):
            out.writerow([hex(i * 16), f"      {sass}", samples, barrier, long_sb, wait, 0])


def test_samples_are_summed_by_the_kind_of_instruction(tmp_path):
    stall_sites = load()
    page = tmp_path / "page.csv"
    write_page(page)
    kernel, rows = stall_sites.read(str(page))
    assert kernel == "hopper_prefill_kernel"
    summary = stall_sites.summarise(rows)
    assert {kind: n for kind, (n, _) in summary.items()} == {
        "MMA wait": 30, "CTA barrier": 42, "named barrier": 8, "tile wait": 10, "MMA issue": 5, "other": 5}
    assert summary["tile wait"][1]["stall_long_sb"] == 10
    assert "stall_barrier (Not Issued)" not in summary["MMA wait"][1]


def test_the_report_gives_each_kinds_share_of_all_samples_and_of_the_working_warps(tmp_path):
    stall_sites = load()
    page = tmp_path / "page.csv"
    write_page(page)
    text = stall_sites.report(str(page))
    # 100 samples in all, 58 outside the CTA barrier: the MMA wait is 30% of all and 51.7% of the working warps'.
    assert "100 samples" in text
    assert "| MMA wait | 30.0% | 51.7% | barrier 100% |" in text
    assert "| CTA barrier | 42.0% | - |" in text


def test_a_file_that_is_not_a_source_page_is_refused_with_what_was_expected(tmp_path):
    stall_sites = load()
    page = tmp_path / "details.csv"
    page.write_text('"ID","Kernel Name","Metric Name"\n"0","k","gpu__time_duration.sum"\n')
    with pytest.raises(SystemExit, match="source page"):
        stall_sites.read(str(page))
