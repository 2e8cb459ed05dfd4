"""pagedprefill as an attention implementation of Hugging Face transformers' continuous batching.

::

    from pagedprefill.integrations.transformers import register

    register()                                           # adds "paged|pagedprefill" to AttentionInterface
    model.set_attn_implementation("paged|pagedprefill")  # or attn_implementation="paged|pagedprefill" at load
    outputs = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)

transformers is an optional extra (``pip install "pagedprefill[transformers]"``): this module imports without
it and says what to install when :func:`register` or the attention function is used.

What transformers (5.17) passes a paged attention function, as keywords after
``(module, query, key, value, attention_mask)``:

* ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``: the batch's ``T`` new tokens, packed (with
  CUDA graphs ``T`` is padded; the padding tokens belong to no sequence). ``attention_mask`` is None for this
  implementation (transformers builds masks only for ``paged|sdpa`` and ``paged|eager``; a mask given anyway
  is refused).
* ``scaling`` (``module.scaling``), ``dropout``; and from some models ``sliding_window``, ``s_aux`` (attention
  sinks, ``[H]``: GPT-OSS) and ``softcap`` (Gemma 2). Also ``position_ids``, ``logits_indices``,
  ``logits_processor_args``, ``use_cache``, which attention does not need.
* ``cache``: the ``PagedAttentionCache``. Its layers are grouped (one group per attention type, the layers of a
  group share block numbers); layer ``l`` of group ``g`` (``cache.layer_index_to_group_indices[l]``) stores
  keys in ``cache.key_cache[index in group]``, a contiguous ``[(num_blocks + 2) * block_size, Hkv, D]``
  tensor: page ``b`` holds slots ``b * block_size ..``, so the tensor viewed as
  ``[num_blocks + 2, block_size, Hkv, D]`` is pagedprefill's NHD layout without a copy. The two extra blocks
  are transformers' padding zone (a zeroed block read by padding, a block written by padding).
  ``cache.sliding_windows[l]`` is 1 for a full-attention layer, else the window ``W`` of a sliding layer,
  whose group keeps each sequence's last ``W`` tokens in a rolling buffer (absolute position ``p`` in slot
  ``p % W`` of the sequence's blocks).
* ``cu_seq_lens_q`` (``[B + 1]`` int32), ``cu_seq_lens_k`` and ``max_seqlen_q``/``max_seqlen_k`` (host ints),
  the last two dicts keyed by ``"full_attention"``/``"sliding_attention"`` when the model has both. Key
  lengths are ``cached + new`` for full attention and ``min(cached, W - 1) + new`` for sliding layers.
* ``write_index[g]``: the flat cache slot of each new token (padding tokens: the write-trash slot);
  ``read_index[g]``: per sequence (at ``cu_seq_lens_k``), the flat slot of each key it reads, in position
  order (full attention: positions ``0 .. cached + new - 1``; sliding: the last ``min(cached, W - 1)``
  cached positions, then a sentinel per new token). ``read_index[g]`` is empty when no sequence of the batch
  has cached tokens.
* ``block_table``: None, except in transformers' decode fast path (flash-attention implementations only), a
  ``[groups, B, max_blocks]`` table padded with -1, with ``write_index``/``read_index`` left empty.

What this implementation does: it writes the new keys/values at ``write_index``, builds each sequence's
block table on the device from the cache's own indices (the page of every ``block_size``-th position is the
slot ``read_index`` gives it, divided by the page size), and calls
:func:`pagedprefill.vllm.context_attention_fwd` with ``k = v = None`` (every key and value read from the
cache), through the registry: no host synchronisation, no gather of keys or values. A sliding layer is read
before its new tokens are written (they may overwrite slots of the rolling buffer its context still needs),
so its new keys/values are passed densely, and its pages are ``gcd(W, block_size)`` slots (the largest page
on which the rolling buffer is a plain block table). Anything pagedprefill cannot compute is refused with an
:class:`~pagedprefill.UnsupportedFeatureError` naming the model's setting.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Optional

import torch

from ..api import BackendChoice
from ..errors import BackendUnavailableError, UnsupportedFeatureError
from ..validation import MAX_HEAD_SIZE
from ..vllm import context_attention_fwd

__all__ = ["ATTN_IMPLEMENTATION", "INSTALL_HINT", "calls_on", "paged_attention_forward", "register"]

#: The name :func:`register` gives this implementation in ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "paged|pagedprefill"
#: What to install for this module.
INSTALL_HINT = 'pip install "pagedprefill[transformers]"'
#: The transformers releases whose continuous batching this module plugs into: 5.17. 5.18 reorganised the paged
#: cache's layer groups, and from 5.20 on continuous batching runs only transformers' own implementations
#: (``paged|eager``, ``sdpa`` and the flash ones) and refuses a registered one.
MIN_TRANSFORMERS = (5, 17)
MAX_TRANSFORMERS = (5, 17)

#: The backend every call names (None: the registry's choice for the tensors' device); set by :func:`register`.
_settings: dict = {"backend": None}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _transformers():
    """The transformers module, or an ImportError that says what to install."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            f"pagedprefill.integrations.transformers needs Hugging Face transformers "
            f">= {'.'.join(map(str, MIN_TRANSFORMERS))}, which is not installed: {INSTALL_HINT}") from err
    found = getattr(transformers, "__version__", "0")
    if not MIN_TRANSFORMERS <= _version(found) <= MAX_TRANSFORMERS:
        later = _version(found) > MAX_TRANSFORMERS
        raise ImportError(
            f"pagedprefill.integrations.transformers plugs into the continuous batching of transformers "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))}, found transformers {found}"
            + ("; later releases reorganised its paged cache (5.18) and run only their own attention "
               "implementations in continuous batching (5.20 and later)" if later else "")
            + f": {INSTALL_HINT}")
    return transformers


