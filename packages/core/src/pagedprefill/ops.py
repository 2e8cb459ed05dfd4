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
``max_query_len`` and ``fp8_out_scale`` say "absent" with the values above (:data:`SCHEMA_ABSENT`), where the
typed objects (:class:`~pagedprefill.AttentionOptions`, :class:`~pagedprefill.BatchMetadata`) say ``None``.
This module is the one place that converts between the two (:func:`build_problem` and :func:`op_arguments`).

The arguments after the tensors, their types and defaults, and the conversions are those of
:data:`pagedprefill.options.OPTIONS`: the operators' signatures (hence their schemas) are derived from it.

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

from .options import BY_NAME, OPTIONS, Option, held_by, tensor_form
from .runtime import dispatch, new_output
from .types import KVLayout, PrefillProblem
from .validation import ARGUMENT_NAMES, ArgumentNames, validate_problem

__all__ = ["LIBRARY_NAMESPACE", "SCHEMA_ABSENT", "build_problem", "op_arguments", "prefill_attention",
           "prefill_attention_"]

LIBRARY_NAMESPACE = "pagedprefill"

#: The operators' value for an absent scalar option (``None`` in the typed objects). Any value not above it
#: means absent too: ``sm_scale <= 0``, ``sliding_window <= 0``, ``max_query_len < 0``, ``fp8_out_scale <= 0``.
SCHEMA_ABSENT = {o.name: o.schema_default for o in OPTIONS if o.absent_in_schema and o.schema is not str}

#: The operators' tensor arguments, in order; the in-place operator has ``out`` after ``v``.
TENSORS = (("q", torch.Tensor), ("k", Optional[torch.Tensor]), ("v", Optional[torch.Tensor]),
           ("k_cache", torch.Tensor), ("v_cache", torch.Tensor), ("block_table", torch.Tensor),
           ("query_start", torch.Tensor), ("seq_lens", torch.Tensor), ("context_lens", torch.Tensor))
#: The options the typed objects hold (the cache's, the batch's and the attention options).
_TYPED = held_by("cache") + held_by("batch") + held_by("options")
#: The FP8 output scale, which decides the functional operator's output dtype.
_FP8_OUT = BY_NAME["fp8_out_scale"]


def _signature(inplace: bool) -> inspect.Signature:
    """An operator's Python signature, from which ``torch.library`` infers its schema: the tensors, then every
    option of the description with the schema's type and default."""
    parameter = inspect.Parameter
    tensors = list(TENSORS)
    if inplace:
        tensors.insert(3, ("out", torch.Tensor))
    parameters = [parameter(name, parameter.POSITIONAL_OR_KEYWORD, annotation=kind) for name, kind in tensors]
    for o in OPTIONS:
        kind = Optional[torch.Tensor] if o.schema is torch.Tensor else o.schema
        parameters.append(parameter(o.name, parameter.POSITIONAL_OR_KEYWORD, annotation=kind,
                                    default=o.schema_default))
    return inspect.Signature(parameters, return_annotation=None if inplace else torch.Tensor)


FUNCTIONAL_SIGNATURE = _signature(inplace=False)
INPLACE_SIGNATURE = _signature(inplace=True)


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """An operator call's arguments by name, defaults filled in."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _typed(o: Option, arguments: dict):
    """Option ``o`` of an operator call as the typed objects hold it: its tensor form where one is given (it
    wins over the float), else the scalar with the schema's absent value read as None."""
    twin = tensor_form(o.name)
    if twin is not None and arguments[twin.name] is not None:
        return arguments[twin.name]
    return o.from_schema(arguments[o.name])


def _layout(layout) -> Optional[KVLayout]:
    """The layout an operator's ``layout`` names: None for ``"auto"`` (read from ``k_cache``)."""
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected 'nhd', 'split' or 'auto', got {type(layout).__name__}")
    if layout.lower() == "auto":
        return None
    try:
        return KVLayout(layout.lower())
    except ValueError:
        raise ValueError(f"layout: expected 'nhd', 'split' or 'auto', got {layout!r}") from None


def build_problem(*args, **kwargs) -> PrefillProblem:
    """The :class:`PrefillProblem` an in-place operator call describes, from the arguments of
    ``torch.ops.pagedprefill.prefill_attention_`` (positional or by name; ``backend``, ``validate`` and
    ``argument_names`` are ignored), the schema's absent values converted to ``None`` (:data:`SCHEMA_ABSENT`)."""
    return _problem(_bound(INPLACE_SIGNATURE, args, kwargs))


