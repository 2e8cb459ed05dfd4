"""The one description of every argument of the attention besides its tensors.

Each :class:`Option` says which typed object holds the argument, its default there (``None`` where it can
be absent), its type and default in the custom operators' schema (which has no ``None`` for a float, an int
or a str, so the default there is the value meaning "absent"), how the input validation checks it, which
optional feature a non-default value uses, and how each public function spells it. :data:`OPTIONS` lists them
in the operators' schema order.

What is derived from it: the operators' schema and Python signatures, their conversion in both directions
and their fake implementations (:mod:`pagedprefill.ops`), the builders
:meth:`~pagedprefill.PrefillProblem.build` and :meth:`~pagedprefill.PrefillProblem.from_tensors`, the checks of
the attention options (:mod:`pagedprefill.validation`), the launch plans' call signature
(:mod:`pagedprefill.plans`), the optional features (:data:`FEATURES`,
:attr:`PrefillProblem.features <pagedprefill.PrefillProblem.features>`,
:data:`pagedprefill.features.FEATURE_DESCRIPTIONS`). The public signatures are written out, so that readers
and type checkers see them; ``packages/core/tests/test_options.py`` checks each against this table.

Inside the library an absent ``sm_scale``, ``sliding_window``, ``max_query_len`` or ``fp8_out_scale`` is
``None`` and nothing else; :meth:`Option.from_schema` is the one conversion from the spelling that says
"absent" with a number (the operators, and the drop-in signatures' ``sliding_window <= 0``).
"""

from __future__ import annotations

import dataclasses
import enum
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

__all__ = ["APIS", "BY_NAME", "FEATURES", "HOLDERS", "OPTIONS", "Option", "held_by", "tensor_form"]

#: The public functions that spell options, by the key :attr:`Option.spelled` uses: ``native``:
#: :func:`pagedprefill.prefill_attention`; ``drop_in``: :func:`pagedprefill.context_attention_fwd`; ``vllm``:
#: :func:`pagedprefill.vllm.context_attention_fwd`. The operators take every option under its own name.
APIS = ("native", "drop_in", "vllm")

#: Where an option lives: a field of :class:`~pagedprefill.PagedKVCache` (``cache``),
#: :class:`~pagedprefill.BatchMetadata` (``batch``) or :class:`~pagedprefill.AttentionOptions` (``options``);
#: an argument of the call itself (``call``: the backend asked for, the validation level, the names errors
#: use); or the tensor form of another option in the operators (``tensor``: see :attr:`Option.tensor_of`).
HOLDERS = ("cache", "batch", "options", "call", "tensor")

#: The optional features that are not options: ``k = v = None`` (the new tokens' keys/values in the cache),
#: and an FP8 ``q`` (quantised by the caller, its descale passed as ``q_scale``).
KV_IN_CACHE = ("kv_in_cache", "k = v = None (new tokens' keys/values read from the paged cache)")
FP8_QUERY = ("fp8_query", "fp8_query: q of dtype float8_e4m3fn (with q_scale)")


@dataclasses.dataclass(frozen=True)
class Option:
    """One argument of the attention besides its tensors.

    Attributes:
        name: the operators' argument, and the field of the typed object holding it unless ``field`` says
            otherwise.
        held_by: one of :data:`HOLDERS`.
        schema: the operators' Python type: ``float``, ``int``, ``bool``, ``str`` or ``torch.Tensor`` (an
            optional tensor).
        schema_default: the operators' default. Where ``default`` is None it is the value meaning "absent":
            a number not above it, or the same string, is read as None (:meth:`from_schema`).
        default: the default of the typed objects and of the public functions (None: absent).
        holder_field: the attribute of the holder, where it differs from ``name``.
        tensor_of: for ``held_by="tensor"``, the option whose value may be given as this 1-element tensor
            instead (the tensor wins over the float).
        check: how :mod:`pagedprefill.validation` checks an attention option (a key of its checks).
        feature: ``(name, how the caller uses it)``: the optional feature a value other than ``default``
            uses, which a backend may not run (:mod:`pagedprefill.features`).
        spelled: the public functions taking it (keys of :data:`APIS`) and the name each gives it.
    """

    name: str
    held_by: str
    schema: type
    schema_default: Any
    default: Any = None
    holder_field: str = ""
    tensor_of: str = ""
    check: str = ""
    feature: Optional[tuple[str, str]] = None
    spelled: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def attribute(self) -> str:
        """The attribute of the holder (``PagedKVCache.dtype`` for ``kv_cache_dtype``, else ``name``)."""
        return self.holder_field or self.name

    @property
    def absent_in_schema(self) -> bool:
        """Whether the operators say "absent" with a value (``default`` is None, the schema has no None)."""
        return self.default is None and self.schema is not torch.Tensor

    def from_schema(self, value: Any) -> Any:
        """``value`` as the typed objects hold it: None where the schema's spelling says absent.

        Only a value of the schema's type is read (an int for an int option, an int or float for a float
        one, a str for a str one): anything else is left for validation to refuse with its message.
        """
        if not self.absent_in_schema:
            return value
        if self.schema is str:
            return None if value == self.schema_default else value
        kinds = int if self.schema is int else (int, float)
        if isinstance(value, kinds) and not isinstance(value, bool) and value <= self.schema_default:
            return None
        return value

    def to_schema(self, value: Any) -> Any:
        """The typed objects' ``value`` as an operator argument (the schema's absent value for None)."""
        if value is None:
            return self.schema_default
        if isinstance(value, enum.Enum):  # the layout and the cache format: their strings
            value = value.value
        return float(value) if self.schema is float else value


