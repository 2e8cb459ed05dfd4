"""The portable kernel's arguments, grouped by meaning.

Every group is a named tuple. The launcher builds it, Triton passes it to the kernel as one tuple argument
(each field specialised on its own, as a lone argument would be: pointer alignment, divisibility by 16,
integers equal to 1) and the kernel reads its fields by name. The compiled kernel's parameters are the
non-constexpr fields of every group, flattened in signature order; a direct launch
(:class:`~pagedprefill.triton.launch.BoundLaunch`) hands the groups over in that order, and the driver's
launcher flattens them. There the tensor groups come as plain tuples of the same fields
(:func:`~pagedprefill.triton.launch.call_tensors`): building named tuples on every call cost the host time.

Three kinds of groups, in the kernel's signature order:

* tensors, which change from call to call (:func:`~pagedprefill.triton.launch.call_tensors`): :class:`Tokens`,
  :class:`Cache`, :class:`Batch`, :class:`PerHead`, :class:`ScaleTensors`, :class:`Partials`;
* numbers, fixed by the call signature: :class:`Scales`, the softcap and the window, :class:`Extents`,
  :class:`TokenStrides`, :class:`CacheStrides`;
* compile-time constants: the head size, :class:`Tile`, :class:`CacheLayout`, :class:`Features`,
  :class:`ScaleFromTensor`.

A feature that is off still gets an argument of its kind (a placeholder tensor, a 1.0 scale, a 0 window):
the kernel never reads it, and the signature stays one shape for every call.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional


class Tokens(NamedTuple):
    """The new tokens' tensors, ``[T, H, D]`` (``k``/``v`` ``[T, Hkv, D]``; ``q`` itself as a placeholder when
    their keys and values are read from the cache)."""

    q: Any
    k: Any
    v: Any
    out: Any


class Cache(NamedTuple):
    """The paged cache (FP8 bytes viewed as float8) and the block table ``[B, width]``."""

    key: Any
    value: Any
    block_table: Any


class Batch(NamedTuple):
    """Where each sequence's tokens are: ``query_start`` (row offsets into q/out), ``seq_lens`` (context plus
    new tokens) and ``context_lens`` (cached positions before the new tokens; a placeholder, unread, when
    :class:`Features` says ``CONTEXT_FROM_STARTS``)."""

    query_start: Any
    seq_lens: Any
    context_lens: Any


class PerHead(NamedTuple):
    """Per-query-head values: ALiBi slopes and sink logits (placeholders when the feature is off)."""

    alibi_slopes: Any
    sinks: Any


class ScaleTensors(NamedTuple):
    """Scales given as tensors, read on the device (placeholders for scales given as numbers or unused): the FP8
    cache's, the FP8 output's, and an FP8 query's descale."""

    k: Any
    v: Any
    out: Any
    q: Any


class Partials(NamedTuple):
    """Where a launch with split keys writes each split's rows (placeholders without a split): ``out``
    ``[splits, T, H, padded D]`` float32, each row normalised by its own split's sum, and ``lse``
    ``[splits, T, H]`` float32, the split's log2-domain log-sum-exp (``-inf`` for a split without keys).
    :mod:`.combine` merges them into the output."""

    out: Any
    lse: Any


class Scales(NamedTuple):
    """Softmax scale, FP8 cache scales and FP8 output scale as numbers (1.0 where :class:`ScaleTensors` holds
    the scale, or where it is unused). An FP8 query's descale given as a number is folded into ``softmax``."""

    softmax: float
    k: float
    v: float
    out: float


class Extents(NamedTuple):
    """Sizes that bound every index: sequences, token rows, cache blocks, block-table columns, keys per block,
    and query heads per KV head. The kernels take them as separate arguments, in this order (Triton specialises
    every integer inside a tuple argument, whatever the kernel asks)."""

    num_seqs: int
    num_tokens: int
    num_blocks: int
    table_width: int
    block_size: int
    group_size: int


#: The extents that change with every step of a serving engine. Triton would key a kernel's compiled code on each
#: one's value class (1, a multiple of 16, other) and compile again for each new pattern, while none of them
#: changes an instruction of the code (ci/codegen_fingerprint.py): the kernels do not specialise them.
VARYING_EXTENTS = ("num_seqs", "num_tokens", "num_blocks", "table_width")


