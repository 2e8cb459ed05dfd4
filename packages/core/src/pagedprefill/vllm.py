"""Drop-in for vLLM's current ``context_attention_fwd`` signature (``vllm/v1/attention/ops/prefix_prefill.py``).

::

    from pagedprefill.vllm import context_attention_fwd

    context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                          max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None,
                          sm_scale=None, skip_decode=False, fp8_out_scale=None, sinks=None,
                          is_block_table_ptr=False, causal=True)

Differences from the classic signature (:func:`pagedprefill.context_attention_fwd`): there is no
``b_ctx_len``; ``b_start_loc`` has ``B + 1`` entries and each sequence's context length is
``b_seq_len[i] - (b_start_loc[i + 1] - b_start_loc[i])``, which the kernels compute themselves (no host sync,
no PyTorch operation before the launch); ``max_seq_len`` is accepted and ignored (like ``max_input_len``, a
hint the launch never needs); and four options:

* ``skip_decode=True``: sequences with exactly one new token are left to a decode kernel; their rows of
  ``o`` are not written.
* ``fp8_out_scale``: a positive float or 1-element tensor; ``o`` has dtype ``float8_e4m3fn`` (or
  ``float8_e4m3fnuz``) and receives ``clamp(attention / fp8_out_scale)`` (as vLLM, which multiplies by
  ``1 / fp8_out_scale``).
* ``causal=False``: new tokens attend to every new token of their sequence (prefix-LM, encoders).
* ``k = v = None``: the new tokens' keys/values are already in the paged cache (written before attention)
  and are read from there; ``b_loc`` then covers each sequence's first ``b_seq_len[i]`` tokens.

``kv_cache_dtype`` may also name the model dtype (``"float16"``, ``"bfloat16"``, ``"float32"``, as vLLM's
tests pass it); that means an unquantised cache, like ``"auto"``. ``is_block_table_ptr=True`` (block-table
entries holding raw device addresses inside vLLM's own memory pool) is refused with ``ValueError``: it has
no meaning outside vLLM's memory manager; pass block numbers.

Which backends run the four options: see :mod:`pagedprefill.features` (the ``reference`` backend runs all of
them; a backend that does not raises :class:`~pagedprefill.UnsupportedFeatureError` naming the option).
The function is compile-safe like the rest of the public API.
"""

from __future__ import annotations

from typing import Optional

import torch

from .calls import dispatch_or_record, drop_in_window
from .runtime import BackendChoice
from .types import PrefillProblem, ScaleLike
from .validation import VLLM_NAMES, ValidateMode, dtype_name

__all__ = ["context_attention_fwd"]

#: ``kv_cache_dtype`` spellings that name the model dtype: an unquantised cache (same as ``"auto"``).
MODEL_DTYPE_NAMES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                     "float32": torch.float32, "float": torch.float32}


def _cache_dtype(kv_cache_dtype, k_cache) -> str:
    """Map a model-dtype name to ``"auto"`` (checking it against the cache); leave anything else as is."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype.lower() not in MODEL_DTYPE_NAMES:
        return kv_cache_dtype
    want = MODEL_DTYPE_NAMES[kv_cache_dtype.lower()]
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype != want:
        raise TypeError(f"kv_cache_dtype: {kv_cache_dtype!r} names an unquantised {dtype_name(want)} cache, but "
                        f"k_cache has dtype {dtype_name(k_cache.dtype)}; pass 'fp8', 'fp8_e4m3' or 'fp8_e5m2' for "
                        f"an FP8 cache")
    return "auto"


def context_attention_fwd(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    o: torch.Tensor,
    kv_cache_dtype: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    b_loc: torch.Tensor,
    b_start_loc: torch.Tensor,
    b_seq_len: torch.Tensor,
    max_seq_len: Optional[int],
    max_input_len: Optional[int],
    k_scale: ScaleLike,
    v_scale: ScaleLike,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    sm_scale: Optional[float] = None,
    skip_decode: bool = False,
    fp8_out_scale: Optional[ScaleLike] = None,
    sinks: Optional[torch.Tensor] = None,
    is_block_table_ptr: bool = False,
    causal: bool = True,
    *,
    softcap: float = 0.0,
    q_scale: ScaleLike = 1.0,
    backend: BackendChoice = None,
    validate: ValidateMode = "basic",
) -> None:
    """Prefix-prefill attention with vLLM's current ``context_attention_fwd`` signature; writes ``o``.

    Arguments are those of vLLM (see the module docstring for the semantics of each); ``k_cache`` may be the
    split layout ``[blocks, Hkv, D // x, block_size, x]`` with any ``x`` dividing ``D`` (with 4-D
    ``v_cache`` ``[blocks, Hkv, D, block_size]``) or NHD ``[blocks, block_size, Hkv, D]`` for both.
    Keyword-only extras: ``softcap``; ``q_scale``, the descale of a ``q`` the engine quantised to
    ``float8_e4m3fn`` with its layer's query scale; ``backend``, ``validate`` (as in
    :func:`pagedprefill.prefill_attention`:
    with the default ``"basic"`` invalid metadata values give unspecified rows of ``o`` but no access outside
    the tensors; ``"full"`` raises a ``ValueError`` naming the argument instead).

    Returns None, as vLLM's function does.

    Raises:
        ValueError: ``is_block_table_ptr=True``; ``b_start_loc`` without ``B + 1`` entries; any invalid input
            (the message names the argument).
        UnsupportedFeatureError: the selected backend does not run an option used.
    """
    if is_block_table_ptr:
        raise ValueError(
            "is_block_table_ptr: expected False, got True; block tables of raw device addresses belong to "
            "vLLM's own memory pool and have no meaning here: pass b_loc as block numbers"
        )
    # No b_ctx_len: the kernels derive each context length from b_seq_len and b_start_loc (context_lens None),
    # so a call runs no PyTorch operation before its launch.
    problem = PrefillProblem.from_tensors(
        q, k, v, o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, None,
        kv_cache_dtype=_cache_dtype(kv_cache_dtype, k_cache), k_scale=k_scale, v_scale=v_scale,
        max_query_len=max_input_len, sm_scale=sm_scale, alibi_slopes=alibi_slopes,
        sliding_window=drop_in_window(sliding_window), softcap=softcap, sinks=sinks, causal=causal,
        skip_decode=skip_decode, fp8_out_scale=fp8_out_scale, q_scale=q_scale)
    dispatch_or_record(problem, backend, validate, VLLM_NAMES)
    return None
