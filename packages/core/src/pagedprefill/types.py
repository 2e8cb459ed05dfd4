"""Typed descriptions of a prefix-prefill call: batch metadata, the paged KV cache, and options.

These are the objects of the native API (:func:`pagedprefill.prefill_attention`). The drop-ins and the custom
operators build the same objects from their positional arguments (:meth:`PrefillProblem.from_tensors`), and
every entry point's problem comes from one builder, :meth:`PrefillProblem.build`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .lengths import MAX_LENGTH, check_block_table, host_lengths
from .options import FEATURES, FP8_QUERY, KV_IN_CACHE, held_by
from .placement import require_device

__all__ = ["FEATURES", "AttentionOptions", "BatchMetadata", "KVCacheDType", "KVLayout", "PagedKVCache",
           "PrefillProblem", "ScaleLike"]

ScaleLike = Union[float, torch.Tensor]

#: Query dtypes of the FP8 query path (``fp8_query``): the caller quantised ``q`` and passes its ``q_scale``.
FP8_QUERY_DTYPES = (torch.float8_e4m3fn,)
#: The types a call with an FP8 ``q`` computes in (its output, new keys and values, unquantised cache).
FP8_QUERY_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


def fp8_query_compute_dtype(*tensors) -> torch.dtype:
    """The type a call with an FP8 ``q`` computes in: the first of ``tensors`` (tensors or None) in a
    :data:`FP8_QUERY_COMPUTE_DTYPES` type gives it, else bfloat16, which holds every FP8 value exactly."""
    return next((t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.dtype in FP8_QUERY_COMPUTE_DTYPES),
                torch.bfloat16)

#: ``(name, attribute, default)`` of the options the cache, the batch and the attention options hold, for
#: PrefillProblem's builders (read once: every call of the public functions builds a problem).
_CACHE_FIELDS, _BATCH_FIELDS, _OPTION_FIELDS = (tuple((o.name, o.attribute, o.default) for o in held_by(holder))
                                                for holder in ("cache", "batch", "options"))
#: The names :meth:`PrefillProblem.from_tensors` takes.
_HELD_NAMES = frozenset(name for fields in (_CACHE_FIELDS, _BATCH_FIELDS, _OPTION_FIELDS) for name, _, _ in fields)
#: The names :meth:`PrefillProblem.build` takes: the options :class:`AttentionOptions` holds, each by the name of
#: its field.
_OPTION_NAMES = frozenset(name for name, attribute, _ in _OPTION_FIELDS if name == attribute)


class KVLayout(str, enum.Enum):
    """Memory layout of a paged KV cache.

    ``SPLIT`` is the layout of the original prefix-prefill kernel: K is 5-D
    ``[num_blocks, Hkv, D // x, block_size, x]`` and V is 4-D ``[num_blocks, Hkv, D, block_size]``. Any
    ``x >= 1`` dividing ``D`` is accepted (read from the shape; strides decide the addressing);
    :func:`~pagedprefill.allocate_cache` picks ``x`` elements making 16 bytes by default.

    ``NHD`` is ``[num_blocks, block_size, Hkv, D]`` for both K and V.
    """

    SPLIT = "split"
    NHD = "nhd"

    def __str__(self) -> str:  # the spelling callers write, in messages and table keys
        return self.value

    __format__ = str.__format__


class KVCacheDType(str, enum.Enum):
    """How cache elements are stored: in the model dtype, or as FP8 bytes (``uint8``) with a scale."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    def __str__(self) -> str:  # the spelling callers write, in messages and table keys
        return self.value

    __format__ = str.__format__

    @classmethod
    def parse(cls, value: Union[str, KVCacheDType]) -> KVCacheDType:
        """Accept the spellings used by serving engines: ``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"kv_cache_dtype: expected a str such as 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', "
                f"got {type(value).__name__}"
            )
        try:
            return _KV_CACHE_DTYPE_NAMES[value.lower()]
        except KeyError:
            raise ValueError(
                f"kv_cache_dtype: expected one of {sorted(_KV_CACHE_DTYPE_NAMES)}, got {value!r}"
            ) from None

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDType.AUTO

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The float8 dtype the stored bytes are reinterpreted as, or None for ``auto``."""
        return {
            KVCacheDType.AUTO: None,
            KVCacheDType.FP8_E4M3: torch.float8_e4m3fn,
            KVCacheDType.FP8_E5M2: torch.float8_e5m2,
        }[self]


#: The spellings of :meth:`KVCacheDType.parse` (lower case).
_KV_CACHE_DTYPE_NAMES = {"auto": KVCacheDType.AUTO, "fp8": KVCacheDType.FP8_E4M3, "fp8_e4m3": KVCacheDType.FP8_E4M3,
                         "fp8_e5m2": KVCacheDType.FP8_E5M2}


@dataclass(frozen=True)
class BatchMetadata:
    """Where each sequence of the batch lives.

    Attributes:
        query_start: ``[B]`` or ``[B + 1]`` int tensor, offset of each sequence's first new token in the
            packed ``q``/``k``/``v``/output tensors (sequences are packed in order).
        seq_lens: ``[B]`` int tensor, ``context + new`` tokens of each sequence.
        context_lens: ``[B]`` int tensor, cached tokens of each sequence (may be 0); or None: derived from the
            others, ``seq_lens[i] - (query_start[i + 1] - query_start[i])``, which needs ``B + 1`` starts (the
            kernels compute it themselves, so a call builds no tensor for it). Read it through
            :meth:`context_lengths`, which gives a tensor either way.
        block_table: ``[B, max_blocks_per_seq]`` int tensor, physical cache block of each logical block.
        max_query_len: optional host int, an upper bound of the new tokens of any sequence. Never
            required: kernels size their grid from tensor shapes and never read lengths on the host.
    """

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: Optional[torch.Tensor]
    block_table: torch.Tensor
    max_query_len: Optional[int] = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def context_lengths(self) -> torch.Tensor:
        """The ``[B]`` context lengths as a tensor: :attr:`context_lens` when given, else derived on the
        device (no host sync) as ``seq_lens[i] - (query_start[i + 1] - query_start[i])``, in ``seq_lens``' dtype.

        A derived tensor costs PyTorch operations on every call: the kernels never need it, only code that reads
        the lengths on the host (the reference, the value checks, the test oracles) and the custom operators.

        Raises:
            ValueError: the lengths are derived but ``query_start`` does not have ``B + 1`` entries.
        """
        if self.context_lens is not None:
            return self.context_lens
        B = self.num_seqs
        if self.query_start.dim() != 1 or self.query_start.shape[0] != B + 1:
            raise ValueError(f"query_start: expected shape [{B + 1}] (num_seqs + 1 entries: context lengths are "
                             f"derived from consecutive starts), got {list(self.query_start.shape)}")
        return (self.seq_lens - self.query_start.diff()).to(self.seq_lens.dtype)

    @classmethod
    def from_lengths(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_table: torch.Tensor,
        device: Union[str, torch.device, None] = None,
    ) -> BatchMetadata:
        """Build metadata from host lists of new-token and context lengths (a convenience for tests/tools).

        ``query_lens`` and ``context_lens`` give one length per sequence (lists or tuples of ints >= 0, or 1-D
        integer tensors), in the order of ``block_table``'s rows; ``block_table`` is a
        ``[num_seqs, max_blocks_per_seq]`` int32/int64 tensor. ``device`` (default: the block table's) must be
        one this process can use. Each is checked here, and an error names the argument as written
        (``query_lens[1]``), not the offsets derived from it.
        """
        query_lens = host_lengths("query_lens", query_lens)
        context_lens = host_lengths("context_lens", context_lens)
        if len(context_lens) != len(query_lens):
            raise ValueError(f"context_lens: expected one length per sequence, as many as query_lens "
                             f"({len(query_lens)}), got {len(context_lens)}")
        for i, (new, cached) in enumerate(zip(query_lens, context_lens)):
            if new + cached > MAX_LENGTH:
                raise ValueError(f"context_lens[{i}]: expected query_lens[{i}] + context_lens[{i}] < 2**31, got "
                                 f"{new} + {cached}")
        if sum(query_lens) > MAX_LENGTH:
            raise ValueError(f"query_lens: expected fewer than 2**31 new tokens in all, got {sum(query_lens)}")
        check_block_table(block_table, len(query_lens))
        device = block_table.device if device is None else require_device("device", device)
        q = torch.tensor(query_lens, dtype=torch.int32)
        c = torch.tensor(context_lens, dtype=torch.int32)
        start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        start[1:] = torch.cumsum(q, 0)
        return cls(
            query_start=start.to(device),
            seq_lens=(q + c).to(device),
            context_lens=c.to(device),
            block_table=block_table.to(device),
            max_query_len=max(query_lens, default=0),
        )


@dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache in either :class:`KVLayout`, with its storage dtype and dequantisation scales.

    Attributes:
        key, value: the cache tensors (see :class:`KVLayout` for their shapes).
        layout: which layout ``key``/``value`` use.
        dtype: ``auto`` (stored in the model dtype) or an FP8 format (stored as ``uint8``).
        k_scale, v_scale: dequantisation scales for FP8 (a float, or a 0-d/1-element float tensor, which
            is read on the device without a host sync). Ignored for ``auto``.
    """

    key: torch.Tensor
    value: torch.Tensor
    layout: KVLayout = KVLayout.NHD
    dtype: KVCacheDType = KVCacheDType.AUTO
    k_scale: ScaleLike = 1.0
    v_scale: ScaleLike = 1.0

    def __post_init__(self) -> None:
        # Only strings are converted: calling an enum class with one of its members breaks the graph under
        # torch.compile on torch 2.11 (Dynamo traces it as a new object), and the builders pass members.
        if not isinstance(self.layout, KVLayout):
            object.__setattr__(self, "layout", KVLayout(self.layout))
        if not isinstance(self.dtype, KVCacheDType):
            object.__setattr__(self, "dtype", KVCacheDType.parse(self.dtype))

    @property
    def block_size(self) -> int:
        return int(self.key.shape[3] if self.layout is KVLayout.SPLIT else self.key.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1] if self.layout is KVLayout.SPLIT else self.key.shape[2])

    @property
    def head_size(self) -> int:
        if self.layout is KVLayout.SPLIT:
            return int(self.key.shape[2] * self.key.shape[4])
        return int(self.key.shape[3])

    @property
    def x(self) -> int:
        """Elements per innermost K chunk of the split layout (1 for NHD, where it does not apply)."""
        return int(self.key.shape[4]) if self.layout is KVLayout.SPLIT else 1


@dataclass(frozen=True)
class AttentionOptions:
    """Optional features of the attention itself.

    Attributes:
        sm_scale: softmax scale; ``None`` means ``1 / sqrt(head_size)``.
        alibi_slopes: ``[H]`` float tensor; adds ``slope * (key_pos - query_pos)`` to the logits.
        sliding_window: ``None`` for none; else a query sees keys with ``query_pos - key_pos < window``.
            0 is accepted as "none" and stored as ``None``, so that ``None`` is the only form of "no window"
            inside the library.
        softcap: logit soft-capping ``c * tanh(s / c)`` applied to scaled logits before ALiBi; 0 = off.
        sinks: ``[H]`` float tensor of per-head sink logits added to each softmax denominator.
        causal: ``True`` (default): a new token sees the new tokens up to and including itself. ``False``:
            it sees every new token of its sequence (prefix-LM, encoders). Cached tokens are always visible;
            a sliding window still only admits keys with ``query_pos - key_pos < window``.
        skip_decode: skip sequences with exactly one new token (left to a decode kernel): their output
            rows are not written.
        fp8_out_scale: ``None``, or a positive float / 1-element float tensor: the output is written as
            FP8 e4m3 ``clamp(attention / fp8_out_scale, -max, max)`` into an ``out`` of dtype
            ``torch.float8_e4m3fn`` (or ``float8_e4m3fnuz``).
        q_scale: the descale of an FP8 ``q`` (dtype ``torch.float8_e4m3fn``): a positive float or 1-element
            float tensor; the queries are ``q * q_scale``. Only with an FP8 ``q`` (1.0 otherwise).
    """

    sm_scale: Optional[float] = None
    alibi_slopes: Optional[torch.Tensor] = None
    sliding_window: Optional[int] = None
    softcap: float = 0.0
    sinks: Optional[torch.Tensor] = None
    causal: bool = True
    skip_decode: bool = False
    fp8_out_scale: Optional[ScaleLike] = None
    q_scale: ScaleLike = 1.0

    def __post_init__(self) -> None:
        w = self.sliding_window
        if isinstance(w, int) and not isinstance(w, bool) and w == 0:
            object.__setattr__(self, "sliding_window", None)


@dataclass(frozen=True)
class PrefillProblem:
    """Everything one call computes: the unit that backends receive from dispatch.

    ``out`` is written in place. ``q`` is ``[T, H, D]``; ``k``/``v`` are the new tokens' keys and values
    ``[T, Hkv, D]``, or both None when the new tokens' keys and values are already in the paged cache
    (positions ``context_lens[i] .. seq_lens[i] - 1`` of each sequence, e.g. written by
    :func:`~pagedprefill.write_to_cache`) and are read from there.
    """

    q: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    out: torch.Tensor
    cache: PagedKVCache
    batch: BatchMetadata
    options: AttentionOptions = field(default_factory=AttentionOptions)

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @classmethod
    def build(
        cls,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        out: torch.Tensor,
        cache: PagedKVCache,
        batch: BatchMetadata,
        **options,
    ) -> PrefillProblem:
        """The problem of one call: the builder every public entry point's problem comes from
        (:func:`~pagedprefill.prefill_attention` with the caller's cache and batch; the drop-ins and the custom
        operators through :meth:`from_tensors`, which makes the cache and the batch of plain tensors first).

        ``options`` are the fields of :class:`AttentionOptions` by name (:data:`pagedprefill.options.OPTIONS`
        held by ``"options"``), in the typed objects' form (``None`` where absent), with the description's
        defaults. ``cache`` and ``batch`` are kept as given, like every other argument: nothing is validated here
        (:func:`~pagedprefill.validate_problem` names what is wrong).
        """
        if not _OPTION_NAMES.issuperset(options):
            raise TypeError(f"build: unexpected arguments {sorted(set(options) - _OPTION_NAMES)}; expected fields "
                            f"of AttentionOptions (pagedprefill.options.OPTIONS held by 'options')")
        # AttentionOptions' fields are these options by name, with the description's defaults (test_options.py
        # checks both): passed on as they are, as a call's hot path wants.
        return cls(q=q, k=k, v=v, out=out, cache=cache, batch=batch, options=AttentionOptions(**options))

    @classmethod
    def from_tensors(
        cls,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        context_lens: Optional[torch.Tensor],
        **scalars,
    ) -> PrefillProblem:
        """The problem described by plain tensors and scalars: the drop-in signatures' and the custom operators'
        way to :meth:`build` (``context_lens`` None: derived, see :class:`BatchMetadata`).

        ``scalars`` are the options held by the cache, the batch and the attention options
        (:data:`pagedprefill.options.OPTIONS` held by ``"cache"``, ``"batch"`` or ``"options"``: ``layout``,
        ``kv_cache_dtype``, ``k_scale``, ``v_scale``, ``max_query_len`` and the fields of
        :class:`AttentionOptions`), by name and in the typed objects' form (``None`` where absent), with the
        description's defaults. ``layout=None`` reads the layout from ``k_cache`` (5-D: split, else NHD).
        Nothing is validated here (see :func:`~pagedprefill.validate_problem`).
        """
        if not _HELD_NAMES.issuperset(scalars):
            raise TypeError(f"from_tensors: unexpected arguments {sorted(set(scalars) - _HELD_NAMES)}; expected "
                            f"options held by the cache, the batch or AttentionOptions (pagedprefill.options.OPTIONS)")
        take = scalars.pop  # what the cache and the batch hold leaves the attention options in ``scalars``
        cache_fields = {attribute: take(name, default) for name, attribute, default in _CACHE_FIELDS}
        if cache_fields["layout"] is None:
            split = isinstance(k_cache, torch.Tensor) and k_cache.dim() == 5
            cache_fields["layout"] = KVLayout.SPLIT if split else KVLayout.NHD
        cache = PagedKVCache(k_cache, v_cache, **cache_fields)
        batch = BatchMetadata(query_start=query_start, seq_lens=seq_lens, context_lens=context_lens,
                              block_table=block_table,
                              **{attribute: take(name, default) for name, attribute, default in _BATCH_FIELDS})
        return cls.build(q, k, v, out, cache, batch, **scalars)

    @property
    def kv_in_cache(self) -> bool:
        """Whether the new tokens' keys/values are read from the cache (``k`` and ``v`` are None)."""
        return self.k is None

    @property
    def features(self) -> frozenset:
        """The optional features (names from :data:`FEATURES`) this call uses; backends may refuse them."""
        used = {o.feature[0] for o in held_by("options") if o.feature and _differs(getattr(self.options, o.attribute),
                                                                                  o.default)}
        if self.k is None or self.v is None:
            used.add(KV_IN_CACHE[0])
        if self.q.dtype in FP8_QUERY_DTYPES:
            used.add(FP8_QUERY[0])
        return frozenset(used)

    @property
    def dtype(self) -> torch.dtype:
        """The type the call computes in: ``q``'s, or for an FP8 ``q`` the first 16-bit type among ``out``, ``k``
        and an unquantised cache, else bfloat16 (FP8 queries, keys, values and output alike: every FP8 value is
        exactly a bfloat16 one)."""
        if self.q.dtype not in FP8_QUERY_DTYPES:
            return self.q.dtype
        return fp8_query_compute_dtype(self.out, self.k, None if self.cache.dtype.is_fp8 else self.cache.key)

    @property
    def num_kv_heads(self) -> int:
        if self.k is None:
            return self.cache.num_kv_heads
        return int(self.k.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.q.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def sm_scale(self) -> float:
        s = self.options.sm_scale
        return float(s) if s is not None else self.head_size ** -0.5

    @property
    def device(self) -> torch.device:
        return self.q.device


def _differs(value, default) -> bool:
    """Whether an option's ``value`` is not its ``default`` (a tensor is compared by identity, with None)."""
    return value is not default if default is None or isinstance(value, torch.Tensor) else value != default
