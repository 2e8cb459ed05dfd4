"""Input validation: every error names the argument, what was expected and what was given.

Two levels:

* ``"basic"`` (the default on the hot path): shapes, dtypes, devices and option types. It reads no tensor
  values, so it never synchronises with the device.
* ``"full"``: additionally reads the metadata values (one device-to-host copy) and checks that lengths are
  consistent, starts match lengths, and every block-table entry a sequence uses is a valid block.

Independently of the level, the kernels bound every address they form by the tensor extents, so bad
metadata can give wrong numbers in the rows it concerns but never an out-of-bounds access
(:mod:`pagedprefill.testing.memory_safety` proves it for every backend). The reference backend, which reads
the metadata on the host anyway, always runs the ``"full"`` value checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .options import held_by
from .types import FP8_QUERY_COMPUTE_DTYPES, FP8_QUERY_DTYPES, KVLayout, PagedKVCache, PrefillProblem

ValidateMode = Literal["basic", "full"]

MAX_HEAD_SIZE = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Output dtypes accepted with ``fp8_out_scale``.
FP8_OUT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ArgumentNames:
    """What the caller called the arguments whose name differs between entry points, so that every error
    names the argument as the caller wrote it."""

    out: str = "out"
    block_table: str = "block_table"
    query_start: str = "query_start"
    seq_lens: str = "seq_lens"
    context_lens: str = "context_lens"
    max_query_len: str = "max_query_len"
    #: The caller's signature has no context lengths: they are derived from the starts and ``seq_lens`` (the vLLM
    #: signature), so a bad value of one is reported on the argument the caller wrote, ``seq_lens``. A batch
    #: whose ``context_lens`` is None says so itself; this covers the custom operators, which receive the
    #: derived lengths as a tensor.
    context_from_starts: bool = False


#: The native API (:class:`~pagedprefill.BatchMetadata` fields) and the custom operators.
NATIVE_NAMES = ArgumentNames()
#: The classic drop-in :func:`~pagedprefill.context_attention_fwd`.
DROP_IN_NAMES = ArgumentNames(out="o", block_table="b_loc", query_start="b_start_loc", seq_lens="b_seq_len",
                              context_lens="b_ctx_len", max_query_len="max_input_len")
#: The vLLM drop-in :func:`pagedprefill.vllm.context_attention_fwd`: no ``b_ctx_len``, each sequence's context
#: length is computed from ``b_seq_len`` and ``b_start_loc``, so errors about it show that expression.
VLLM_NAMES = ArgumentNames(out="o", block_table="b_loc", query_start="b_start_loc", seq_lens="b_seq_len",
                           context_lens="b_seq_len[i] - (b_start_loc[i + 1] - b_start_loc[i])",
                           max_query_len="max_input_len", context_from_starts=True)
#: The names records by the key the custom operators take (``argument_names=``), so that an operator called
#: by a public function while ``torch.compile`` traces it names that function's arguments.
ARGUMENT_NAMES = {"native": NATIVE_NAMES, "drop_in": DROP_IN_NAMES, "vllm": VLLM_NAMES}


def argument_names_key(names: ArgumentNames) -> str:
    """The key of ``names`` in :data:`ARGUMENT_NAMES` (what the operators' ``argument_names`` takes)."""
    for key, record in ARGUMENT_NAMES.items():
        if record == names:
            return key
    raise ValueError(f"names: expected one of the records in ARGUMENT_NAMES ({', '.join(ARGUMENT_NAMES)}), "
                     f"got {names!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """How messages spell a dtype: ``float16``, ``float8_e4m3fn``, ``int32`` (without ``torch.``)."""
    return str(dtype).removeprefix("torch.")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _expect_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _expect_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {layout}, got shape {_shape(t)}")


def _expect_dtype(name: str, t: torch.Tensor, allowed: tuple, what: Optional[str] = None) -> None:
    if t.dtype not in allowed:
        names = what or " or ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}, got {dtype_name(t.dtype)}")


def _expect_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {t.device}")


def _expect_unit_stride(name: str, t: torch.Tensor) -> None:
    """1-D tensors that kernels index directly must be contiguous (a view with another stride is refused)."""
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous 1-D tensor (stride 1), got stride {t.stride(0)}; "
                         f"pass {name}.contiguous()")


def _values(t: torch.Tensor, at: int, limit: int = 12) -> str:
    """A 1-D host tensor's values as a list, or the part around index ``at`` when it is long."""
    values = t.tolist()
    if len(values) <= limit:
        return str(values)
    lo = max(0, min(at - limit // 2, len(values) - limit))
    inner = ", ".join(str(v) for v in values[lo:lo + limit])
    return f"[{'..., ' if lo else ''}{inner}{', ...' if lo + limit < len(values) else ''}] (entries {lo}..)"


def expected_x(head_size: int, element_size: int) -> int:
    """The preferred ``x`` of the split K layout: elements per 16-byte chunk, reduced so that it divides
    ``head_size``. Used when allocating; any ``x >= 1`` dividing ``head_size`` is accepted."""
    return math.gcd(head_size, max(1, 16 // element_size))


def validate_problem(p: PrefillProblem, mode: ValidateMode = "basic", names: ArgumentNames = NATIVE_NAMES) -> None:
    """Check a problem before any kernel sees it; raise ``TypeError``/``ValueError`` naming the argument.

    ``names`` is what the caller calls the arguments (:data:`DROP_IN_NAMES` for the classic drop-in,
    :data:`VLLM_NAMES` for :mod:`pagedprefill.vllm`).
    """
    if mode not in ("basic", "full"):
        raise ValueError(f"validate: expected 'basic' or 'full', got {mode!r}")
    validate_tensors(p, names)
    _validate_options(p)
    if mode == "full":
        validate_values(p, names)


def validate_tensors(p: PrefillProblem, names: ArgumentNames = NATIVE_NAMES) -> None:
    """The tensor checks of ``"basic"`` (types, ranks, shapes, dtypes, devices; no scalar options): what the
    public functions check while ``torch.compile`` traces them (the operator checks the rest)."""
    _validate_tensors(p, names.out)
    _validate_cache(p)
    _validate_batch(p, names)


def _validate_tensors(p: PrefillProblem, out_name: str) -> None:
    if (p.k is None) != (p.v is None):
        none, other = ("k", "v") if p.k is None else ("v", "k")
        raise TypeError(f"{none}: expected a torch.Tensor, got NoneType ({none} may be None only together with "
                        f"{other}: then the new tokens' keys and values are read from the paged cache)")
    for name, attr in (("q", "q"), ("k", "k"), ("v", "v"), (out_name, "out")):
        if attr in ("k", "v") and p.k is None:
            continue
        _expect_tensor(name, getattr(p, attr))
    q, k, v, out = p.q, p.k, p.v, p.out
    _expect_ndim("q", q, 3, "[tokens, num_heads, head_size]")
    _expect_ndim(out_name, out, 3, "[tokens, num_heads, head_size]")
    fp8_query = q.dtype in FP8_QUERY_DTYPES
    _expect_dtype("q", q, FLOAT_DTYPES + FP8_QUERY_DTYPES,
                  "float16, bfloat16, float32 or float8_e4m3fn (an FP8 q, with q_scale)")
    # The type the call computes in: q's, or for an FP8 q the one its other tensors hold (16-bit).
    model, of = (p.dtype, "the 16-bit dtype of the call, whose q is FP8") if fp8_query else (q.dtype, "the dtype of q")
    if p.options.fp8_out_scale is not None:
        _expect_dtype(out_name, out, FP8_OUT_DTYPES, "float8_e4m3fn or float8_e4m3fnuz (FP8 output, fp8_out_scale "
                                                     "is set)")
    elif fp8_query:
        _expect_dtype(out_name, out, FP8_QUERY_COMPUTE_DTYPES,
                      "float16 or bfloat16 (the output of an FP8 q; an FP8 output needs fp8_out_scale)")
    elif out.dtype != q.dtype:
        raise TypeError(
            f"{out_name}: expected dtype {dtype_name(q.dtype)} (the dtype of q), got {dtype_name(out.dtype)}")
    _expect_device(out_name, out, q.device)
    T, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_SIZE:
        raise ValueError(f"q: expected head_size (dim 2) in 1..{MAX_HEAD_SIZE}, got {D}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"{out_name}: expected shape {_shape(q)} (the shape of q), got {_shape(out)}")
    for name, t in (("q", q), (out_name, out)):
        if t.numel() and t.stride(2) != 1:
            raise ValueError(
                f"{name}: expected the head_size dimension to be contiguous (stride 1), got strides {t.stride()}"
            )
    if k is None:
        return
    _expect_ndim("k", k, 3, "[tokens, num_kv_heads, head_size]")
    _expect_ndim("v", v, 3, "[tokens, num_kv_heads, head_size]")
    for name, t in (("k", k), ("v", v)):
        if fp8_query:
            _expect_dtype(name, t, FP8_QUERY_COMPUTE_DTYPES, "float16 or bfloat16 (the new tokens' keys and values "
                                                           "beside an FP8 q)")
        if t.dtype != model:
            raise TypeError(f"{name}: expected dtype {dtype_name(model)} ({of}), got {dtype_name(t.dtype)}")
        _expect_device(name, t, q.device)
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != T or t.shape[2] != D:
            raise ValueError(
                f"{name}: expected shape [{T}, num_kv_heads, {D}] (tokens and head_size of q), got {_shape(t)}"
            )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected shape {_shape(k)} (the shape of k), got {_shape(v)}")
    Hkv = k.shape[1]
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(
            f"k: expected num_kv_heads dividing num_heads={H} (GQA/MQA), got num_kv_heads={Hkv}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.numel() and t.stride(2) != 1:
            raise ValueError(
                f"{name}: expected the head_size dimension to be contiguous (stride 1), got strides {t.stride()}"
            )


def _heads_from_k(p: PrefillProblem, cache_heads: int) -> str:
    """Where the expected KV heads come from, when the cache's differ from those of the new tokens' ``k``/``v``:
    either side may be the one the caller got wrong, so the message names both."""
    if p.k is None or cache_heads == p.num_kv_heads:
        return ""
    return (f" (the {p.num_kv_heads} KV heads of k and v, shape {_shape(p.k)}: if the cache's {cache_heads} are "
            f"right, k and v are the tensors to fix)")


def _validate_cache(p: PrefillProblem) -> None:
    c = p.cache
    if not isinstance(c, PagedKVCache):
        raise TypeError(f"cache: expected a pagedprefill.PagedKVCache, got {type(c).__name__}")
    kc = _expect_tensor("k_cache", c.key)
    vc = _expect_tensor("v_cache", c.value)
    _expect_device("k_cache", kc, p.q.device)
    _expect_device("v_cache", vc, p.q.device)
    Hkv, D = p.num_kv_heads, p.head_size
    if c.dtype.is_fp8:
        allowed = (torch.uint8, c.dtype.torch_dtype)
        _expect_dtype("k_cache", kc, allowed,
                      f"uint8 (or {dtype_name(c.dtype.torch_dtype)}) for kv_cache_dtype={c.dtype.value!r}")
    else:
        model = p.dtype
        if kc.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(
                f"k_cache: dtype {dtype_name(kc.dtype)} holds FP8 bytes, but kv_cache_dtype='auto' expects the model "
                f"dtype {dtype_name(model)}; pass kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2' with k_scale/v_scale"
            )
        if p.q.dtype in FP8_QUERY_DTYPES:
            _expect_dtype("k_cache", kc, FP8_QUERY_COMPUTE_DTYPES,
                          "float16 or bfloat16 (an unquantised cache, kv_cache_dtype='auto', beside an FP8 q)")
            _expect_dtype("k_cache", kc, (model,), f"{dtype_name(model)} (the 16-bit dtype of the call, whose q is "
                                                   f"FP8; kv_cache_dtype='auto')")
        else:
            _expect_dtype("k_cache", kc, (model,), f"{dtype_name(model)} (the dtype of q, kv_cache_dtype='auto')")
    if vc.dtype != kc.dtype:
        raise TypeError(
            f"v_cache: expected dtype {dtype_name(kc.dtype)} (the dtype of k_cache), got {dtype_name(vc.dtype)}")
    if c.layout is KVLayout.SPLIT:
        _expect_ndim("k_cache", kc, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x] (split layout)")
        _expect_ndim("v_cache", vc, 4, "[num_blocks, num_kv_heads, head_size, block_size] (split layout)")
        nb, hk, dx, bs, x = kc.shape
        if x < 1 or D % x != 0:
            raise ValueError(
                f"k_cache: expected x (dim 4) >= 1 dividing head_size {D} (e.g. {expected_x(D, kc.element_size())}),"
                f" got x={x} in shape {_shape(kc)}"
            )
        if hk != Hkv or dx * x != D:
            raise ValueError(
                f"k_cache: expected shape [num_blocks, {Hkv}, {D // x}, block_size, {x}]{_heads_from_k(p, hk)}, "
                f"got {_shape(kc)}"
            )
        if tuple(vc.shape) != (nb, Hkv, D, bs):
            raise ValueError(f"v_cache: expected shape [{nb}, {Hkv}, {D}, {bs}], got {_shape(vc)}")
    else:
        _expect_ndim("k_cache", kc, 4, "[num_blocks, block_size, num_kv_heads, head_size] (NHD layout)")
        nb, bs, hk, d = kc.shape
        if hk != Hkv or d != D:
            raise ValueError(f"k_cache: expected shape [num_blocks, block_size, {Hkv}, {D}]{_heads_from_k(p, hk)}, "
                             f"got {_shape(kc)}")
        if tuple(vc.shape) != tuple(kc.shape):
            raise ValueError(f"v_cache: expected shape {_shape(kc)} (the shape of k_cache), got {_shape(vc)}")
    if c.block_size < 1:
        raise ValueError(f"k_cache: expected block_size >= 1, got {c.block_size}")
    if p.k is None and (Hkv < 1 or p.num_heads % Hkv != 0):
        raise ValueError(
            f"k_cache: expected num_kv_heads dividing num_heads={p.num_heads} (GQA/MQA), got num_kv_heads={Hkv}"
        )
    for name in ("k_scale", "v_scale") if c.dtype.is_fp8 else ():
        _expect_scale(name, getattr(c, name), p)


def _validate_batch(p: PrefillProblem, names: ArgumentNames) -> None:
    b = p.batch
    derived = b.context_lens is None  # context lengths derived from the starts: no tensor to check
    tensors = ((names.query_start, b.query_start), (names.seq_lens, b.seq_lens),
               *(() if derived else ((names.context_lens, b.context_lens),)), (names.block_table, b.block_table))
    for name, t in tensors:
        _expect_tensor(name, t)
        _expect_dtype(name, t, INDEX_DTYPES)
        _expect_device(name, t, p.q.device)
    _expect_ndim(names.seq_lens, b.seq_lens, 1, "[num_seqs]")
    B = b.seq_lens.shape[0]
    if derived:
        _expect_derivable_starts(names.query_start, b.query_start, B)
    else:
        _expect_ndim(names.context_lens, b.context_lens, 1, "[num_seqs]")
        if b.context_lens.shape[0] != B:
            raise ValueError(
                f"{names.context_lens}: expected shape [{B}] (as {names.seq_lens}), got {_shape(b.context_lens)}")
        _expect_ndim(names.query_start, b.query_start, 1, "[num_seqs] or [num_seqs + 1]")
        if b.query_start.shape[0] not in (B, B + 1):
            raise ValueError(f"{names.query_start}: expected shape [{B}] or [{B + 1}], got {_shape(b.query_start)}")
    for name, t in tensors[:-1]:
        _expect_unit_stride(name, t)
    _expect_ndim(names.block_table, b.block_table, 2, "[num_seqs, max_blocks_per_seq]")
    if b.block_table.shape[0] != B:
        raise ValueError(
            f"{names.block_table}: expected {B} rows (one per sequence), got shape {_shape(b.block_table)}")
    if b.max_query_len is not None:
        if not isinstance(b.max_query_len, int) or isinstance(b.max_query_len, bool) or b.max_query_len < 0:
            raise ValueError(f"{names.max_query_len}: expected a non-negative int, got {b.max_query_len!r}")


def _expect_derivable_starts(name: str, starts: torch.Tensor, num_seqs: int) -> None:
    """The starts of a batch whose context lengths are derived from them (``context_lens`` None): one more
    than the sequences, as the query lengths are the differences of consecutive starts."""
    _expect_ndim(name, starts, 1, "[num_seqs + 1]")
    if starts.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{name}: expected shape [{num_seqs + 1}] (num_seqs + 1 entries: query lengths are the differences of "
            f"consecutive starts), got {_shape(starts)}"
        )


def _validate_options(p: PrefillProblem) -> None:
    """Each attention option, by the check its description names (:attr:`pagedprefill.options.Option.check`)."""
    for o in held_by("options"):
        _OPTION_CHECKS[o.check](o.name, getattr(p.options, o.attribute), p)


def _check_scale(name: str, value, p: PrefillProblem) -> None:
    """None, or a finite positive float (``sm_scale``)."""
    if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name}: expected a finite positive float or None, got {value!r}")


def _check_per_head(name: str, t, p: PrefillProblem) -> None:
    """None, or a contiguous ``[H]`` float tensor on ``q``'s device (``alibi_slopes``, ``sinks``)."""
    if t is None:
        return
    _expect_tensor(name, t)
    H = p.num_heads
    if t.dim() != 1 or t.shape[0] != H:
        raise ValueError(f"{name}: expected shape [{H}] (one per query head), got {_shape(t)}")
    _expect_dtype(name, t, FLOAT_DTYPES)
    _expect_device(name, t, p.q.device)
    _expect_unit_stride(name, t)


def _check_window(name: str, w, p: PrefillProblem) -> None:
    """None or a positive int (``sliding_window``; the typed objects store 0 as None)."""
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
        raise ValueError(f"{name}: expected None or an int >= 0 (0 = no window), got {w!r}")


def _check_cap(name: str, value, p: PrefillProblem) -> None:
    """A finite float >= 0, 0 meaning off (``softcap``)."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite float >= 0 (0 = off), got {value!r}")


def _check_flag(name: str, value, p: PrefillProblem) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _expect_scale(name: str, s, p: PrefillProblem, expected: str = "a float or a 1-element tensor") -> None:
    """A scale: a finite positive float, or a 1-element float tensor on ``q``'s device (read there)."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ValueError(f"{name}: expected {expected}, got shape {_shape(s)}")
        _expect_dtype(name, s, FLOAT_DTYPES)
        _expect_device(name, s, p.q.device)
    elif not isinstance(s, (int, float)) or isinstance(s, bool):
        raise TypeError(f"{name}: expected {expected}, got {type(s).__name__}")
    elif not math.isfinite(s) or s <= 0:
        raise ValueError(f"{name}: expected a finite positive scale, got {s}")


def _check_out_scale(name: str, s, p: PrefillProblem) -> None:
    """None, or a scale (``fp8_out_scale``)."""
    if s is not None:
        _expect_scale(name, s, p, "None, a float or a 1-element tensor")


def _check_q_scale(name: str, s, p: PrefillProblem) -> None:
    """An FP8 ``q``'s descale: a finite positive float or a 1-element float tensor on ``q``'s device; with
    another ``q``, 1.0 (nothing to descale)."""
    if p.q.dtype not in FP8_QUERY_DTYPES:
        if isinstance(s, torch.Tensor) or s != 1.0:
            raise ValueError(f"{name}: descales an FP8 q (dtype float8_e4m3fn) only; q has dtype "
                             f"{dtype_name(p.q.dtype)}, so pass no {name} (or 1.0)")
        return
    _expect_scale(name, s, p)


#: The checks an attention option's description may name (:attr:`pagedprefill.options.Option.check`).
_OPTION_CHECKS = {"scale": _check_scale, "per_head": _check_per_head, "window": _check_window, "cap": _check_cap,
                  "flag": _check_flag, "out_scale": _check_out_scale, "q_scale": _check_q_scale}


def validate_values(p: PrefillProblem, names: ArgumentNames = NATIVE_NAMES) -> None:
    """The ``"full"`` checks: read the metadata on the host and check it against the tensor extents.

    ``names`` is what the caller calls the metadata arguments (``b_loc``, ``b_ctx_len``... in the drop-in
    signatures; ``block_table``, ``context_lens``... in the native API and the operators).
    """
    b = p.batch
    B = b.num_seqs
    seq = b.seq_lens.to("cpu", torch.int64)
    ctx = b.context_lengths().to("cpu", torch.int64)
    start = b.query_start.to("cpu", torch.int64)
    table = b.block_table.to("cpu", torch.int64)
    starts, seqs, ctxs = names.query_start, names.seq_lens, names.context_lens
    T = p.num_tokens
    if B:
        if int(start[0]) < 0:
            raise ValueError(f"{starts}: expected offsets >= 0, got {starts}[0]={int(start[0])}")
        steps = start[1:] - start[:-1]
        if steps.numel() and int(steps.min()) < 0:
            at = int(torch.argmin(steps))
            raise ValueError(f"{starts}: expected non-decreasing offsets, got {_values(start, at)}")
    if B and int(ctx.min()) < 0:
        i = int(torch.argmin(ctx))
        if b.context_lens is None or names.context_from_starts:  # the length the caller's seq_lens implies
            raise ValueError(
                f"{seqs}: expected {seqs}[i] >= {starts}[i + 1] - {starts}[i] (the new tokens of sequence i), got "
                f"{seqs}[{i}]={int(seq[i])} < {int(seq[i] - ctx[i])}")
        raise ValueError(f"{ctxs}: expected values >= 0, got {ctxs}[{i}]={int(ctx[i])}")
    qlen = seq - ctx
    if B and int(qlen.min()) < 0:
        i = int(torch.argmin(qlen))
        raise ValueError(f"{seqs}: expected {seqs}[i] >= {ctxs}[i], got {seqs}[{i}]={int(seq[i])} < "
                         f"{ctxs}[{i}]={int(ctx[i])}")
    if B:
        expected = int(start[0]) + torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(qlen, 0)])
        n = start.shape[0]
        bad = (start != expected[:n]).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{starts}: expected packed sequences ({starts}[i + 1] = {starts}[i] + {seqs}[i] - {ctxs}[i]), "
                f"got {starts}[{i}]={int(start[i])}, expected {int(expected[i])}"
            )
        end = int(expected[-1])
        if end > T:
            culprit = starts if n == B + 1 else f"{seqs}/{ctxs}"
            raise ValueError(
                f"{culprit}: expected the new tokens of all sequences to end within the {T} tokens of q, got an "
                f"end at {end}"
            )
    if b.max_query_len is not None and B and int(qlen.max()) > b.max_query_len:
        raise ValueError(
            f"{names.max_query_len}: expected >= the longest query ({int(qlen.max())}), got {b.max_query_len}"
        )
    bs = p.cache.block_size
    # With k = v = None the new tokens are in the cache too: a sequence uses its first seq_len positions.
    cached = seq if p.kv_in_cache else ctx
    what = "tokens in the cache" if p.kv_in_cache else "cached tokens"
    nblocks_needed = (cached + bs - 1) // bs
    width = table.shape[1]
    if B and int(nblocks_needed.max()) > width:
        i = int(torch.argmax(nblocks_needed))
        raise ValueError(
            f"{names.block_table}: expected at least {int(nblocks_needed[i])} columns (sequence {i} has "
            f"{int(cached[i])} {what}, needing {int(nblocks_needed[i])} blocks of {bs}), got {width} columns"
        )
    if B and width:
        used = torch.arange(width)[None, :] < nblocks_needed[:, None]
        num_blocks = p.cache.num_blocks
        bad = used & ((table < 0) | (table >= num_blocks))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"{names.block_table}: expected block numbers in [0, {num_blocks}), got {int(table[i, j])} at "
                f"[{i}, {j}] (sequence {i} uses {int(nblocks_needed[i])} blocks)"
            )