class RowStrides(NamedTuple):
    """Strides of a ``[T, H, D]`` tensor (its head dim is contiguous)."""

    token: int
    head: int


class TokenStrides(NamedTuple):
    """Strides of :class:`Tokens` (zeros for ``k``/``v`` when they are read from the cache)."""

    q: RowStrides
    k: RowStrides
    v: RowStrides
    out: RowStrides


class KeyStrides(NamedTuple):
    """Strides of cached keys: a key's element ``d`` of ``head`` at ``slot`` of ``block``.

    The split layout ``[blocks, Hkv, D / x, block_size, x]`` stores ``d`` as chunk ``d // x`` (``chunk``
    stride) and element ``d % x`` (``dim`` stride); NHD ``[blocks, block_size, Hkv, D]`` has no chunks
    (``chunk`` is 0 and unused) and ``dim`` is the head dim's stride.
    """

    block: int
    head: int
    chunk: int
    slot: int
    dim: int


class ValueStrides(NamedTuple):
    """Strides of cached values (split ``[blocks, Hkv, D, block_size]``, NHD ``[blocks, block_size, Hkv, D]``)."""

    block: int
    head: int
    dim: int
    slot: int


class TableStrides(NamedTuple):
    """Strides of the block table ``[B, width]``."""

    seq: int
    col: int


class CacheStrides(NamedTuple):
    """Strides of :class:`Cache`."""

    key: KeyStrides
    value: ValueStrides
    table: TableStrides


class Tile(NamedTuple):
    """How the policy tiled the launch (:class:`~pagedprefill.tiling.TileConfig`), as the kernel needs it.

    ``HEAD_CHUNKS`` is how many programs share one KV head's query heads (``ceil(group / HEADS_PER_TILE)``);
    ``DOT_PRECISION`` is the ``input_precision`` of both dots for these inputs; ``KEY_SPLITS`` how many programs
    share a query tile's keys (1: none, the program writes the output itself).
    """

    BLOCK_M: int
    BLOCK_N: int
    HEADS_PER_TILE: int
    HEAD_CHUNKS: int
    SPLIT_MASKS: bool
    DOT_PRECISION: str
    KEY_SPLITS: int = 1


class CacheLayout(NamedTuple):
    """How cached keys and values are addressed.

    ``SPLIT``: the split layout (keys in chunks of ``CHUNK`` elements, values transposed), else NHD (``CHUNK``
    None). ``PAGEWISE``: one block-table read per page of ``PAGE_SIZE`` keys (the block size, known to the
    compiler; None otherwise), else one read per key with the block size read at run time (any block size).
    ``KEY_ALIGN``/``VALUE_ALIGN``: elements that every non-unit key/value stride is a multiple of.
    """

    SPLIT: bool
    CHUNK: Optional[int]
    PAGEWISE: bool
    PAGE_SIZE: Optional[int]
    KEY_ALIGN: int
    VALUE_ALIGN: int


class Features(NamedTuple):
    """Which optional parts of the computation the kernel compiles in."""

    CAUSAL: bool
    WINDOW: bool
    SOFTCAP: bool
    ALIBI: bool
    SINKS: bool
    SKIP_DECODE: bool
    NEW_KV_IN_CACHE: bool
    OUT_SCALE: bool
    #: The 16-bit type an FP8 q is widened to as it is loaded (``"float16"`` or ``"bfloat16"``: exactly, its
    #: descale folded into the logits' scale), or ``""``: q is in the type the call computes in.
    QUERY_WIDENED_TO: str = ""
    #: The context lengths are not given (``BatchMetadata.context_lens`` is None): each is the sequence's length
    #: less its new tokens, the difference of consecutive starts (``query_start`` has ``B + 1`` entries), and
    #: :class:`Batch`'s ``context_lens`` is a placeholder the kernel never reads.
    CONTEXT_FROM_STARTS: bool = False


class ScaleFromTensor(NamedTuple):
    """Whether each scale is read from :class:`ScaleTensors` (True) or taken from :class:`Scales`."""

    K: bool
    V: bool
    OUT: bool
    Q: bool = False
