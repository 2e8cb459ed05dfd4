"""The reference implementation: plain PyTorch, vectorised per sequence, accumulating in float32 or float64.

It is the test oracle of every backend, and what the built-in ``reference`` backend
(:mod:`pagedprefill.backends.reference`) runs, so ``import pagedprefill`` works on any device PyTorch
supports. It reads lengths on the host, so it synchronises with the device.

Semantics, shared by every backend:

* token ``i`` of a sequence with ``ctx`` cached tokens sits at position ``ctx + i``; it attends to cached
  positions ``[0, ctx)`` and new positions ``[ctx, ctx + i]`` (bottom-right aligned causal mask);
* logits ``s = sm_scale * (q . k)``; with ``softcap > 0``, ``s = softcap * tanh(s / softcap)``; with ALiBi,
  ``s += slope[h] * (key_pos - query_pos)``; with a window ``w > 0`` only keys with
  ``query_pos - key_pos < w`` are visible;
* with ``sinks``, ``exp(sinks[h])`` is added to the softmax denominator (the sink takes probability mass
  but contributes no value);
* a row with no visible key is all zeros (cannot happen with the causal mask and ``w >= 1``, since a token
  always sees itself, but defined anyway);
* ``causal=False``: a new token also sees the new tokens after it (every key of its sequence, the window
  still admitting only keys with ``query_pos - key_pos < w``);
* ``k = v = None``: the keys/values of positions ``[ctx, seq_len)`` are read from the paged cache too;
* ``skip_decode``: sequences with exactly one new token are skipped (their output rows are not written);
* ``fp8_out_scale``: the output is written as ``clamp(out / fp8_out_scale)`` to the FP8 range of ``out``.
"""

from __future__ import annotations

import torch

from .cache import gather_kv, scale_value
from .types import PrefillProblem

#: Upper bound of score elements materialised at once (queries are processed in chunks below it).
MAX_SCORE_ELEMENTS = 1 << 26


def reference_prefill(problem: PrefillProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Compute ``problem`` with PyTorch ops, write ``problem.out`` and return it."""
    p = problem
    H, Hkv = p.num_heads, p.num_kv_heads
    group = H // Hkv
    b = p.batch
    seq_lens = b.seq_lens.tolist()
    ctx_lens = b.context_lengths().tolist()
    starts = b.query_start.tolist()
    opts = p.options
    slopes = opts.alibi_slopes.to(compute_dtype) if opts.alibi_slopes is not None else None
    sinks = opts.sinks.to(compute_dtype) if opts.sinks is not None else None
    window = opts.sliding_window
    q_scale = scale_value(opts.q_scale)  # an FP8 q holds q / q_scale: its queries are the descaled values
    for i, (seq_len, ctx) in enumerate(zip(seq_lens, ctx_lens)):
        n = seq_len - ctx
        if n <= 0 or (opts.skip_decode and n == 1):
            continue
        s0 = starts[i]
        if p.kv_in_cache:
            keys, values = gather_kv(p.cache, b.block_table[i], seq_len, compute_dtype)
        else:
            k_ctx, v_ctx = gather_kv(p.cache, b.block_table[i], ctx, compute_dtype)
            keys = torch.cat([k_ctx, p.k[s0:s0 + n].to(compute_dtype)])
            values = torch.cat([v_ctx, p.v[s0:s0 + n].to(compute_dtype)])
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        key_pos = torch.arange(seq_len, device=p.device)
        chunk = max(1, MAX_SCORE_ELEMENTS // max(1, H * seq_len))
        for q0 in range(0, n, chunk):
            q1 = min(n, q0 + chunk)
            query = p.q[s0 + q0:s0 + q1].to(compute_dtype) * q_scale
            query_pos = ctx + torch.arange(q0, q1, device=p.device)
            out = _attend(query, keys, values, query_pos, key_pos, p.sm_scale, opts.softcap, slopes, sinks,
                          window, opts.causal)
            p.out[s0 + q0:s0 + q1] = _to_output(out, p.out.dtype, opts.fp8_out_scale)
    return p.out


def _to_output(out: torch.Tensor, dtype: torch.dtype, fp8_out_scale) -> torch.Tensor:
    """``out`` in the output dtype; with ``fp8_out_scale``, divided by it and clamped to the FP8 range."""
    if fp8_out_scale is None:
        return out.to(dtype)
    scale = fp8_out_scale.reshape(()).to(out) if isinstance(fp8_out_scale, torch.Tensor) else float(fp8_out_scale)
    limit = torch.finfo(dtype).max
    return (out / scale).clamp(-limit, limit).to(dtype)


def _attend(query, keys, values, query_pos, key_pos, sm_scale, softcap, slopes, sinks, window, causal=True):
    """Attention of ``query`` ``[n, H, D]`` over ``keys``/``values`` ``[S, H, D]`` with all options."""
    scores = torch.einsum("qhd,khd->hqk", query, keys) * sm_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    distance = query_pos[:, None] - key_pos[None, :]  # [n, S]
    if slopes is not None:
        scores = scores - slopes[:, None, None] * distance[None].to(scores.dtype)
    visible = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if window is not None:
        visible &= distance < window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [H, n, 1]
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks[:, None, None])
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks[:, None, None] - row_max)
    out = torch.einsum("hqk,khd->qhd", probs, values)
    denom = denom.permute(1, 0, 2)  # [n, H, 1]
    # Only a row with nothing visible (denominator exactly 0) is zeros; NaN/Inf from the inputs propagate.
    return torch.where(denom == 0, torch.zeros_like(out), out / torch.where(denom == 0, torch.ones_like(denom), denom))