def register(backend: BackendChoice = None) -> str:
    """Add ``"paged|pagedprefill"`` to ``transformers.AttentionInterface`` and return that name (also as
    ``"pagedprefill"``, the name releases after 5.22 look the implementation up by).

    Then ``model.set_attn_implementation("paged|pagedprefill")`` (or ``attn_implementation=`` when loading)
    makes ``generate_batch`` and the continuous-batching manager run their attention through pagedprefill.
    Calling it again is harmless; ``backend`` (a backend name or instance, default: the registry's choice
    for the tensors' device, see :func:`pagedprefill.select_backend`) is the backend every call names, and
    the latest call's choice holds.

    Raises:
        ImportError: transformers (5.17 or later) is not installed; the message says to
            ``pip install "pagedprefill[transformers]"``.
    """
    transformers = _transformers()
    _settings["backend"] = backend
    # Later releases name paged implementations without the prefix (they strip "paged|" from a requested name):
    # both names lead here, whichever a release looks up.
    for name in (ATTN_IMPLEMENTATION, ATTN_IMPLEMENTATION.removeprefix("paged|")):
        transformers.AttentionInterface.register(name, paged_attention_forward)
    return ATTN_IMPLEMENTATION


@contextlib.contextmanager
def calls_on(backend: BackendChoice) -> Iterator[None]:
    """Within the block, every call of :func:`paged_attention_forward` names ``backend`` instead of
    :func:`register`'s choice; that choice again afterwards. With ``"reference"`` this runs a layer's attention
    on the float32-accumulating oracle, on the very inputs a model gave it, to check the backend's answer::

        out, _ = paged_attention_forward(module, q, k, v, None, **kwargs)
        with calls_on("reference"):
            expected, _ = paged_attention_forward(module, q, k, v, None, **kwargs)

    (writing the step's keys and values into the cache twice writes the same values).
    """
    chosen = _settings["backend"]
    _settings["backend"] = backend
    try:
        yield
    finally:
        _settings["backend"] = chosen


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function :func:`register` adds: one layer's attention for a continuous-batching step.

    Arguments are those transformers passes a paged implementation (see the module docstring). Writes the
    new tokens' keys and values into ``kwargs["cache"]`` and returns ``(output [1, T, H, D], None)``, the
    layout of transformers' own paged implementations.

    Raises:
        ImportError: transformers is not installed (see :func:`register`).
        UnsupportedFeatureError: the model asks for something pagedprefill or the selected backend cannot
            compute; the message names the model's setting.
        ValueError: called without a paged cache (outside continuous batching).
    """
    cache = kwargs.get("cache")
    if cache is None:
        _transformers()
        raise ValueError(
            f"{ATTN_IMPLEMENTATION!r} was called without a paged attention cache: it runs inside continuous "
            f"batching (model.generate_batch, the continuous-batching manager), which passes the cache and its "
            f"indices; for a standard forward use another attn_implementation such as 'sdpa'")
    _check_layer(module, query, key, value, attention_mask, dropout)
    layer = module.layer_idx
    group, in_group = cache.layer_index_to_group_indices[layer]
    cache_window = int(cache.sliding_windows[layer])  # 1: a full-attention layer
    sliding = cache_window > 1
    window = _model_window(module, kwargs)
    if sliding and window != cache_window:
        raise UnsupportedFeatureError(
            f"{ATTN_IMPLEMENTATION}: layer {layer} is stored as a sliding-window layer of {cache_window} tokens "
            f"(config.sliding_window) but the model asks for sliding_window={window}; pagedprefill reads the "
            f"cache's rolling buffer with the window it was written for")

    cu_q = kwargs["cu_seq_lens_q"]
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        layer_type = "sliding_attention" if sliding else "full_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    q = query[0].transpose(0, 1)  # [T, H, D]: views, no copy
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    tokens = k.shape[0]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # rows of padding tokens stay finite
    flat_k, flat_v = cache.key_cache[in_group], cache.value_cache[in_group]
    q_lens = cu_q[1:] - cu_q[:-1]
    block_table = kwargs.get("block_table")

    if sliding:
        page = _gcd(cache_window, cache.block_size)
        read = kwargs["read_index"][group]
        if read.numel() == 0:  # no sequence has cached tokens: nothing to read from the cache
            seq_lens = q_lens
            table = torch.zeros((q_lens.shape[0], 1), dtype=torch.int32, device=q.device)
        else:
            # The context is the last min(cached, W - 1) tokens, the first entries of the sequence's read
            # index. A page of gcd(W, block_size) slots holds consecutive positions, so the block table is
            # exact once the positions start on a page boundary: the context is extended back to the start of
            # its first page (by its first slot's offset in that page), keys the window hides anyway.
            ctx = (cu_k[1:] - cu_k[:-1]) - q_lens
            first = read[cu_k[:-1].long().clamp(max=read.numel() - 1)]
            shift = torch.where(ctx > 0, first % page, torch.zeros_like(first)).to(torch.int32)
            seq_lens = ctx + shift + q_lens
            width = max(1, -(-(int(max_k) + page - 1) // page))
            table = _block_table(read, cu_k[:-1], ctx, page, width, shift)
        # Read before writing: the new tokens may overwrite rolling-buffer slots the context still needs.
        _call(module, q, k, v, out, _pages(flat_k, page), _pages(flat_v, page), table, cu_q, seq_lens, scaling,
              cache_window, kwargs)
        flat_k.index_copy_(0, kwargs["write_index"][group], k)
        flat_v.index_copy_(0, kwargs["write_index"][group], v)
        return out.unsqueeze(0), None

    page = cache.block_size
    if block_table is not None:
        # transformers' decode fast path: one new token per sequence, slots from its own block table.
        table = block_table[group].clamp(min=0)
        seq_lens = cu_k[1:] - cu_k[:-1]
        slots = _decode_slots(table, seq_lens, q_lens, page, cache.write_trash_index)
        rows = cu_q[:-1].long().clamp(max=max(tokens - 1, 0))
        flat_k.index_copy_(0, slots, k[rows])
        flat_v.index_copy_(0, slots, v[rows])
    else:
        write, read = kwargs["write_index"][group], kwargs["read_index"][group]
        flat_k.index_copy_(0, write, k)
        flat_v.index_copy_(0, write, v)
        # With no cached token in the batch, transformers passes no read index: the sequences' positions are
        # then exactly the slots just written, at the query starts.
        index, starts = (write, cu_q) if read.numel() == 0 else (read, cu_k)
        seq_lens = starts[1:] - starts[:-1]
        width = max(1, -(-int(max_k) // page))
        table = _block_table(index, starts[:-1], seq_lens, page, width)
    _call(module, q, None, None, out, _pages(flat_k, page), _pages(flat_v, page), table, cu_q, seq_lens, scaling,
          window, kwargs)
    return out.unsqueeze(0), None


def _gcd(a: int, b: int) -> int:
    """``math.gcd``, in Python: ``torch.compile`` traces it (it leaves ``math.gcd`` out of a graph)."""
    while b:
        a, b = b, a % b
    return a


def _pages(flat: torch.Tensor, page: int) -> torch.Tensor:
    """A layer's flat cache ``[slots, Hkv, D]`` as NHD pages ``[slots // page, page, Hkv, D]`` (a view)."""
    return flat.view(-1, page, flat.shape[1], flat.shape[2])


