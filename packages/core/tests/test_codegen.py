"""Ahead-of-time compilation for GPUs that are not present: the codegen summary and ci/codegen_report.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.tiling import TileConfig

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed: nothing to compile ahead of time")

SPEC = BatchSpec(query_lens=(33, 5), context_lens=(70, 16), num_heads=8, num_kv_heads=2, head_size=128,
                 block_size=16, dtype=torch.bfloat16, layout="split")
TILE = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, heads_per_tile=2)


@pytest.fixture(scope="module")
def summaries():
    from pagedprefill.triton.codegen import codegen_summary

    problem = make_problem(SPEC)
    return {cap: codegen_summary(problem, TILE, cap) for cap in (90, 80)}


def test_hopper_dots_are_warpgroup_mma_and_loads_are_pipelined(summaries):
    s = summaries[90]
    assert s.dots == "wgmma" and s.wgmma > 0 and s.mma_sync == 0
    assert s.async_copies > 0 and s.pipelined_waits > 0
    assert s.unpipelined_loads == 0, "a K/V tile of an unmasked key loop is loaded synchronously"
    assert s.registers is not None and 0 < s.registers <= 255 and s.spill_bytes == 0
    assert 64 * 1024 < s.shared_bytes <= 227 * 1024
    assert s.wgmma_hazards in (0, None), "an instruction touches registers an in-flight wgmma owns"


def test_ampere_uses_mma_sync(summaries):
    s = summaries[80]
    assert s.dots == "mma.sync" and s.wgmma == 0 and s.async_copies > 0


def test_loop_pipelining_reads_ttgir():
    from pagedprefill.triton.codegen import loop_pipelining

    ttgir = """
    %a = ttg.async_wait %x {num = 2 : i32}
    scf.for %i = %c0 to %n step %c1 {
      %k = tt.load %p : tensor<64x128x!tt.ptr<bf16>, #blocked>
      scf.yield
    }
    """
    assert loop_pipelining(ttgir) == (1, 1)


def test_report_script_runs(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "codegen_report.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert {(r["device"], r["layout"]) for r in rows} == {("h200", "split"), ("h200", "nhd"), ("a100", "split"),
                                                          ("a100", "nhd")}
    assert all(r["dots"] == ("wgmma" if r["device"] == "h200" else "mma.sync") for r in rows)
    assert "regs" in proc.stdout.splitlines()[0]


def test_wgmma_register_hazards_are_found_in_sass():
    """Writing an in-flight warpgroup MMA's A registers, or touching its accumulator, before the wait that
    retires its group is flagged; the same code after the wait is not. (Groups retire in order: after
    ``DEPBAR.LE 1`` the first group, Q K^T into R88, is done and P V, reading P from R120-R127, still runs.)"""
    from pagedprefill.triton.codegen import wgmma_register_hazards

    head = """
        /*0100*/                   WARPGROUP.ARRIVE ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0120*/                   WARPGROUP.ARRIVE ;
        /*0130*/                   HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR4].tnspB, R24 ;
        /*0140*/                   HGMMA.64x128x16.F32.BF16 R24, R124, gdesc[UR4].tnspB, R24, gsb0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0160*/                   FMUL R150, R88, UR39 ;
    """
    unsafe = head + """
        /*0170*/                   FMUL R121, R89, UR39 ;
        /*0180*/              @P0  FADD R30, R30, 1 ;
        /*0190*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    """
    safe = head + """
        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0180*/                   FMUL R121, R89, UR39 ;
        /*0190*/                   FADD R30, R30, 1 ;
    """
    found = wgmma_register_hazards(unsafe)
    assert len(found) == 2 and "R121" in found[0] and "R30" in found[1], found
    assert wgmma_register_hazards(safe) == []
