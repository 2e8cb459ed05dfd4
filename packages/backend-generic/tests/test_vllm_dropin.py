"""``pagedprefill.vllm.context_attention_fwd`` on the generic Triton backend, with vLLM's own cache construction
(split K cache with x = 8 for every dtype; FP8 caches as uint8 bytes or a float8 tensor viewed as uint8) and
N(0, 1) data, against torch's float64 SDPA on the values the cache holds. bfloat16 runs on GPUs only (the
interpreter's bf16 dot is not exact); its construction is covered on the reference in core's tests.
"""

import os

import pytest
import torch
from pagedprefill import vllm
from pagedprefill.testing.vllm_batches import sdpa_reference, vllm_batch

TOLERANCES = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2), torch.float32: (2e-4, 2e-4)}


@pytest.fixture
def device(pagedprefill_device):
    if pagedprefill_device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on the CPU need TRITON_INTERPRET=1")
    return pagedprefill_device


def _dtypes():
    yield torch.float16
    yield torch.float32
    yield pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="bf16 tl.dot is not exact in Triton's CPU interpreter"))


@pytest.mark.parametrize("dtype", list(_dtypes()), ids=str)
@pytest.mark.parametrize("kv_cache_dtype, fp8_storage", [("auto", "uint8"), ("fp8", "uint8"), ("fp8_e5m2", "uint8"),
                                                         ("fp8_e4m3", "float8_view")])
@pytest.mark.parametrize("sliding_window", [0, 16])
def test_vllm_construction_matches_sdpa(dtype, kv_cache_dtype, fp8_storage, sliding_window, device):
    batch = vllm_batch((19, 1, 33, 4), (40, 17, 0, 70), num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, fp8_storage=fp8_storage, block_size=16, device=device,
                       seed=11)
    assert batch["k_cache"].shape[4] == 8
    args = {k: v for k, v in batch.items() if k not in ("key", "value")}
    vllm.context_attention_fwd(**args, sliding_window=sliding_window, backend="generic")
    out = args["o"]
    assert torch.isfinite(out.float()).all()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double().cpu(), sdpa_reference(batch, sliding_window), atol=atol, rtol=rtol)


@pytest.mark.parametrize("option", ["skip_decode", "causal", "fp8_out_scale"])
def test_options_run_and_match_the_reference(option, device):
    """vLLM's options through its signature on the kernels, against the reference backend on the same call.

    (New tokens read from the cache, ``k = v = None``, are covered by the conformance suite's
    ``kv_in_cache`` cases, which write those tokens to the cache first.)"""
    batch = vllm_batch((5, 1, 17), (9, 3, 30), device=device)
    args = {k: v for k, v in batch.items() if k not in ("key", "value")}
    changes = {"skip_decode": dict(skip_decode=True), "causal": dict(causal=False),
               "fp8_out_scale": dict(fp8_out_scale=0.1, o=args["o"].to(torch.float8_e4m3fn))}[option]
    args.update(changes)
    expected = dict(args, o=args["o"].clone())
    vllm.context_attention_fwd(**args, backend="generic")
    vllm.context_attention_fwd(**expected, backend="reference")
    got, want = args["o"].float().cpu(), expected["o"].float().cpu()
    if option == "skip_decode":  # the single-token sequence's rows stay as they were (NaN poison)
        assert torch.isnan(got[5]).all() and torch.isnan(want[5]).all()
        keep = torch.ones(got.shape[0], dtype=torch.bool)
        keep[5] = False
        got, want = got[keep], want[keep]
    assert torch.isfinite(got).all()
    atol, rtol = TOLERANCES[args["q"].dtype]
    if option == "fp8_out_scale":
        atol, rtol = 0.0, 0.13  # at most one FP8 step (12.5%) apart: rounding of slightly different sums
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
