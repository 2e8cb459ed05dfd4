"""Launch plans: a repeated call signature skips validation, selection and policy, and only launches."""

import dataclasses
import os

import pagedprefill as pp
import pytest
import torch
from pagedprefill import api, plans, runtime
from pagedprefill.testing import BatchSpec, fresh_output, make_problem

SPEC = BatchSpec(query_lens=(5, 3), context_lens=(9, 17), num_heads=4, num_kv_heads=2, head_size=32, block_size=8)


class Counting(pp.Backend):
    name = "counting"
    priority = 10_000

    def __init__(self):
        self.runs = 0

    def supports(self, device):
        return []

    def run(self, problem, device):
        self.runs += 1
        pp.get_registry().get("reference").run(problem, device)


@pytest.fixture
def counting(monkeypatch):
    backend = Counting()
    calls = {"validate": 0}
    original = runtime.validate_problem

    def counted(*args, **kwargs):
        calls["validate"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(runtime, "validate_problem", counted)
    plans.forget()
    yield backend, calls
    plans.forget()


def test_second_call_with_the_same_signature_skips_validation(counting):
    backend, calls = counting
    first = make_problem(SPEC)
    api.dispatch(first, backend=backend)
    again = make_problem(SPEC.replace(seed=1))  # new data, same shapes: the plan serves it
    api.dispatch(again, backend=backend)
    assert backend.runs == 2 and calls["validate"] == 1
    expect = fresh_output(again)
    pp.get_registry().get("reference").run(expect, pp.DeviceInfo.detect("cpu"))
    torch.testing.assert_close(again.out, expect.out)


def test_another_signature_is_validated(counting):
    backend, calls = counting
    api.dispatch(make_problem(SPEC), backend=backend)
    api.dispatch(make_problem(SPEC.replace(query_lens=(5, 4))), backend=backend)  # another token count
    api.dispatch(make_problem(SPEC.replace(sliding_window=4)), backend=backend)    # another option value
    assert calls["validate"] == 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_call_changing_only_qs_dtype_is_validated(counting, dtype):
    """q's dtype is part of the signature: after a float16 call, a q of the same shape in another dtype (with
    k, v, out and the cache still float16) is checked, not launched by the float16 call's plan."""
    backend, calls = counting
    first = make_problem(SPEC)
    assert first.q.dtype == torch.float16
    api.dispatch(first, backend=backend)
    again = fresh_output(first)
    again = dataclasses.replace(again, q=again.q.to(dtype))
    with pytest.raises(TypeError, match=r"^q: expected dtype float16, bfloat16, float32 or float8_e4m3fn \(an FP8 q, "
                                        r"with q_scale\), got float64$"
                       if dtype == torch.float64 else r"^out: expected dtype float32 \(the dtype of q\), got float16$"):
        api.dispatch(again, backend=backend)
    assert backend.runs == 1 and calls["validate"] == 2


def test_a_batch_without_context_lengths_has_a_signature_of_its_own(counting):
    """The kernels derive missing context lengths under a flag of their own: a batch that gives them and one that
    does not (the same tensors otherwise) are two signatures, each validated and planned for itself."""
    backend, calls = counting
    given = make_problem(SPEC)
    derived = dataclasses.replace(given, batch=dataclasses.replace(given.batch, context_lens=None))
    assert plans.call_signature(given, backend, None) != plans.call_signature(derived, backend, None)
    api.dispatch(given, backend=backend)
    api.dispatch(derived, backend=backend)
    api.dispatch(derived, backend=backend)
    assert backend.runs == 3 and calls["validate"] == 2


def test_full_validation_never_uses_a_plan(counting):
    backend, calls = counting
    p = make_problem(SPEC)
    api.dispatch(p, backend=backend)
    api.dispatch(p, backend=backend, validate="full")
    assert calls["validate"] == 2


def test_a_call_that_fails_validation_leaves_no_plan(counting):
    backend, calls = counting
    p = make_problem(SPEC)
    bad = dataclasses.replace(p, out=p.out[:, :2])
    for _ in range(2):
        with pytest.raises(ValueError, match="out"):
            api.dispatch(bad, backend=backend)
    assert backend.runs == 0 and calls["validate"] == 2


def test_reset_registry_forgets_plans(counting):
    backend, calls = counting
    api.dispatch(make_problem(SPEC), backend=backend)
    plans.forget()
    api.dispatch(make_problem(SPEC), backend=backend)
    assert calls["validate"] == 2


def test_unhashable_arguments_get_the_validation_error():
    p = make_problem(SPEC)
    bad = dataclasses.replace(p, options=dataclasses.replace(p.options, sliding_window=[4]))
    with pytest.raises(ValueError, match="sliding_window"):
        api.dispatch(bad, backend="reference")


def test_the_reference_reads_values_every_call():
    """The reference checks metadata values on every call, so it is never planned."""
    plans.forget()
    p = make_problem(SPEC)
    api.dispatch(p, backend="reference")
    table = p.batch.block_table.clone()
    table[0, 0] = 10_000
    bad = dataclasses.replace(p, batch=dataclasses.replace(p.batch, block_table=table))
    with pytest.raises(ValueError, match="block_table"):
        api.dispatch(bad, backend="reference")


def test_a_signature_follows_the_backend_and_table_variables_as_they_change(counting, monkeypatch, tmp_path):
    """The two variables every signature reads are read afresh on each call: setting, changing or unsetting
    either gives another signature, and restoring it gives the first one back."""
    backend, _ = counting
    p = make_problem(SPEC)
    monkeypatch.delenv("PAGEDPREFILL_BACKEND", raising=False)
    monkeypatch.delenv("PAGEDPREFILL_TUNE_DIR", raising=False)
    first = plans.call_signature(p, backend, None)
    seen = {first}
    for name, value in (("PAGEDPREFILL_BACKEND", "reference"), ("PAGEDPREFILL_BACKEND", "generic"),
                        ("PAGEDPREFILL_TUNE_DIR", str(tmp_path))):
        monkeypatch.setenv(name, value)
        signature = plans.call_signature(p, backend, None)
        assert signature not in seen, (name, value)
        seen.add(signature)
    monkeypatch.delenv("PAGEDPREFILL_BACKEND")
    monkeypatch.delenv("PAGEDPREFILL_TUNE_DIR")
    assert plans.call_signature(p, backend, None) == first


@pytest.mark.parametrize("value", ["generic", "", "généric, reference"])
def test_a_variable_reader_gives_what_os_environ_gives(monkeypatch, value):
    from pagedprefill.environment import variable

    read = variable("PAGEDPREFILL_TEST_VARIABLE")
    monkeypatch.delenv("PAGEDPREFILL_TEST_VARIABLE", raising=False)
    assert read() is None
    monkeypatch.setenv("PAGEDPREFILL_TEST_VARIABLE", value)
    assert read() == value == os.environ.get("PAGEDPREFILL_TEST_VARIABLE")
    monkeypatch.setattr(os, "environ", {"PAGEDPREFILL_TEST_VARIABLE": "a stand-in"})
    assert read() == "a stand-in"