def _block_table(index: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, page: int, width: int,
                 shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, width]`` int32 page numbers, on the device: ``index[starts[i] + p]`` is the flat slot of position
    ``p`` of sequence ``i`` (``p < lengths[i]``), and entry ``j`` is the page holding position
    ``j * page - shift[i]`` (clamped into the sequence; a sequence without positions gets any valid page)."""
    positions = torch.arange(width, device=index.device, dtype=torch.int64)[None, :] * page
    if shift is not None:
        positions = positions - shift.long()[:, None]
    last = (lengths.long() - 1).clamp(min=0)[:, None]
    positions = torch.minimum(positions, last).clamp(min=0)
    at = (starts.long()[:, None] + positions).clamp(max=index.numel() - 1)
    return torch.div(index[at], page, rounding_mode="floor").to(torch.int32)


def _decode_slots(table: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor, page: int,
                  trash: int) -> torch.Tensor:
    """The flat slot of each sequence's one new token (its last position) from a block table; ``trash`` for a
    padding sequence (no new token)."""
    position = (seq_lens.long() - 1).clamp(min=0)
    column = (position // page).clamp(max=table.shape[1] - 1)
    slot = table.long().gather(1, column[:, None]).squeeze(1) * page + position % page
    return torch.where(q_lens > 0, slot, torch.full_like(slot, trash))


def _model_window(module: torch.nn.Module, kwargs: dict) -> Optional[int]:
    """The window the model asks for (a keyword, else the module's attribute); None for none."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is None or isinstance(window, bool):
        return None
    window = int(window)
    return window if window > 0 else None


def _check_layer(module, query, key, value, attention_mask, dropout) -> None:
    """Refuse, naming the model's setting, a layer pagedprefill's attention does not compute."""
    where = f"{ATTN_IMPLEMENTATION}: layer {getattr(module, 'layer_idx', '?')} of {_model_name(module)}"
    if attention_mask is not None:
        raise UnsupportedFeatureError(
            f"{where} was given an attention mask; pagedprefill computes the causal mask (and the window) from "
            f"the cache's lengths and applies no mask tensor (transformers builds none for "
            f"{ATTN_IMPLEMENTATION}: a model that builds its own, e.g. for bidirectional spans, is not supported)")
    if dropout:
        raise UnsupportedFeatureError(
            f"{where} asks for attention dropout {dropout} (config.attention_dropout in training mode); "
            f"pagedprefill computes inference attention: call model.eval()")
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedFeatureError(
            f"{where} is not causal (module.is_causal=False); continuous batching with pagedprefill runs "
            f"causal decoders")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"{where}: expected the packed query [1, num_heads, tokens, head_dim] continuous "
                         f"batching passes, got shape {list(query.shape)}")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise UnsupportedFeatureError(
            f"{where} has query/key head_dim {query.shape[-1]}/{key.shape[-1]} and value head_dim "
            f"{value.shape[-1]} (e.g. config.v_head_dim); pagedprefill needs one head_dim for all three")
    if query.shape[-1] > MAX_HEAD_SIZE:
        raise UnsupportedFeatureError(
            f"{where} has head_dim {query.shape[-1]} (config.head_dim); pagedprefill runs head sizes up to "
            f"{MAX_HEAD_SIZE}")
    if query.shape[1] % key.shape[1] != 0:
        raise UnsupportedFeatureError(
            f"{where} has {query.shape[1]} query heads and {key.shape[1]} key/value heads "
            f"(config.num_attention_heads, config.num_key_value_heads): GQA needs the first a multiple of the "
            f"second")


