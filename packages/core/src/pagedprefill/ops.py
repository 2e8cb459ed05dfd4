"""pagedprefill as PyTorch custom operators, for code compiled with ``torch.compile`` or captured in CUDA graphs.

Two operators in the ``pagedprefill`` namespace, registered when ``pagedprefill`` is imported:

* ``torch.ops.pagedprefill.prefill_attention(q, k, v, k_cache, v_cache, block_table, query_start, seq_lens,
  context_lens, ...) -> Tensor``: functional, returns a new output ``[T, H, D]``;
* ``torch.ops.pagedprefill.prefill_attention_(q, k, v, out, k_cache, v_cache, block_table, query_start,
  seq_lens, context_lens, ...) -> None``: writes ``out`` in place (``out`` sits where the drop-in
  :func:`pagedprefill.context_attention_fwd` has ``o``).

Both take only tensors and scalars, so ``torch.compile(fullgraph=True)`` traces a call as one graph node
(the meta implementation gives the output's shape, dtype and device without running anything) and never
breaks the graph on the typed objects of the Python API. Arguments after ``context_lens`` have defaults and
can be passed by keyword:

========================== ======================= ================================================
argument                   default                 meaning
========================== ======================= ================================================
``layout``                 ``"auto"``              ``"nhd"``, ``"split"``, or ``"auto"``: split when
                                                   ``k_cache`` is 5-D, else NHD
``kv_cache_dtype``         ``"auto"``              ``"auto"``, ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``
``k_scale``, ``v_scale``   ``1.0``                 FP8 dequantisation scales as floats
``k_scale_tensor``,        ``None``                the same as 1-element float tensors (read on the
``v_scale_tensor``                                 device, no host sync); a tensor wins over the float
``sm_scale``               ``0.0``                 softmax scale; ``<= 0`` means ``1 / sqrt(head_size)``
``sliding_window``         ``0``                   ``<= 0`` means no window
``softcap``                ``0.0``                 logit soft-capping, 0 = off
``alibi_slopes``           ``None``                ``[H]`` ALiBi slopes
``sinks``                  ``None``                ``[H]`` sink logits
``max_query_len``          ``-1``                  a hint (upper bound of new tokens); ``< 0`` = none
``backend``                ``""``                  a backend name; ``""`` chooses by device
``causal``                 ``True``                ``False``: new tokens see every new token of their
                                                   sequence
``skip_decode``            ``False``               skip sequences with one new token (rows unwritten;
                                                   zeros in the functional op's new output)
``fp8_out_scale``          ``0.0``                 ``> 0``: FP8 e4m3 output ``clamp(out / scale)``
``fp8_out_scale_tensor``   ``None``                the same as a 1-element float tensor (wins)
``validate``               ``"basic"``             ``"basic"`` or ``"full"`` (reads metadata values)
``argument_names``         ``"native"``            how errors name the arguments: ``"native"``
                                                   (``block_table``, ``context_lens``...), ``"drop_in"``
                                                   (``b_loc``, ``b_ctx_len``...) or ``"vllm"``
========================== ======================= ================================================

An operator's schema has no ``None`` for a float or an int, so ``sm_scale``, ``sliding_window``,
``max_query_len`` and ``fp8_out_scale`` say "absent" with the sentinels above (:data:`SCHEMA_ABSENT`), where the
typed objects (:class:`~pagedprefill.AttentionOptions`, :class:`~pagedprefill.BatchMetadata`) say ``None``.
This module is the one place that converts between the two (:func:`build_problem` and :func:`op_arguments`).

``k`` and ``v`` may both be None: the new tokens' keys/values are then read from the paged cache. With an
FP8 output the functional operator returns ``float8_e4m3fn``; the in-place one writes ``out`` (FP8 e4m3).

The tensors and their semantics are those of :func:`pagedprefill.prefill_attention`. The operators run
``pagedprefill.dispatch`` (shape, dtype and device checks, which the meta implementation also performs while
tracing, so a wrong call fails at compile time with the same message). The public functions
(:func:`pagedprefill.prefill_attention`, both ``context_attention_fwd``) call ``prefill_attention_``
themselves while ``torch.compile`` traces them, so compiling code that calls them needs no change.

Example::

    import pagedprefill  # registers the operators

    @torch.compile(fullgraph=True)
    def attend(q, k, v, k_cache, v_cache, block_table, query_start, seq_lens, context_lens, k_scale, v_scale):
        return torch.ops.pagedprefill.prefill_attention(
            q, k, v, k_cache, v_cache, block_table, query_start, seq_lens, context_lens,
            kv_cache_dtype="fp8", k_scale_tensor=k_scale, v_scale_tensor=v_scale, sliding_window=4096)

The operators have no autograd formula (inference only): call them on tensors that do not require grad
(under ``torch.no_grad()`` or ``torch.inference_mode()``). The Triton backends launch without any host
synchronisation, so the operators can be captured in a CUDA graph (``mode="reduce-overhead"``); the
``reference`` backend reads the lengths on the host and cannot be captured.

This module imports neither Triton nor any backend: Triton is imported by the first call that runs a Triton
backend, as with the Python API.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .runtime import _new_output, dispatch
from .types import KVLayout, PrefillProblem
from .validation import ARGUMENT_NAMES, ArgumentNames, validate_problem

__all__ = ["LIBRARY_NAMESPACE", "SCHEMA_ABSENT", "build_problem", "op_arguments", "prefill_attention",
           "prefill_attention_"]

LIBRARY_NAMESPACE = "pagedprefill"

#: The operators' value for an absent scalar option (``None`` in the typed objects). Any value not above it
#: means absent too: ``sm_scale <= 0``, ``sliding_window <= 0``, ``max_query_len < 0``, ``fp8_out_scale <= 0``.
SCHEMA_ABSENT = {"sm_scale": 0.0, "sliding_window": 0, "max_query_len": -1, "fp8_out_scale": 0.0}


def _from_schema(name: str, value):
    """An operator's scalar ``name`` as the typed objects hold it: None when it says absent."""
    return value if value > SCHEMA_ABSENT[name] else None


