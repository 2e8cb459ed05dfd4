"""``pagedprefill.vllm.context_attention_fwd`` on the generic Triton backend, with vLLM's own cache construction
(split K cache with x = 8 for every dtype; FP8 caches as uint8 bytes or a float8 tensor viewed as uint8) and
N(0, 1) data, against torch's float64 SDPA on the values the cache holds. bfloat16 runs on GPUs only (the
interpreter's bf16 dot is not exact); its construction is covered on the reference in core's tests.

The kernels derive the context lengths from ``b_start_loc`` and ``b_seq_len``: checked against the reference
given those lengths, with new keys passed or in the cache, skipped decode rows, and split keys.
"""

import os

import pytest
import torch
from pagedprefill import plans, vllm
from pagedprefill.api import get_registry
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.testing.cases import DEFAULT_TOLERANCES, assert_matches_reference
from pagedprefill.testing.vllm_batches import sdpa_reference, vllm_batch
from pagedprefill.triton import launch

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


#: Decode rows, sequences without context, one without new tokens, and a context of several key tiles.
ENGINE_LENGTHS = dict(query_lens=(1, 6, 1, 13, 0, 37), context_lens=(20, 0, 0, 3, 5, 300))


@pytest.fixture
def no_plans():
    plans.forget()  # a plan of another test's tile must not serve these calls
    yield
    plans.forget()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("key_splits", [1, 3])
@pytest.mark.parametrize("options", [{}, dict(kv_in_cache=True), dict(skip_decode=True),
                                     dict(kv_in_cache=True, skip_decode=True, layout="split")],
                         ids=["kv_given", "kv_in_cache", "skip_decode", "kv_in_cache_skip_decode_split"])
def test_derived_context_lengths_match_the_reference(options, key_splits, dtype, device, monkeypatch, no_plans):
    """The call hands the kernels no context lengths (they derive them); the reference gets them explicitly."""
    spec = BatchSpec(**ENGINE_LENGTHS, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=dtype, seed=3,
                     **options)
    given = make_problem(spec, device)
    generic = get_registry().get("generic")
    policy_tile = generic.tile_config
    monkeypatch.setattr(generic, "tile_config",
                        lambda shape, info: policy_tile(shape, info).with_(key_splits=key_splits))
    launched = []
    jit_launch = launch.jit_launch

    def seen(kernel, call, device):  # each launch's flag and splits: the kernel, then the combine of split keys
        launched.append((call.constexprs["FEATURES"].CONTEXT_FROM_STARTS, call.constexprs["TILE"].KEY_SPLITS))
        return jit_launch(kernel, call, device)

    monkeypatch.setattr(launch, "jit_launch", seen)
    c, b = given.cache, given.batch
    vllm.context_attention_fwd(given.q, given.k, given.v, given.out, "auto", c.key, c.value, b.block_table,
                               b.query_start, b.seq_lens, None, None, 1.0, 1.0,
                               skip_decode=given.options.skip_decode, backend="generic")
    assert launched == [(True, key_splits)] * (1 if key_splits == 1 else 2)
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    assert_matches_reference(given.out, given, atol, rtol, label=spec.describe())
