"""Every signature that takes the attention's options agrees with their one description,
:data:`pagedprefill.options.OPTIONS`.

Adding an option touches: its row in the description (``options.py``) and its field of the object holding it
(``AttentionOptions`` for an attention option); the public signatures that take it (``prefill_attention``,
and the drop-ins where the engines they copy have it), which these tests check against the row; the
reference (``reference_impl.py``); the kernel and its launch; and a test of its values. The operators'
schemas, their conversions and fake implementations, ``PrefillProblem.from_tensors``, the launch plans'
signature, the optional features and the validation of a known kind of value follow from the row.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import pagedprefill as pp
import pagedprefill.vllm
import pytest
import torch
from pagedprefill import ops, plans
from pagedprefill.calls import drop_in_window
from pagedprefill.features import FEATURE_DESCRIPTIONS
from pagedprefill.options import APIS, BY_NAME, FEATURES, HOLDERS, OPTIONS, held_by
from pagedprefill.workloads import BatchSpec, make_problem

PUBLIC = {"native": pp.prefill_attention, "drop_in": pp.context_attention_fwd,
          "vllm": pagedprefill.vllm.context_attention_fwd}

#: The parameters of each public function that are not options: the tensors, and the vLLM signature's
#: arguments it ignores (``max_seq_len``) or refuses (``is_block_table_ptr``).
NOT_OPTIONS = {
    "native": ("q", "k", "v", "cache", "batch", "out"),
    "drop_in": ("q", "k", "v", "o", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len", "b_ctx_len"),
    "vllm": ("q", "k", "v", "o", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len", "max_seq_len",
             "is_block_table_ptr"),
}

HOLDER_CLASSES = {"cache": pp.PagedKVCache, "batch": pp.BatchMetadata, "options": pp.AttentionOptions}


def test_the_description_is_well_formed():
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)
    for o in OPTIONS:
        assert o.held_by in HOLDERS, o
        assert set(o.spelled) <= set(APIS), o
        if o.held_by == "tensor":
            assert o.schema is torch.Tensor and BY_NAME[o.tensor_of].schema is float, o
        if o.held_by == "options":
            assert o.check, f"{o.name}: an attention option names the check validation runs on it"
        if o.absent_in_schema and o.schema is not str:
            assert o.from_schema(o.schema_default) is None and o.to_schema(None) == o.schema_default


@pytest.mark.parametrize("holder", sorted(HOLDER_CLASSES))
def test_each_holder_has_a_field_per_option(holder):
    """The typed objects hold exactly the options the description gives them, with the same defaults."""
    cls = HOLDER_CLASSES[holder]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    described = {o.attribute: o for o in held_by(holder)}
    tensors = {"cache": {"key", "value"}, "batch": {"query_start", "seq_lens", "context_lens", "block_table"},
               "options": set()}[holder]
    assert set(fields) - tensors == set(described), f"{cls.__name__} fields against the description"
    for name, o in described.items():
        if o.name == "layout":  # the typed default NHD; from_tensors' None reads it from the key cache's rank
            continue
        assert fields[name].default == o.default, f"{cls.__name__}.{name}"


@pytest.mark.parametrize("api", APIS)
def test_each_public_signature_takes_the_options_spelled_for_it(api):
    parameters = inspect.signature(PUBLIC[api]).parameters
    options = {name: p for name, p in parameters.items() if name not in NOT_OPTIONS[api]}
    spelled = {o.spelled[api]: o for o in OPTIONS if api in o.spelled}
    assert set(options) == set(spelled), f"{api}: parameters against the description's spellings"
    for name, p in options.items():
        if p.default is not inspect.Parameter.empty:  # the drop-ins require some, as the originals do
            assert p.default == spelled[name].default, f"{api}: {name}={p.default!r}"


@pytest.mark.parametrize(("signature", "out"), [(ops.FUNCTIONAL_SIGNATURE, False), (ops.INPLACE_SIGNATURE, True)])
def test_the_operators_take_every_option_with_the_schema_default(signature, out):
    names = list(signature.parameters)
    tensors = [name for name, _ in ops.TENSORS]
    if out:
        tensors.insert(3, "out")
    assert names == tensors + [o.name for o in OPTIONS]
    for o in OPTIONS:
        assert signature.parameters[o.name].default == o.schema_default


def test_the_schemas_are_derived():
    for op in (torch.ops.pagedprefill.prefill_attention, torch.ops.pagedprefill.prefill_attention_):
        schema = str(op.default._schema)
        for o in OPTIONS:
            assert f" {o.name}=" in schema, f"{o.name} missing from {schema}"
    assert ops.SCHEMA_ABSENT == {"sm_scale": 0.0, "sliding_window": 0, "max_query_len": -1, "fp8_out_scale": 0.0}


def test_features_follow_the_description():
    assert FEATURES == set(FEATURE_DESCRIPTIONS) == {"kv_in_cache", "fp8_query", "non_causal", "skip_decode",
                                                     "fp8_out_scale"}
    assert pp.types.FEATURES is FEATURES


SPEC = BatchSpec(query_lens=(3, 1), context_lens=(5, 0), num_heads=4, num_kv_heads=2, head_size=16, block_size=4)

#: A value other than the default for each option the typed objects hold.
CHANGED = {"layout": "split", "kv_cache_dtype": "fp8_e5m2", "k_scale": 0.5, "v_scale": torch.tensor([0.25]),
           "sm_scale": 0.3, "sliding_window": 3, "softcap": 4.0, "alibi_slopes": torch.ones(4), "sinks": torch.ones(4),
           "max_query_len": 7, "causal": False, "skip_decode": True, "fp8_out_scale": 0.1, "q_scale": 0.5}


def test_every_held_option_has_a_changed_value_here():
    assert set(CHANGED) == {o.name for o in OPTIONS if o.held_by in HOLDER_CLASSES}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_the_operators_convert_each_option_both_ways(name):
    """``op_arguments`` and ``build_problem`` are inverse for a changed value of every option; the launch plans'
    signature tells the two problems apart."""
    base = make_problem(SPEC)
    tensors, kwargs = ops.op_arguments(base)
    value = CHANGED[name]
    o = BY_NAME[name]
    tensor = next((t for t in OPTIONS if t.tensor_of == name), None)
    if tensor is not None and isinstance(value, torch.Tensor):
        kwargs[tensor.name] = value
    else:
        kwargs[name] = value
    built = ops.build_problem(*tensors[:3], base.out, *tensors[3:], **kwargs)
    holder = {"cache": built.cache, "batch": built.batch, "options": built.options}[o.held_by]
    held = getattr(holder, o.attribute)
    assert held is value if isinstance(value, torch.Tensor) else held == value
    again_tensors, again = ops.op_arguments(built)
    rebuilt = ops.build_problem(*again_tensors[:3], base.out, *again_tensors[3:], **again)
    assert plans.call_signature(rebuilt, None, None) == plans.call_signature(built, None, None)
    assert plans.call_signature(built, None, None) != plans.call_signature(base, None, None)


@pytest.mark.parametrize("name", ["sm_scale", "sliding_window", "max_query_len", "fp8_out_scale"])
@pytest.mark.parametrize("absent", ["default", "below"])
def test_absent_is_none_inside(name, absent):
    """The operators' absent values arrive as None, the one encoding inside the library."""
    base = make_problem(SPEC)
    tensors, kwargs = ops.op_arguments(base)
    o = BY_NAME[name]
    kwargs[name] = o.schema_default if absent == "default" else o.schema_default - 1
    built = ops.build_problem(*tensors[:3], base.out, *tensors[3:], **kwargs)
    holder = {"batch": built.batch, "options": built.options}[o.held_by]
    assert getattr(holder, o.attribute) is None


