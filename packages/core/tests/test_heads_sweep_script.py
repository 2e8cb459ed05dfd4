"""ci/gpu/heads_sweep.py's chart, drawn from a results file without a GPU (``--replot``): checked here so that a
change to the file's form or to the chart fails in CI, not after a run on the GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "heads_sweep.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")


def script():
    spec = importlib.util.spec_from_file_location("heads_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("heads_sweep", module)
    spec.loader.exec_module(module)
    return module


def cell(tflops: float, gbps: float = 0.0) -> dict:
    return {"ms": 1.0, "tflops": tflops, "gbps": gbps, "rounds_ms": [1.0, 1.0], "max_abs_err": 1e-3, "config": None}


RESULTS = {"device": "NVIDIA H100 80GB HBM3 (cuda:0), vendor=nvidia, capability=9.0", "packings": "policy", "rows": [
    {"workload": "a prefill row", "group": 5, "memory_bound": False,
     "columns": {"engine h5 (policy)": cell(590.0), "nhd (policy)": cell(575.0), "fa4": cell(585.0)}},
    {"workload": "another prefill row", "group": 8, "memory_bound": False,
     "columns": {"engine h8 (policy)": cell(600.0), "engine h2": cell(540.0), "nhd (policy)": cell(607.0)}},
    {"workload": "a decode row", "group": 4, "memory_bound": True,
     "columns": {"engine h4 (policy)": cell(11.4, 2853.0), "nhd (policy)": cell(11.5, 2877.0),
                 "fa4": cell(10.9, 2728.0)}}]}


def test_the_policys_packing_is_one_bar_whatever_its_head_count(monkeypatch):
    module = script()
    drawn = []
    monkeypatch.setattr(module, "plot", lambda rows, path, title: drawn.append((rows, title)) or path)
    assert module.chart(RESULTS, "chart.png") == "chart.png"
    rows, title = drawn[0]
    assert {r["impl"] for r in rows} == {"engine (policy)", "engine h2", "nhd (policy)", "fa4"}
    assert [r["gbps"] for r in rows if r["memory_bound"]] == [2853.0, 2877.0, 2728.0]
    assert title.endswith("(NVIDIA H100 80GB HBM3)")


def test_replot_draws_the_chart_of_a_written_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    results = tmp_path / "models.json"
    results.write_text(json.dumps(RESULTS))
    png = tmp_path / "models.png"
    assert script().main(["--replot", str(results), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
