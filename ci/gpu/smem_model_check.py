"""Compare the shared-memory model of TileConfig with what Triton allocates for compiled kernels (GPU).

Prints one row per (config, head size, dtype): modelled bytes, Triton's ``metadata.shared``, and whether
the model is an upper bound. Usage: ``python ci/gpu/smem_model_check.py [out.json]``.
"""

import json
import sys

import torch
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.tiling import TileConfig
from pagedprefill.triton.launch import launch_prefill

CONFIGS = [
    TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=1),
    TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=1),
    TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1),
]
rows = []
for dtype in (torch.float16, torch.float32):
    for d in (64, 128, 256):
        spec = BatchSpec(query_lens=(70, 3), context_lens=(100, 33), num_heads=4, num_kv_heads=2, head_size=d,
                         block_size=16, dtype=dtype)
        problem = make_problem(spec, "cuda")
        elem = problem.q.element_size()
        for cfg in CONFIGS:
            model = cfg.shared_mem_bytes(d, elem)
            try:
                kernel = launch_prefill(problem, cfg)
                actual = int(kernel.metadata.shared)
            except Exception as exc:
                actual = f"{type(exc).__name__}"
            rows.append({"dtype": str(dtype), "head_size": d, **cfg.to_dict(), "model": model, "triton": actual})
            ok = isinstance(actual, int) and actual <= model
            print(f"{str(dtype):15} d{d:<4} m{cfg.block_m:<4} n{cfg.block_n:<4} w{cfg.num_warps} s{cfg.num_stages} "
                  f"model {model:7d}  triton {actual!s:>7}  {'upper bound' if ok else 'UNDER'}")
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
