"""A small model around the custom operators, for the tests that compile one with ``torch.compile``.

:class:`AttentionBlock` is what a model's attention layer does with pagedprefill: project hidden states to
q/k/v, attend over the paged cache, project the result back. :func:`block_inputs` draws its inputs (hidden
states plus a random batch's cache and metadata); :meth:`AttentionBlock.eager_twin` is the same block calling
the Python API, the eager result a compiled block is compared with.
"""

from __future__ import annotations

from typing import Union

import torch

from ..api import prefill_attention
from ..types import BatchMetadata, PagedKVCache
from ..workloads import BatchSpec, make_problem

DeviceLike = Union[str, torch.device, None]


class AttentionBlock(torch.nn.Module):
    """Hidden states -> q/k/v -> paged prefix-prefill attention -> output projection.

    ``mode``: ``"op"`` calls the functional operator, ``"op_"`` the in-place one, ``"api"`` the Python API (the
    eager path). ``backend``: the backend's name, ``""`` to choose by device as the operators do. The weights
    and per-head buffers (ALiBi slopes, sinks: as ``spec`` asks) are drawn on the CPU from ``spec.seed``, so a
    block is the same on every device; ``hidden`` is the model's width.
    """

    def __init__(self, spec: BatchSpec, hidden: int = 48, mode: str = "op", backend: str = "",
                 device: DeviceLike = None):
        super().__init__()
        device = torch.device("cpu" if device is None else device)
        self.spec, self.hidden, self.mode, self.backend, self.device = spec, hidden, mode, backend, device
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_size
        gen = torch.Generator().manual_seed(spec.seed + 100)
        self.qkv = torch.nn.Linear(hidden, (H + 2 * Hkv) * D, dtype=spec.dtype, device=device)
        self.proj = torch.nn.Linear(H * D, hidden, dtype=spec.dtype, device=device)
        with torch.no_grad():
            for w in (self.qkv.weight, self.proj.weight):
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
        slopes = (torch.rand(H, generator=gen) * 0.5).to(device) if spec.alibi else None
        self.register_buffer("alibi_slopes", slopes)
        self.register_buffer("sinks", torch.randn(H, generator=gen).to(device) if spec.sinks else None)

    def forward(self, x, k_cache, v_cache, block_table, query_start, seq_lens, context_lens, k_scale, v_scale):
        """The block's output for hidden states ``x`` ``[T, hidden]`` and a batch's cache and metadata (the
        scales as 1-element tensors), in the order :func:`block_inputs` returns them."""
        s = self.spec
        T = x.shape[0]
        q, k, v = self.qkv(x).split([s.num_heads * s.head_size, s.num_kv_heads * s.head_size,
                                     s.num_kv_heads * s.head_size], dim=-1)
        q = q.reshape(T, s.num_heads, s.head_size)
        k = k.reshape(T, s.num_kv_heads, s.head_size)
        v = v.reshape(T, s.num_kv_heads, s.head_size)
        if self.mode == "api":
            cache = PagedKVCache(k_cache, v_cache, s.layout, s.kv_cache_dtype, k_scale, v_scale)
            batch = BatchMetadata(query_start, seq_lens, context_lens, block_table)
            attn = prefill_attention(q, k, v, cache, batch, sm_scale=s.sm_scale, alibi_slopes=self.alibi_slopes,
                                     sliding_window=s.sliding_window, softcap=s.softcap, sinks=self.sinks,
                                     backend=self.backend or None)
        else:
            tensors = (k_cache, v_cache, block_table, query_start, seq_lens, context_lens)
            options = dict(layout=s.layout, kv_cache_dtype=s.kv_cache_dtype, k_scale_tensor=k_scale,
                           v_scale_tensor=v_scale, sm_scale=s.sm_scale or 0.0, sliding_window=s.sliding_window or 0,
                           softcap=s.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks, backend=self.backend)
            if self.mode == "op":
                attn = torch.ops.pagedprefill.prefill_attention(q, k, v, *tensors, **options)
            else:
                attn = torch.empty_like(q)
                torch.ops.pagedprefill.prefill_attention_(q, k, v, attn, *tensors, **options)
        return self.proj(attn.reshape(T, s.num_heads * s.head_size))

    def eager_twin(self) -> AttentionBlock:
        """This block with the same weights and backend, calling the Python API (``mode="api"``)."""
        twin = AttentionBlock(self.spec, self.hidden, mode="api", backend=self.backend, device=self.device)
        twin.load_state_dict(self.state_dict())
        return twin


def block_inputs(spec: BatchSpec, hidden: int = 48, device: DeviceLike = None, seed: int = 0) -> tuple:
    """Random hidden states ``[T, hidden]`` plus the cache and metadata of ``spec``'s random batch on ``device``
    (the scales as 1-element tensors): the arguments of :meth:`AttentionBlock.forward`. ``seed`` draws other
    hidden states for the same batch."""
    device = torch.device("cpu" if device is None else device)
    p = make_problem(spec, device)
    c, b = p.cache, p.batch
    gen = torch.Generator().manual_seed(spec.seed + 200 + seed)
    x = torch.randn(p.num_tokens, hidden, generator=gen).to(device, spec.dtype)
    k_scale = _scale_tensor(c.k_scale, device)
    v_scale = _scale_tensor(c.v_scale, device)
    return x, c.key, c.value, b.block_table, b.query_start, b.seq_lens, b.context_lens, k_scale, v_scale


def _scale_tensor(scale, device: torch.device) -> torch.Tensor:
    return scale if isinstance(scale, torch.Tensor) else torch.tensor([float(scale)], device=device)


__all__ = ["AttentionBlock", "block_inputs"]
