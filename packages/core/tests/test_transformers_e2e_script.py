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


def test_replay_times_layer_0s_calls_of_each_step_on_the_cpu(monkeypatch):
    """``--replay-fa4``'s recording keeps one call per step (layer 0's) and its replay runs each again through the
    engine-form drop-in; here on the reference backend, with FA4 absent and ``do_bench`` calling once."""
    tr = pytest.importorskip("transformers", reason="transformers is not installed")
    import torch
    import triton.testing
    from pagedprefill.cli import fa4 as fa4_peer
    from pagedprefill.integrations import transformers as integration

    e2e = script()
    integration.register()  # the backend the CPU selects: its calls are not --check's reference calls
    torch.manual_seed(0)
    config = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_hidden_layers=2, vocab_size=128)
    model = tr.LlamaForCausalLM(config).eval()
    records, restore = e2e.recorded_calls(layers=2)
    calls = []
    real = integration.context_attention_fwd
    try:
        integration.context_attention_fwd = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        model.set_attn_implementation("paged|pagedprefill")
        generation = tr.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = tr.ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=64)
        model.generate_batch([[5, 6, 7, 8, 9], [11, 12, 13]], generation_config=generation,
                             continuous_batching_config=cb)
    finally:
        integration.context_attention_fwd = real
        restore()
        integration.register(None)
    assert calls and len(records) * 2 == len(calls)
    ran = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (ran.append(fn()), 1.0)[1])
    monkeypatch.setattr(fa4_peer, "load", lambda: (None, "flash_attn.cute: not installed"))
    summary = e2e.replay(records)
    assert summary["prefill"]["calls"] >= 1 and summary["decode"]["calls"] >= 1
    assert summary["prefill"]["calls"] + summary["decode"]["calls"] == len(records) == len(ran)
    assert summary["prefill"]["pagedprefill_ms"] == summary["prefill"]["calls"]
    assert summary["fa4_not_run"] == ["flash_attn.cute: not installed"]
    assert all(torch.isfinite(out[:int(r["starts"][-1])]).all() for out, r in zip(ran, records))
