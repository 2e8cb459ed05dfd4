"""An independent float64 computation of a problem, through torch's ``scaled_dot_product_attention``.

The demo compares a backend against it, so that even the ``reference`` backend is checked against
something other than itself: the attention math here is PyTorch's own; only the cache gather
(:func:`pagedprefill.gather_kv`, tested on its own) is shared with the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import gather_kv, scale_value
from ..types import PrefillProblem

#: Upper bound of mask elements built at once (queries are processed in chunks below it).
MAX_MASK_ELEMENTS = 1 << 25


def sdpa_float64(problem: PrefillProblem) -> torch.Tensor:
    """``problem``'s output ``[T, H, D]`` in float64, one sequence at a time with
    ``torch.nn.functional.scaled_dot_product_attention``; rows of tokens outside every sequence, and of
    sequences that ``skip_decode`` skips, are zeros.

    Covers GQA/MQA, ``sm_scale``, ALiBi, sliding windows, ``causal=False``, ``k = v = None`` (new tokens'
    keys/values read from the cache) and an FP8 ``q`` with its ``q_scale``. With ``fp8_out_scale`` the values
    are those before the FP8 output rounding. Logit soft-capping and sinks have no counterpart in
    ``scaled_dot_product_attention``, so a problem using them raises ``ValueError``.
    """
    p, opts = problem, problem.options
    if opts.softcap or opts.sinks is not None:
        raise ValueError("sdpa_float64: softcap and sinks have no counterpart in scaled_dot_product_attention; "
                         "compare such problems with pagedprefill.reference_prefill instead")
    b = p.batch
    out = torch.zeros(p.q.shape, dtype=torch.float64, device=p.device)
    rows = zip(b.seq_lens.tolist(), b.context_lengths().tolist(), b.query_start.tolist())
    for i, (seq_len, ctx, start) in enumerate(rows):
        n = seq_len - ctx
        if n > 0 and not (opts.skip_decode and n == 1):
            out[start:start + n] = _sequence(p, i, ctx, start, n)
    return out


def _sequence(p: PrefillProblem, i: int, ctx: int, start: int, n: int) -> torch.Tensor:
    """Output ``[n, H, D]`` of the ``n`` new tokens of sequence ``i`` (``ctx`` cached tokens before them)."""
    group = p.num_heads // p.num_kv_heads
    seq_len = ctx + n
    if p.kv_in_cache:  # k = v = None: the new tokens' keys/values are in the cache after the context
        keys, values = gather_kv(p.cache, p.batch.block_table[i], seq_len, torch.float64)
    else:
        k_ctx, v_ctx = gather_kv(p.cache, p.batch.block_table[i], ctx, torch.float64)
        keys = torch.cat([k_ctx, p.k[start:start + n].double()])
        values = torch.cat([v_ctx, p.v[start:start + n].double()])
    # [H, S, D]: the cached tokens, then the new ones; each KV head serves `group` query heads
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    chunk = max(1, MAX_MASK_ELEMENTS // max(1, p.num_heads * seq_len))
    q_scale = scale_value(p.options.q_scale)  # an FP8 q holds q / q_scale (1.0 for any other q)
    parts = []
    for q0 in range(0, n, chunk):
        q1 = min(n, q0 + chunk)
        query = p.q[start + q0:start + q1].double().transpose(0, 1) * q_scale  # [H, rows, D]
        mask = _additive_mask(p, ctx + q0, ctx + q1, seq_len)
        parts.append(F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=p.sm_scale))
    return torch.cat(parts, dim=1).transpose(0, 1)


def _additive_mask(p: PrefillProblem, first: int, last: int, seq_len: int) -> torch.Tensor:
    """``[H, last - first, seq_len]`` float64 logit bias for query positions ``first..last - 1``: ``-inf``
    where the causal mask (unless ``causal=False``) or the window hides a key, ALiBi's
    ``slope * (key_pos - query_pos)`` elsewhere."""
    query_pos = torch.arange(first, last, device=p.device)
    key_pos = torch.arange(seq_len, device=p.device)
    distance = (query_pos[:, None] - key_pos[None, :]).double()  # [rows, S]
    visible = distance >= 0 if p.options.causal else torch.ones_like(distance, dtype=torch.bool)
    window = p.options.sliding_window
    if window is not None:
        visible &= distance < window
    bias = torch.zeros((p.num_heads, *distance.shape), dtype=torch.float64, device=p.device)
    slopes = p.options.alibi_slopes
    if slopes is not None:
        bias = bias - slopes.double()[:, None, None] * distance[None]
    return bias.masked_fill(~visible[None], float("-inf"))