def _to_schema(name: str, value):
    """The typed objects' ``value`` of ``name`` as an operator argument: the sentinel for None."""
    return SCHEMA_ABSENT[name] if value is None else value


def _out_scale(fp8_out_scale: float, fp8_out_scale_tensor: Optional[torch.Tensor]):
    """The FP8 output scale an operator call describes (the tensor wins), None without one."""
    if fp8_out_scale_tensor is not None:
        return fp8_out_scale_tensor
    return _from_schema("fp8_out_scale", fp8_out_scale)


def build_problem(*args, **kwargs) -> PrefillProblem:
    """The :class:`PrefillProblem` an in-place operator call describes, from the arguments of
    ``torch.ops.pagedprefill.prefill_attention_`` (positional or by name; ``backend``, ``validate`` and
    ``argument_names`` are ignored), the schema's sentinels converted to ``None`` (:data:`SCHEMA_ABSENT`)."""
    a = _bound(inspect.signature(_prefill_attention_inplace), args, kwargs)
    layout = a["layout"]
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected 'nhd', 'split' or 'auto', got {type(layout).__name__}")
    cache_layout = None
    if layout.lower() != "auto":
        try:
            cache_layout = KVLayout(layout.lower())
        except ValueError:
            raise ValueError(f"layout: expected 'nhd', 'split' or 'auto', got {layout!r}") from None
    tensors = [a[name] for name in ("q", "k", "v", "out", "k_cache", "v_cache", "block_table", "query_start",
                                    "seq_lens", "context_lens")]
    return PrefillProblem.from_tensors(
        *tensors, layout=cache_layout, kv_cache_dtype=a["kv_cache_dtype"],
        k_scale=a["k_scale_tensor"] if a["k_scale_tensor"] is not None else a["k_scale"],
        v_scale=a["v_scale_tensor"] if a["v_scale_tensor"] is not None else a["v_scale"],
        max_query_len=_from_schema("max_query_len", a["max_query_len"]),
        sm_scale=_from_schema("sm_scale", a["sm_scale"]), alibi_slopes=a["alibi_slopes"],
        sliding_window=_from_schema("sliding_window", a["sliding_window"]), softcap=a["softcap"], sinks=a["sinks"],
        causal=a["causal"], skip_decode=a["skip_decode"],
        fp8_out_scale=_out_scale(a["fp8_out_scale"], a["fp8_out_scale_tensor"]),
    )


