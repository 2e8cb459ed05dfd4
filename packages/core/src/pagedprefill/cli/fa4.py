"""FlashAttention-4's CuTe kernels (``flash_attn.cute``, pip ``flash-attn-4``) as a same-run peer of
``pagedprefill bench --suite engine``.

FA4 is no dependency of any pagedprefill package: :func:`load` imports it when the suite runs and says why
its columns are absent where it does not import. Both columns call ``flash_attn_varlen_func`` on the engine's
problem (k = v = None: the NHD cache holds every token, the new ones included), as a serving engine does:

* ``fa4``: on the paged cache itself (``[num_blocks, block, Hkv, D]``), with the problem's block table as
  ``page_table``, its sequence lengths as ``seqused_k`` and its query starts as ``cu_seqlens_q``;
* ``fa4 contig``: on each sequence's keys and values gathered beforehand into contiguous varlen tensors
  (``cu_seqlens_k``, no page table; the gather is not timed): the same kernel without pages.

``num_splits=0`` lets FA4's heuristic choose whether to split the keys, except on sm90, where its kernels split
none (4.0.0b36 raises "SplitKV not supported on SM 9.0" whenever the heuristic would): ``num_splits=1`` there,
so that the rows on which a split would help are timed as FA4 runs them on Hopper, not left out.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Callable, Optional

import torch

from ..cache import gather_kv
from ..types import PrefillProblem

#: The distribution that provides ``flash_attn.cute``.
DISTRIBUTION = "flash-attn-4"


def load() -> tuple[Optional[ModuleType], str]:
    """``(flash_attn.cute, a line naming it and its version)``, or ``(None, why the columns are absent)``."""
    try:
        module = importlib.import_module("flash_attn.cute")
    except Exception as exc:  # not installed, or a CUDA library it loads is missing: the peer is absent
        return None, (f"FA4 columns absent: flash_attn.cute does not import ({type(exc).__name__}: {exc}); "
                      f"pip install {DISTRIBUTION} to add them")
    return module, f"FA4 columns: flash_attn.cute from {DISTRIBUTION} {_version()}"


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # imported from a path without its metadata
        return "(version unknown)"


def unsupported(problem: PrefillProblem) -> Optional[str]:
    """Why FA4 cannot run ``problem`` like for like (None when it can): it takes the engine's form only, in
    fp16 or bf16 with no FP8 cache, and has none of the options that change the attention itself here."""
    o = problem.options
    reasons = []
    if not problem.kv_in_cache:
        reasons.append("it reads every key and value from the cache (k = v = None), the engine's form")
    if problem.cache.layout.value != "nhd":
        reasons.append("it reads the NHD cache only")
    if problem.q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"it computes in fp16 and bf16 only, not {problem.q.dtype}")
    if problem.cache.dtype.is_fp8:
        reasons.append("it has no FP8 cache on this path")
    if o.alibi_slopes is not None or o.sinks is not None or o.softcap or o.sliding_window is not None:
        reasons.append("the problem has ALiBi, sinks, softcap or a window, which this comparison leaves out")
    if o.skip_decode or o.fp8_out_scale is not None:
        reasons.append("the problem skips decode rows or writes an FP8 output")
    if problem.batch.query_start.shape[0] != problem.batch.num_seqs + 1:
        reasons.append("cu_seqlens_q needs B + 1 query starts")
    return "; ".join(reasons) or None


def _max(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def _common(problem: PrefillProblem) -> dict:
    """The keyword arguments both columns pass: the queries' varlen layout, the scale and the mask."""
    b = problem.batch
    return dict(cu_seqlens_q=b.query_start, max_seqlen_q=_max(b.query_start.diff()),
                max_seqlen_k=_max(b.seq_lens), softmax_scale=problem.sm_scale, causal=problem.options.causal,
                num_splits=num_splits(problem.device))


def num_splits(device: torch.device) -> int:
    """FA4's ``num_splits`` on ``device``: 1 on sm90, whose kernels split no keys (see the module docstring),
    else 0 (its heuristic)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return 1
    return 0


def _output(result) -> torch.Tensor:
    """The output tensor of a ``flash_attn_varlen_func`` result (``(out, lse)``, or ``out`` alone)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def paged_call(fa4: ModuleType, problem: PrefillProblem) -> Callable[[], torch.Tensor]:
    """The ``fa4`` column: one call on the paged cache holding every token; returns FA4's output."""
    b, c = problem.batch, problem.cache
    kwargs = dict(_common(problem), seqused_k=b.seq_lens, page_table=b.block_table)

    def call() -> torch.Tensor:
        return _output(fa4.flash_attn_varlen_func(problem.q, c.key, c.value, **kwargs))

    return call


def contiguous_call(fa4: ModuleType, problem: PrefillProblem) -> Callable[[], torch.Tensor]:
    """The ``fa4 contig`` column: one call on every sequence's keys and values gathered into contiguous
    ``[total keys, Hkv, D]`` tensors now (not in the call); returns FA4's output."""
    keys, values = _gathered(problem)
    b = problem.batch
    cu_seqlens_k = torch.zeros(b.num_seqs + 1, dtype=torch.int32, device=problem.device)
    cu_seqlens_k[1:] = torch.cumsum(b.seq_lens, 0)
    kwargs = dict(_common(problem), cu_seqlens_k=cu_seqlens_k)

    def call() -> torch.Tensor:
        return _output(fa4.flash_attn_varlen_func(problem.q, keys, values, **kwargs))

    return call


def _gathered(problem: PrefillProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values (all of them in the cache: the engine's form), one after the other."""
    b = problem.batch
    parts = [gather_kv(problem.cache, b.block_table[i], n, problem.q.dtype) for i, n in enumerate(b.seq_lens.tolist())]
    return torch.cat([k for k, _ in parts]).contiguous(), torch.cat([v for _, v in parts]).contiguous()