def _option(name: str, held_by: str, schema: type, schema_default: Any, default: Any = None, *,
            apis: tuple = APIS, renamed: Optional[Mapping[str, str]] = None, **rest) -> Option:
    spelled = {api: name for api in apis}
    spelled.update(renamed or {})
    return Option(name, held_by, schema, schema_default, default, spelled=MappingProxyType(spelled), **rest)


_CLASSIC = ("drop_in", "vllm")

#: Every option, in the operators' schema order (a new option goes at the end: callers may pass the
#: operators' arguments by position).
OPTIONS: tuple[Option, ...] = (
    _option("layout", "cache", str, "auto", apis=()),
    _option("kv_cache_dtype", "cache", str, "auto", "auto", holder_field="dtype", apis=_CLASSIC),
    _option("k_scale", "cache", float, 1.0, 1.0, apis=_CLASSIC),
    _option("v_scale", "cache", float, 1.0, 1.0, apis=_CLASSIC),
    _option("k_scale_tensor", "tensor", torch.Tensor, None, tensor_of="k_scale", apis=()),
    _option("v_scale_tensor", "tensor", torch.Tensor, None, tensor_of="v_scale", apis=()),
    _option("sm_scale", "options", float, 0.0, check="scale"),
    _option("sliding_window", "options", int, 0, check="window"),
    _option("softcap", "options", float, 0.0, 0.0, check="cap"),
    _option("alibi_slopes", "options", torch.Tensor, None, check="per_head"),
    _option("sinks", "options", torch.Tensor, None, check="per_head"),
    _option("max_query_len", "batch", int, -1, apis=_CLASSIC, renamed={"drop_in": "max_input_len",
                                                                        "vllm": "max_input_len"}),
    _option("backend", "call", str, ""),
    _option("causal", "options", bool, True, True, check="flag", apis=("native", "vllm"),
            feature=("non_causal", "causal=False")),
    _option("skip_decode", "options", bool, False, False, check="flag", apis=("native", "vllm"),
            feature=("skip_decode", "skip_decode=True")),
    _option("fp8_out_scale", "options", float, 0.0, check="out_scale", apis=("native", "vllm"),
            feature=("fp8_out_scale", "fp8_out_scale (FP8 output)")),
    _option("fp8_out_scale_tensor", "tensor", torch.Tensor, None, tensor_of="fp8_out_scale", apis=()),
    _option("validate", "call", str, "basic", "basic"),
    _option("argument_names", "call", str, "native", "native", apis=()),
    _option("q_scale", "options", float, 1.0, 1.0, check="q_scale"),
    _option("q_scale_tensor", "tensor", torch.Tensor, None, tensor_of="q_scale", apis=()),
)

#: The options by name.
BY_NAME: Mapping[str, Option] = MappingProxyType({o.name: o for o in OPTIONS})

#: Names of the optional features a backend may or may not run (see ``PrefillProblem.features``):
#: ``kv_in_cache`` (``k``/``v`` are None: the new tokens' keys/values are read from the paged cache),
#: ``fp8_query`` (an FP8 ``q``) and the feature of each option that has one (``non_causal``, ``skip_decode``,
#: ``fp8_out_scale``).
FEATURES = frozenset({KV_IN_CACHE[0], FP8_QUERY[0], *(o.feature[0] for o in OPTIONS if o.feature)})


def held_by(holder: str) -> tuple[Option, ...]:
    """The options a holder (one of :data:`HOLDERS`) holds, in schema order."""
    return _HELD_BY.get(holder, ())


#: held_by's answers, computed once: every call of the public functions reads them.
_HELD_BY: Mapping[str, tuple[Option, ...]] = MappingProxyType(
    {holder: tuple(o for o in OPTIONS if o.held_by == holder) for holder in HOLDERS})


def tensor_form(name: str) -> Optional[Option]:
    """The operators' tensor form of option ``name`` (``k_scale_tensor`` for ``k_scale``), or None."""
    return next((o for o in OPTIONS if o.tensor_of == name), None)
