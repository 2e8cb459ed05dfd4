"""The public entry points.

* :func:`context_attention_fwd`: drop-in for the classic prefix-prefill function (positional signature and
  semantics kept; writes ``o``), with keyword extras.
* :func:`prefill_attention`: the typed native API (:class:`BatchMetadata` + :class:`PagedKVCache`).
* :func:`pagedprefill.vllm.context_attention_fwd` (module :mod:`pagedprefill.vllm`): the current serving
  engine signature.

All build a :class:`PrefillProblem`, validate it, pick a backend for the tensors' device and run it. While
``torch.compile`` traces them they call the custom operator ``torch.ops.pagedprefill.prefill_attention_``
instead (one graph node, no graph break; see :mod:`pagedprefill.ops`), which runs the same dispatch
(:mod:`pagedprefill.runtime`, which also holds the registry functions re-exported here). What they share on
the way is :mod:`pagedprefill.calls`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .calls import dispatch_or_record, drop_in_window
from .runtime import (  # those in __all__ re-exported: they have always been importable from here
    BackendChoice,
    available_backends,
    dispatch,
    get_registry,
    new_output,
    reset_registry,
    select_backend,
)
from .types import BatchMetadata, PagedKVCache, PrefillProblem, ScaleLike
from .validation import DROP_IN_NAMES, ValidateMode

__all__ = ["BackendChoice", "available_backends", "context_attention_fwd", "dispatch", "get_registry",
           "prefill_attention", "reset_registry", "select_backend"]


def prefill_attention(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cache: PagedKVCache,
    batch: BatchMetadata,
    *,
    sm_scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    causal: bool = True,
    skip_decode: bool = False,
    fp8_out_scale: Optional[ScaleLike] = None,
    q_scale: ScaleLike = 1.0,
    out: Optional[torch.Tensor] = None,
    backend: BackendChoice = None,
    validate: ValidateMode = "basic",
) -> torch.Tensor:
    """Prefix-prefill attention over a paged KV cache (native API).

    Args:
        q: ``[T, H, D]`` queries of the new tokens of all sequences, packed: float16, bfloat16, float32, or
            float8_e4m3fn quantised by the caller, whose descale is ``q_scale`` (the ``fp8_query`` feature;
            the call then computes in its other tensors' 16-bit type, see :attr:`PrefillProblem.dtype`).
        k, v: ``[T, Hkv, D]`` keys/values of the new tokens (``H % Hkv == 0``), or both None when they are
            already in the cache (positions ``context_lens[i] .. seq_lens[i] - 1``) and are read from there.
        cache: the paged cache holding each sequence's first ``context_lens[i]`` tokens.
        batch: per-sequence starts, lengths and block table.
        sm_scale, alibi_slopes, sliding_window, softcap, sinks, causal, skip_decode, fp8_out_scale, q_scale:
            see :class:`AttentionOptions`.
        out: optional ``[T, H, D]`` output tensor to write (allocated when None: in ``q``'s dtype, or
            ``float8_e4m3fn`` with ``fp8_out_scale``, or for an FP8 ``q`` in the 16-bit type of ``k`` or of an
            unquantised cache, else bfloat16; zero-filled with ``skip_decode``).
        backend: a backend name or instance; default chooses by device (see :func:`select_backend`).
        validate: ``"basic"`` (no host sync) or ``"full"`` (also checks metadata values). With ``"basic"``
            the metadata values are not checked by the Triton backends: invalid values (block numbers outside
            the cache, decreasing starts, lengths past the block table...) give unspecified values in the rows
            they concern, but never a read outside the input tensors or a write outside ``out``. ``"full"``
            copies the metadata to the host and raises a ``ValueError`` naming the argument instead. The
            ``reference`` backend always checks the values. See docs/reliability.md, "Memory safety".

    Returns:
        The output ``[T, H, D]``. Compile-safe: ``torch.compile(fullgraph=True)`` traces it as one operator.

    Raises:
        UnsupportedFeatureError: the backend does not run an option used (see :mod:`pagedprefill.features`).
    """
    if out is None and isinstance(q, torch.Tensor):
        out = new_output(q, fp8_out_scale, skip_decode, k, getattr(cache, "key", None))
    problem = PrefillProblem.build(
        q, k, v, out, cache, batch, sm_scale=sm_scale, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        softcap=softcap, sinks=sinks, causal=causal, skip_decode=skip_decode, fp8_out_scale=fp8_out_scale,
        q_scale=q_scale)
    return dispatch_or_record(problem, backend, validate)


def context_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    kv_cache_dtype: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    b_loc: torch.Tensor,
    b_start_loc: torch.Tensor,
    b_seq_len: torch.Tensor,
    b_ctx_len: torch.Tensor,
    max_input_len: Optional[int],
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    *,
    sm_scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    q_scale: ScaleLike = 1.0,
    backend: BackendChoice = None,
    validate: ValidateMode = "basic",
) -> torch.Tensor:
    """Drop-in prefix-prefill attention: the classic positional signature; writes and returns ``o``.

    ``k_cache`` is 5-D ``[blocks, Hkv, D // x, block_size, x]`` with 4-D ``v_cache``
    ``[blocks, Hkv, D, block_size]`` (the split layout), or 4-D ``[blocks, block_size, Hkv, D]`` for both
    (NHD). ``b_start_loc`` has ``B`` or ``B + 1`` entries. ``max_input_len`` is only a hint (the launch
    never depends on it). ``sliding_window`` of None or <= 0 means no window. ``k_scale``/``v_scale`` may
    be floats or 1-element tensors. Any ``x >= 1`` dividing the head size is accepted in the split K cache.
    Keyword extras: ``sm_scale`` (default ``1/sqrt(D)``), ``sinks``, ``softcap``, ``q_scale`` (the descale of
    an FP8 ``q``, see :func:`prefill_attention`), ``backend``, ``validate``
    (``"basic"``: invalid metadata values give unspecified rows but no access outside the tensors; ``"full"``:
    a ``ValueError`` naming the argument instead; see :func:`prefill_attention`).
    Compile-safe like :func:`prefill_attention`. The current serving-engine signature (no ``b_ctx_len``,
    with ``skip_decode``, ``fp8_out_scale``, ``causal``) is :func:`pagedprefill.vllm.context_attention_fwd`.
    """
    problem = PrefillProblem.from_tensors(
        q, k, v, o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, b_ctx_len, kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale, v_scale=v_scale, max_query_len=max_input_len, sm_scale=sm_scale,
        alibi_slopes=alibi_slopes, sliding_window=drop_in_window(sliding_window), softcap=softcap, sinks=sinks,
        q_scale=q_scale)
    return dispatch_or_record(problem, backend, validate, DROP_IN_NAMES)