def op_arguments(problem: PrefillProblem, backend: str = "") -> tuple[tuple, dict]:
    """The inverse of :func:`build_problem`: the functional op's positional tensors and keyword scalars.

    ``torch.ops.pagedprefill.prefill_attention(*tensors, **kwargs)`` computes ``problem``; for the in-place
    op insert the output after ``v``: ``tensors[:3] + (out,) + tensors[3:]``.
    """
    c, b, o = problem.cache, problem.batch, problem.options
    tensors = (problem.q, problem.k, problem.v, c.key, c.value, b.block_table, b.query_start, b.seq_lens,
               b.context_lens)
    kwargs = dict(layout=c.layout.value, kv_cache_dtype=c.dtype.value, sm_scale=_to_schema("sm_scale", o.sm_scale),
                  sliding_window=_to_schema("sliding_window", o.sliding_window), softcap=float(o.softcap),
                  alibi_slopes=o.alibi_slopes, sinks=o.sinks,
                  max_query_len=_to_schema("max_query_len", b.max_query_len), backend=backend)
    if not o.causal:
        kwargs["causal"] = False
    if o.skip_decode:
        kwargs["skip_decode"] = True
    scales = [("k_scale", c.k_scale), ("v_scale", c.v_scale)]
    if o.fp8_out_scale is not None:
        scales.append(("fp8_out_scale", o.fp8_out_scale))
    for name, scale in scales:
        if isinstance(scale, torch.Tensor):
            kwargs[name + "_tensor"] = scale
        else:
            kwargs[name] = float(scale)
    return tensors, kwargs


def _names(argument_names: str) -> ArgumentNames:
    """The names record an operator's ``argument_names`` selects."""
    if argument_names not in ARGUMENT_NAMES:
        raise ValueError(f"argument_names: expected one of {', '.join(map(repr, ARGUMENT_NAMES))}, "
                         f"got {argument_names!r}")
    return ARGUMENT_NAMES[argument_names]


def _run(problem: PrefillProblem, backend: str, validate: str, argument_names: str) -> None:
    dispatch(problem, backend=backend or None, validate=validate, names=_names(argument_names))


def _check(problem: PrefillProblem, argument_names: str) -> None:
    """The ``basic`` validation (shapes, dtypes, devices only), usable on fake tensors while tracing."""
    validate_problem(problem, "basic", _names(argument_names))


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """An operator call's arguments by name, defaults filled in (how the fake implementations read them)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _prefill_attention(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    layout: str = "auto",
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scale_tensor: Optional[torch.Tensor] = None,
    v_scale_tensor: Optional[torch.Tensor] = None,
    sm_scale: float = 0.0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    max_query_len: int = -1,
    backend: str = "",
    causal: bool = True,
    skip_decode: bool = False,
    fp8_out_scale: float = 0.0,
    fp8_out_scale_tensor: Optional[torch.Tensor] = None,
    validate: str = "basic",
    argument_names: str = "native",
) -> torch.Tensor:
    """Prefix-prefill attention over a paged KV cache; returns a new ``[T, H, D]`` tensor (see the module)."""
    arguments = dict(locals())
    out = _new_output(q, _out_scale(fp8_out_scale, fp8_out_scale_tensor), skip_decode)
    _run(build_problem(**dict(arguments, out=out)), backend, validate, argument_names)
    return out


prefill_attention = torch.library.custom_op(f"{LIBRARY_NAMESPACE}::prefill_attention", _prefill_attention,
                                            mutates_args=())


@prefill_attention.register_fake
def _prefill_attention_fake(*args, **kwargs):
    arguments = _bound(inspect.signature(_prefill_attention), args, kwargs)
    fp8_out = _out_scale(arguments["fp8_out_scale"], arguments["fp8_out_scale_tensor"]) is not None
    q = arguments["q"]
    out = torch.empty_like(q, dtype=torch.float8_e4m3fn if fp8_out else q.dtype)
    _check(build_problem(**dict(arguments, out=out)), arguments["argument_names"])
    return out


def _prefill_attention_inplace(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    layout: str = "auto",
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scale_tensor: Optional[torch.Tensor] = None,
    v_scale_tensor: Optional[torch.Tensor] = None,
    sm_scale: float = 0.0,
    sliding_window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    max_query_len: int = -1,
    backend: str = "",
    causal: bool = True,
    skip_decode: bool = False,
    fp8_out_scale: float = 0.0,
    fp8_out_scale_tensor: Optional[torch.Tensor] = None,
    validate: str = "basic",
    argument_names: str = "native",
) -> None:
    """Prefix-prefill attention over a paged KV cache, written into ``out`` ``[T, H, D]`` (see the module)."""
    _run(build_problem(**locals()), backend, validate, argument_names)


prefill_attention_ = torch.library.custom_op(f"{LIBRARY_NAMESPACE}::prefill_attention_", _prefill_attention_inplace,
                                             mutates_args=("out",))


@prefill_attention_.register_fake
def _prefill_attention_inplace_fake(*args, **kwargs):
    arguments = _bound(inspect.signature(_prefill_attention_inplace), args, kwargs)
    _check(build_problem(**arguments), arguments["argument_names"])
    return None
