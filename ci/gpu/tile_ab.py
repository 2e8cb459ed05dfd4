"""Time a few TileConfigs of the shared kernel on two bench workloads (GPU), to compare policies.

Usage: ``python ci/gpu/tile_ab.py``. Prints ms and TFLOP/s per (workload, config); every config is
checked against the reference first.
"""

import torch
import triton.testing
from pagedprefill.bench import default_suite, flops
from pagedprefill.testing import DEFAULT_TOLERANCES, assert_matches_reference, fresh_output, make_problem
from pagedprefill.tiling import TileConfig
from pagedprefill.triton.launch import launch_prefill

CONFIGS = {
    "rule 128x64 w8 s3": TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "rule, page-wise": TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, pagewise=True),
    "128x32 w4 s2": TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=2),
    "128x64 w8 s2 gqa4": TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, heads_per_tile=4),
    "128x128 w8 s2": TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
    "64x64 w4 s3 gqa4": TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, heads_per_tile=4),
}
wanted = ("prefix-cached 8x", "long prefill", "many short")
for wl in [w for w in default_suite() if w.name.startswith(wanted)]:
    problem = make_problem(wl.spec, "cuda")
    f = flops(wl.spec)
    for name, cfg in CONFIGS.items():
        check = fresh_output(problem)
        launch_prefill(check, cfg)
        atol, rtol = DEFAULT_TOLERANCES[wl.spec.dtype]
        assert_matches_reference(check.out, check, atol, rtol, label=name)
        ms = triton.testing.do_bench(lambda c=cfg, pr=problem: launch_prefill(pr, c), warmup=25, rep=100,
                                     return_mode="median")
        print(f"{wl.name:<32} {name:<22} {ms:8.3f} ms {f / ms / 1e9:7.1f} TFLOP/s", flush=True)
    del problem
    torch.cuda.empty_cache()