def _model_name(module) -> str:
    config = getattr(module, "config", None)
    return type(config).__name__ if config is not None else type(module).__name__


def _call(module, q, k, v, out, k_pages, v_pages, table, cu_q, seq_lens, scaling, window, kwargs) -> None:
    """The engine-form call, with backend refusals restated in terms of the model's settings. ``max_seq_len``
    and ``max_input_len`` are hints the launch never needs: None, which also keeps a symbolic
    ``max_seqlen_q`` (under ``torch.compile`` with dynamic shapes) out of the call."""
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap") or 0.0
    sm_scale = scaling if scaling is not None else getattr(module, "scaling", None)
    try:
        context_attention_fwd(
            q, k, v, out, "auto", k_pages, v_pages, table, cu_q, seq_lens.to(torch.int32), None, None, 1.0, 1.0,
            sliding_window=window, sm_scale=float(sm_scale) if sm_scale is not None else None, sinks=sinks,
            softcap=float(softcap), backend=_settings["backend"])
    except (UnsupportedFeatureError, BackendUnavailableError) as err:
        used = [f"sliding_window={window}" if window else "",
                "attention sinks (the model's s_aux)" if sinks is not None else "",
                f"softcap={softcap} (config.attn_logit_softcapping)" if softcap else "",
                f"head_dim={q.shape[-1]}", f"{q.shape[1]} query heads / {k_pages.shape[2]} key-value heads",
                f"dtype {str(q.dtype).removeprefix('torch.')}"]
        raise type(err)(
            f"{ATTN_IMPLEMENTATION}: layer {getattr(module, 'layer_idx', '?')} of {_model_name(module)} "
            f"({', '.join(u for u in used if u)}) cannot run here: {err}") from err
