"""Memory safety with corrupt metadata and ``validate="basic"`` on the GPU, for every Triton backend the GPU
offers (see :mod:`pagedprefill.testing.memory_safety`): block numbers far past the cache or negative, decreasing
or negative starts, lengths past the block table or past q, ``seq_len < ctx_len``. Canary regions around q, k, v,
the caches, the metadata, the ALiBi slopes, the sinks and out stay unchanged, every element of out is finite (no
guard was read), ``validate="full"`` rejects each variant, and afterwards a valid call on the same backend
matches the reference: the CUDA context survived.

The same check runs in every backend's conformance suite (``test_corrupt_metadata_stays_in_bounds``), so in
Triton's interpreter on the CPU in CI.
"""

from __future__ import annotations

import pagedprefill as pp
import pytest
import torch
from pagedprefill.features import missing_features
from pagedprefill.testing import make_problem
from pagedprefill.testing.memory_safety import LARGE, SPECS, check_corrupt_metadata


@pytest.mark.parametrize("batch", [*sorted(SPECS), "large"])
def test_corrupt_metadata_stays_in_bounds_and_the_context_survives(batch, gpu, offered_backend):
    spec = LARGE if batch == "large" else SPECS[batch]
    info = pp.DeviceInfo.detect(gpu)
    missing = missing_features(offered_backend, make_problem(spec, gpu))
    if missing:
        pytest.skip(f"backend {offered_backend.name!r} does not support {sorted(missing)}")
    checked = check_corrupt_metadata(offered_backend, info, gpu, spec, label=f"{offered_backend.name}/{batch}")
    torch.cuda.synchronize(gpu)
    assert len(checked) >= 13
    print(f"{offered_backend.name}/{batch}: {len(checked)} corrupt metadata variants stayed in bounds")
