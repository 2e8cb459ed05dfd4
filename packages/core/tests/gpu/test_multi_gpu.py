"""Several GPUs in one process: a call runs on its tensors' device whatever the current device is, threads drive
two GPUs at once, and the backend is selected per device. Needs 2 GPUs (skips with the count otherwise)."""

from __future__ import annotations

import dataclasses
import os
import threading

import pagedprefill as pp
import pytest
import torch
from pagedprefill.testing import DEFAULT_TOLERANCES, BatchSpec, assert_matches_reference, make_problem

SPECS = {
    "fp16_nhd_gqa": BatchSpec(query_lens=(37, 1, 120, 0, 9), context_lens=(300, 77, 0, 12, 513), num_heads=16,
                              num_kv_heads=4, head_size=128, block_size=16, dtype=torch.float16, seed=3),
    "bf16_split_fp8_tensor_scales_features": BatchSpec(
        query_lens=(64, 5, 1), context_lens=(129, 0, 700), num_heads=8, num_kv_heads=2, head_size=64,
        block_size=32, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3", layout="split", scale_as_tensor=True,
        alibi=True, sinks=True, sliding_window=100, softcap=30.0, seed=4),
}


def moved(problem: pp.PrefillProblem, device: torch.device) -> pp.PrefillProblem:
    """A copy of ``problem`` with every tensor on ``device``."""
    def to(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    c, b, o = problem.cache, problem.batch, problem.options
    return pp.PrefillProblem(
        q=to(problem.q), k=to(problem.k), v=to(problem.v), out=to(problem.out),
        cache=dataclasses.replace(c, key=to(c.key), value=to(c.value), k_scale=to(c.k_scale), v_scale=to(c.v_scale)),
        batch=pp.BatchMetadata(to(b.query_start), to(b.seq_lens), to(b.context_lens), to(b.block_table),
                               b.max_query_len),
        options=dataclasses.replace(o, alibi_slopes=to(o.alibi_slopes), sinks=to(o.sinks)))


def call(problem: pp.PrefillProblem) -> torch.Tensor:
    """The native API on ``problem`` with a fresh NaN-poisoned output (selection by the tensors' device)."""
    o = problem.options
    out = torch.full_like(problem.q, float("nan"))
    return pp.prefill_attention(problem.q, problem.k, problem.v, problem.cache, problem.batch, out=out,
                                sm_scale=o.sm_scale, alibi_slopes=o.alibi_slopes, sliding_window=o.sliding_window,
                                softcap=o.softcap, sinks=o.sinks)


def compiled_on(device: torch.device):
    """Kernels in Triton's in-process cache for ``device`` (None where Triton's cache cannot be read)."""
    try:
        from pagedprefill.triton.kernel import prefix_prefill_kernel

        caches = prefix_prefill_kernel.device_caches
        return len(caches[device.index][0]) if device.index in caches else 0
    except Exception:
        return None


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tensors_on_another_device_compute_there(name, two_gpus, gpu_backend):
    dev0, dev1 = two_gpus
    torch.cuda.set_device(dev0)
    p0 = make_problem(SPECS[name], dev0)
    want = call(p0)
    p1 = moved(p0, dev1)
    compiled_before = compiled_on(dev1)
    got = call(p1)  # the current device stays cuda:0
    torch.cuda.synchronize(dev1)
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    assert got.device == dev1
    assert torch.equal(got.cpu(), want.cpu()), "cuda:1 computed other bits than cuda:0"
    atol, rtol = DEFAULT_TOLERANCES[p1.q.dtype]
    assert_matches_reference(got, p1, atol, rtol, label=f"cuda:1/{name}")
    if compiled_before is not None:  # this spec's kernel was compiled for, and launched on, cuda:1
        assert compiled_on(dev1) > compiled_before, "no kernel was compiled for cuda:1"
    print(f"{pp.select_backend(dev1).name}/{name}: cuda:1 with cuda:0 current matches cuda:0 bit for bit")


CALLS_PER_THREAD = 150


def test_two_threads_drive_two_gpus_concurrently(two_gpus, gpu_backend):
    """One thread per GPU, many calls each, at the same time; neither thread sets its current device, so the
    cuda:1 thread also relies on the launch following the tensors."""
    specs = [SPECS["fp16_nhd_gqa"], SPECS["bf16_split_fp8_tensor_scales_features"],
             SPECS["fp16_nhd_gqa"].replace(seed=9, sliding_window=64, layout="split")]
    work = {}
    for dev in two_gpus:
        problems = [make_problem(spec, dev) for spec in specs]
        work[dev] = [(p, call(p)) for p in problems]  # expected results, computed (and compiled) beforehand
        torch.cuda.synchronize(dev)
    barrier = threading.Barrier(len(work))
    errors: list[str] = []
    done = {dev: 0 for dev in work}

    def drive(dev):
        try:
            barrier.wait(timeout=60)
            for i in range(CALLS_PER_THREAD):
                problem, expected = work[dev][i % len(work[dev])]
                out = call(problem)
                if not torch.equal(out, expected):
                    errors.append(f"{dev} call {i}: result differs from the single-threaded one")
                done[dev] += 1
            torch.cuda.synchronize(dev)
        except Exception as exc:  # reported below, with the device
            errors.append(f"{dev}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=drive, args=(dev,), name=f"prefill-{dev}") for dev in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 600 s"
    assert not errors, "\n".join(errors[:10])
    assert all(n == CALLS_PER_THREAD for n in done.values()), done
    for dev, items in work.items():
        for problem, expected in items:
            atol, rtol = DEFAULT_TOLERANCES[problem.q.dtype]
            assert_matches_reference(expected, problem, atol, rtol, label=str(dev))
    print(f"2 threads x {CALLS_PER_THREAD} calls on {', '.join(map(str, work))}: all bit-identical to serial calls")


def test_backend_is_selected_per_device(gpu, gpu_backend):
    """Each GPU gets the highest-priority backend that supports it, the same whether it is named or current."""
    forced = pp.ENV_BACKEND in os.environ
    names = []
    for index in range(torch.cuda.device_count()):
        dev = torch.device("cuda", index)
        info = pp.DeviceInfo.detect(dev)
        chosen = pp.select_backend(dev)
        assert info.index == index
        assert chosen.supports(info) == [], f"{chosen.name} was selected for {info.describe()} but refuses it"
        assert pp.select_backend(dev) is chosen  # cached per device
        with torch.cuda.device(dev):
            assert pp.select_backend().name == chosen.name  # the current device
        if not forced:
            supporting = [b for b in pp.available_backends() if not b.supports(info)]
            assert chosen.priority == max(b.priority for b in supporting)
        names.append(chosen.name)
        print(f"cuda:{index}: {info.describe()} -> {chosen.name}")
    same_model = len({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}) == 1
    if same_model:
        assert len(set(names)) == 1, f"identical GPUs selected different backends: {names}"
