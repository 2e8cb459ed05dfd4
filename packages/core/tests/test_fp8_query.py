"""An FP8 q (``fp8_query``): ``float8_e4m3fn`` queries with their descale ``q_scale``, as an engine that
quantised its queries passes them. What the call computes in, what it allocates, what the reference computes,
the public signatures' pass-through and the refusal on GPUs without an e4m3 type. The kernels' results are the
conformance suite's (``fp8_query*`` cases, every backend)."""

from __future__ import annotations

import dataclasses

import pagedprefill as pp
import pagedprefill.vllm
import pytest
import torch
from pagedprefill.backends.reference import ReferenceBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.errors import UnsupportedFeatureError
from pagedprefill.workloads import BatchSpec, make_problem

SPEC = BatchSpec(query_lens=(5, 1, 9), context_lens=(7, 20, 0), num_heads=4, num_kv_heads=2, head_size=16,
                 block_size=4, fp8_query=True, seed=5)


def test_an_fp8_query_is_the_fp8_query_feature_and_computes_in_the_other_tensors_type():
    p = make_problem(SPEC.replace(dtype=torch.bfloat16))
    assert p.q.dtype == torch.float8_e4m3fn and "fp8_query" in p.features
    assert p.dtype == torch.bfloat16  # the output's
    fp8_out = make_problem(SPEC.replace(fp8_out_scale=0.05))
    assert fp8_out.dtype == torch.float16  # the new keys', the output being FP8
    in_cache = make_problem(SPEC.replace(fp8_out_scale=0.05, kv_in_cache=True, kv_cache_dtype="fp8_e4m3"))
    assert in_cache.dtype == torch.bfloat16  # nothing 16-bit: bfloat16, which holds every FP8 value
    assert make_problem(SPEC.replace(fp8_query=False)).dtype == torch.float16
    assert "fp8_query" not in make_problem(SPEC.replace(fp8_query=False)).features


@pytest.mark.parametrize("as_tensor", [False, True])
def test_the_reference_attends_with_the_descaled_queries(as_tensor):
    p = make_problem(SPEC.replace(dtype=torch.float32, scale_as_tensor=as_tensor))
    scale = p.options.q_scale
    assert isinstance(scale, torch.Tensor) == as_tensor
    descaled = p.q.float() * (scale if as_tensor else float(scale))
    plain = dataclasses.replace(p, q=descaled, out=torch.empty_like(descaled),
                                options=dataclasses.replace(p.options, q_scale=1.0))
    ReferenceBackend().run(p, None)
    ReferenceBackend().run(plain, None)
    assert torch.isfinite(p.out).all()
    torch.testing.assert_close(p.out, plain.out, atol=0, rtol=0)


def test_the_native_api_allocates_the_output_in_the_new_keys_type_or_bfloat16():
    p = make_problem(SPEC)
    out = pp.prefill_attention(p.q, p.k, p.v, p.cache, p.batch, q_scale=p.options.q_scale, backend="reference")
    assert out.dtype == torch.float16
    ref = make_problem(SPEC)
    ReferenceBackend().run(ref, None)
    torch.testing.assert_close(out, ref.out)
    cached = make_problem(SPEC.replace(kv_in_cache=True, kv_cache_dtype="fp8_e5m2"))
    out = pp.prefill_attention(cached.q, None, None, cached.cache, cached.batch, q_scale=cached.options.q_scale,
                               backend="reference")
    assert out.dtype == torch.bfloat16


def test_the_vllm_signature_passes_q_scale():
    p = make_problem(SPEC.replace(kv_in_cache=True, kv_cache_dtype="fp8_e4m3"))
    c, b = p.cache, p.batch
    o = torch.full(p.q.shape, float("nan"), dtype=torch.float16)
    pagedprefill.vllm.context_attention_fwd(p.q, None, None, o, "fp8_e4m3", c.key, c.value, b.block_table,
                                            b.query_start, b.seq_lens, None, None, c.k_scale, c.v_scale,
                                            q_scale=p.options.q_scale, backend="reference", validate="full")
    ReferenceBackend().run(p, None)
    torch.testing.assert_close(o, p.out.to(o.dtype), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"^q_scale: expected a finite positive scale, got -1\.0$"):
        pagedprefill.vllm.context_attention_fwd(p.q, None, None, o, "fp8_e4m3", c.key, c.value, b.block_table,
                                                b.query_start, b.seq_lens, None, None, c.k_scale, c.v_scale,
                                                q_scale=-1.0, backend="reference")


def _nvidia(capability) -> DeviceInfo:
    return DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA A100", capability=capability,
                      warp_size=32, num_sms=108, max_shared_mem=163 * 1024, triton_backend="cuda")


def test_core_kernel_refuses_an_fp8_query_before_sm89_naming_q():
    generic = pp.get_registry().get("generic")
    p = make_problem(SPEC)
    with pytest.raises(UnsupportedFeatureError, match=r"^q: dtype float8_e4m3fn needs an NVIDIA GPU of compute "
                                                      r"capability 8\.9 or later .* is 8\.0"):
        generic.check_problem(p, _nvidia((8, 0)))
    generic.check_problem(p, _nvidia((8, 9)).replace(name="NVIDIA L40"))  # an e4m3 type there
    generic.check_problem(make_problem(SPEC.replace(fp8_query=False)), _nvidia((8, 0)))


@pytest.mark.parametrize("changes, named", [
    (dict(fp8_query=False, kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3'"),
    (dict(fp8_query=False, fp8_out_scale=0.25), "fp8_out_scale (an FP8 e4m3 output)"),
    (dict(kv_cache_dtype="fp8_e4m3", fp8_out_scale=0.25), "q: dtype float8_e4m3fn and kv_cache_dtype='fp8_e4m3' and "
                                                          "fp8_out_scale (an FP8 e4m3 output)"),
], ids=["e4m3-cache", "fp8-output", "all-three"])
def test_core_kernel_refuses_every_e4m3_tensor_before_sm89_naming_it(changes, named):
    """An e4m3 cache or an FP8 output does not compile before sm89 either (Triton 3.6: "type fp8e4nv not supported
    in this architecture"): refused by name, with what to pass instead; an e5m2 cache compiles there and runs."""
    generic = pp.get_registry().get("generic")
    with pytest.raises(UnsupportedFeatureError) as refused:
        generic.check_problem(make_problem(SPEC.replace(**changes)), _nvidia((8, 0)))
    message = str(refused.value)
    assert message.startswith(named + " need") and "compute capability 8.9 or later" in message, message
    assert "backend='reference'" in message and "is 8.0" in message
    generic.check_problem(make_problem(SPEC.replace(**changes)), _nvidia((8, 9)).replace(name="NVIDIA L40"))
    generic.check_problem(make_problem(SPEC.replace(fp8_query=False, kv_cache_dtype="fp8_e5m2")), _nvidia((8, 0)))
