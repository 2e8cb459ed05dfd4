"""ci/gpu/transformers_e2e.py's chart, drawn from a results file without a GPU (``--replot``): checked here so
that a change to the file's form or to the chart fails in CI, not after a run on the GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "ci" / "gpu" / "transformers_e2e.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no {SCRIPT} (this checkout has no ci/)")


def script():
    spec = importlib.util.spec_from_file_location("transformers_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(impl: str, scale: float) -> dict:
    return {"impl": impl, "status": "ok", "prefill_tokens_per_s": 7000.0 * scale, "decode_tokens_per_s": 60.0 * scale,
            "ttft_median_s": 3.5 / scale, "wall_s": 33.0 / scale}


def test_replot_draws_a_chart_of_the_rows_that_ran(tmp_path):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    results = tmp_path / "e2e.json"
    results.write_text(json.dumps({
        "environment": {"gpu": "a GPU", "transformers": "5.17.0", "date": "2026-12-07T10:00:00+00:00"},
        "layers": 8, "prompts": 32, "new_tokens": 128,
        "rows": [row("paged|sdpa", 1.0), {"impl": "paged|flash_attention_4", "status": "not run", "reason": "x"},
                 row("paged|pagedprefill", 4.0)]}))
    png = tmp_path / "e2e.png"
    assert script().main(["--replot", str(results), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_without_a_png_is_refused():
    with pytest.raises(SystemExit):
        script().main(["--replot", "e2e.json"])


def test_a_results_file_where_nothing_ran_draws_no_chart(tmp_path):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    results = tmp_path / "e2e.json"
    results.write_text(json.dumps({"rows": [{"impl": "paged|sdpa", "status": "not run", "reason": "no GPU"}]}))
    assert script().main(["--replot", str(results), "--png", str(tmp_path / "e2e.png")]) == 1
    assert not (tmp_path / "e2e.png").exists()
