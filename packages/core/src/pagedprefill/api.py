"""The two public entry points and the dispatch they share.

* :func:`context_attention_fwd`: drop-in for the classic prefix-prefill function (positional signature and
  semantics kept; writes ``o``), with keyword extras.
* :func:`prefill_attention`: the typed native API (:class:`BatchMetadata` + :class:`PagedKVCache`).

Both build a :class:`PrefillProblem`, validate it, pick a backend for the tensors' device and run it.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import torch

from .device import DeviceInfo, DeviceLike
from .registry import Backend, Registry
from .types import (
    AttentionOptions,
    BatchMetadata,
    KVCacheDType,
    KVLayout,
    PagedKVCache,
    PrefillProblem,
    ScaleLike,
)
from .validation import DROP_IN_NAMES, NATIVE_NAMES, ArgumentNames, ValidateMode, validate_problem

BackendChoice = Union[str, Backend, None]

_registry: Optional[Registry] = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry: core's reference backend plus every installed plugin."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                from .backends import reference

                _registry = Registry(builtins=[reference])
    return _registry


def reset_registry() -> None:
    """Forget discovered plugins and cached choices (plugins are discovered again on next use)."""
    global _registry
    with _registry_lock:
        _registry = None


def select_backend(device: Union[DeviceLike, DeviceInfo] = None, backend: BackendChoice = None) -> Backend:
    """The backend that runs on ``device`` (default: the current device), following the selection rules.

    ``device`` may be a torch device (or index/string) or a hand-written :class:`DeviceInfo`.
    Raises :class:`~pagedprefill.BackendUnavailableError` with every backend's reasons when none fits.
    """
    info = device if isinstance(device, DeviceInfo) else DeviceInfo.detect(device)
    return get_registry().select(info, backend)


def available_backends() -> list[Backend]:
    """Every discovered backend, highest priority first (whether or not it supports this device)."""
    return get_registry().backends()


def dispatch(problem: PrefillProblem, backend: BackendChoice = None, validate: ValidateMode = "basic",
             names: ArgumentNames = NATIVE_NAMES) -> torch.Tensor:
    """Validate ``problem``, run it on the chosen backend, and return ``problem.out``.

    ``names`` is how errors name the arguments (the native names by default; ``DROP_IN_NAMES`` for
    :func:`context_attention_fwd`).
    """
    validate_problem(problem, validate, names)
    info = DeviceInfo.detect(problem.device)
    chosen = get_registry().select(info, backend)
    chosen.check_problem(problem, info)
    chosen.run(problem, info)
    return problem.out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    batch: BatchMetadata,
    *,
    sm_scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    backend: BackendChoice = None,
    validate: ValidateMode = "basic",
) -> torch.Tensor:
    """Prefix-prefill attention over a paged KV cache (native API).

    Args:
        q: ``[T, H, D]`` queries of the new tokens of all sequences, packed.
        k, v: ``[T, Hkv, D]`` keys/values of the new tokens (``H % Hkv == 0``).
        cache: the paged cache holding each sequence's first ``context_lens[i]`` tokens.
        batch: per-sequence starts, lengths and block table.
        sm_scale, alibi_slopes, sliding_window, softcap, sinks: see :class:`AttentionOptions`.
        out: optional ``[T, H, D]`` output tensor to write (allocated when None).
        backend: a backend name or instance; default chooses by device (see :func:`select_backend`).
        validate: ``"basic"`` (no host sync) or ``"full"`` (also checks metadata values).

    Returns:
        The output ``[T, H, D]`` in ``q``'s dtype.
    """
    if out is None and isinstance(q, torch.Tensor):
        out = torch.empty_like(q)
    problem = PrefillProblem(
        q=q, k=k, v=v, out=out, cache=cache, batch=batch,
        options=AttentionOptions(sm_scale=sm_scale, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                                 softcap=softcap, sinks=sinks),
    )
    return dispatch(problem, backend=backend, validate=validate)


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
    backend: BackendChoice = None,
    validate: ValidateMode = "basic",
) -> torch.Tensor:
    """Drop-in prefix-prefill attention: the classic positional signature; writes and returns ``o``.

    ``k_cache`` is 5-D ``[blocks, Hkv, D // x, block_size, x]`` with 4-D ``v_cache``
    ``[blocks, Hkv, D, block_size]`` (the split layout), or 4-D ``[blocks, block_size, Hkv, D]`` for both
    (NHD). ``b_start_loc`` has ``B`` or ``B + 1`` entries. ``max_input_len`` is only a hint (the launch
    never depends on it). ``sliding_window`` of None or <= 0 means no window. ``k_scale``/``v_scale`` may
    be floats or 1-element tensors. Keyword extras: ``sm_scale`` (default ``1/sqrt(D)``), ``sinks``,
    ``softcap``, ``backend``, ``validate``.
    """
    layout = KVLayout.SPLIT if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 5 else KVLayout.NHD
    cache = PagedKVCache(k_cache, v_cache, layout, KVCacheDType.parse(kv_cache_dtype), k_scale, v_scale)
    if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window <= 0:
        sliding_window = None
    batch = BatchMetadata(query_start=b_start_loc, seq_lens=b_seq_len, context_lens=b_ctx_len,
                          block_table=b_loc, max_query_len=max_input_len)
    problem = PrefillProblem(
        q=q, k=k, v=v, out=o, cache=cache, batch=batch,
        options=AttentionOptions(sm_scale=sm_scale, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                                 softcap=softcap, sinks=sinks),
    )
    return dispatch(problem, backend=backend, validate=validate, names=DROP_IN_NAMES)