def _problem(a: dict) -> PrefillProblem:
    """:func:`build_problem` of an in-place call's arguments already bound by name (the operators bind theirs
    once and build from that)."""
    scalars = {o.name: _typed(o, a) for o in _TYPED}
    scalars["layout"] = _layout(a["layout"])
    tensors = [a[name] for name, _ in TENSORS]
    return PrefillProblem.from_tensors(*tensors[:3], a["out"], *tensors[3:], **scalars)


def op_arguments(problem: PrefillProblem, backend: str = "") -> tuple[tuple, dict]:
    """The inverse of :func:`build_problem`: the functional op's positional tensors and keyword scalars.

    ``torch.ops.pagedprefill.prefill_attention(*tensors, **kwargs)`` computes ``problem``; for the in-place
    op insert the output after ``v``: ``tensors[:3] + (out,) + tensors[3:]``.
    """
    c, b = problem.cache, problem.batch
    # The operators' schema takes the context lengths as a tensor: derived ones are computed here (on the device).
    tensors = (problem.q, problem.k, problem.v, c.key, c.value, b.block_table, b.query_start, b.seq_lens,
               b.context_lengths())
    holders = {"cache": c, "batch": b, "options": problem.options}
    kwargs = {"backend": backend}
    for o in _TYPED:
        value = getattr(holders[o.held_by], o.attribute)
        twin = tensor_form(o.name)
        if twin is not None and isinstance(value, torch.Tensor):
            kwargs[twin.name] = value
        else:
            kwargs[o.name] = o.to_schema(value)
    return tensors, kwargs


def _names(argument_names: str) -> ArgumentNames:
    """The names record an operator's ``argument_names`` selects."""
    if argument_names not in ARGUMENT_NAMES:
        raise ValueError(f"argument_names: expected one of {', '.join(map(repr, ARGUMENT_NAMES))}, "
                         f"got {argument_names!r}")
    return ARGUMENT_NAMES[argument_names]


def _dispatch_call(problem: PrefillProblem, arguments: dict) -> None:
    """Run ``problem`` through :func:`~pagedprefill.dispatch` with the call's backend, level and names."""
    dispatch(problem, backend=arguments["backend"] or None, validate=arguments["validate"],
             names=_names(arguments["argument_names"]))


def _check_fake(problem: PrefillProblem, arguments: dict) -> None:
    """The ``basic`` validation (shapes, dtypes, devices only), usable on fake tensors while tracing."""
    validate_problem(problem, "basic", _names(arguments["argument_names"]))


def _prefill_attention(*args, **kwargs) -> torch.Tensor:
    """Prefix-prefill attention over a paged KV cache; returns a new ``[T, H, D]`` tensor (see the module)."""
    a = _bound(FUNCTIONAL_SIGNATURE, args, kwargs)
    out = new_output(a["q"], _typed(_FP8_OUT, a), a["skip_decode"], a["k"], a["k_cache"])
    _dispatch_call(_problem(dict(a, out=out)), a)
    return out


_prefill_attention.__signature__ = FUNCTIONAL_SIGNATURE
prefill_attention = torch.library.custom_op(f"{LIBRARY_NAMESPACE}::prefill_attention", _prefill_attention,
                                            mutates_args=())


@prefill_attention.register_fake
def _prefill_attention_fake(*args, **kwargs):
    a = _bound(FUNCTIONAL_SIGNATURE, args, kwargs)
    q = a["q"]
    out = new_output(q, _typed(_FP8_OUT, a), False, a["k"], a["k_cache"])  # a fake tensor holds no values
    _check_fake(_problem(dict(a, out=out)), a)
    return out


def _prefill_attention_inplace(*args, **kwargs) -> None:
    """Prefix-prefill attention over a paged KV cache, written into ``out`` ``[T, H, D]`` (see the module)."""
    a = _bound(INPLACE_SIGNATURE, args, kwargs)
    _dispatch_call(_problem(a), a)


_prefill_attention_inplace.__signature__ = INPLACE_SIGNATURE
prefill_attention_ = torch.library.custom_op(f"{LIBRARY_NAMESPACE}::prefill_attention_", _prefill_attention_inplace,
                                             mutates_args=("out",))


@prefill_attention_.register_fake
def _prefill_attention_inplace_fake(*args, **kwargs):
    a = _bound(INPLACE_SIGNATURE, args, kwargs)
    _check_fake(_problem(a), a)
    return None