@pytest.mark.parametrize("window", [None, 0, -1])
def test_drop_ins_spell_no_window_as_the_operators_do(window):
    p = make_problem(SPEC)
    c, b = p.cache, p.batch
    problem = pp.PrefillProblem.from_tensors(p.q, p.k, p.v, p.out, c.key, c.value, b.block_table, b.query_start,
                                             b.seq_lens, b.context_lens,
                                             sliding_window=drop_in_window(window))
    assert problem.options.sliding_window is None
    assert pp.AttentionOptions(sliding_window=0).sliding_window is None  # the typed objects' own spelling


def test_from_tensors_refuses_what_is_not_an_option():
    p = make_problem(SPEC)
    c, b = p.cache, p.batch
    with pytest.raises(TypeError, match=r"unexpected arguments \['backend'\]"):
        pp.PrefillProblem.from_tensors(p.q, p.k, p.v, p.out, c.key, c.value, b.block_table, b.query_start,
                                       b.seq_lens, b.context_lens, backend="reference")


def _annotation(o) -> type:
    return Optional[torch.Tensor] if o.schema is torch.Tensor else o.schema


def test_operator_annotations_follow_the_schema_types():
    for o in OPTIONS:
        assert ops.FUNCTIONAL_SIGNATURE.parameters[o.name].annotation == _annotation(o)
