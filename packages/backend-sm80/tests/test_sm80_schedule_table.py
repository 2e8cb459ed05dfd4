"""The Hopper kernel's schedule tables (:mod:`pagedprefill_sm80.hopper.flags`' flags, the routes' flags and the
register splits of :mod:`pagedprefill_sm80.hopper.schedule`) and every route the policy gives the kernel (no GPU
needed): each flag's default is :data:`DEFAULTS`', each register split fits the SM, each policy tile fits the
shared memory, and docs/backends/sm80.md shows the flags' table as it is.

:data:`RECORDED` holds, for each distinct call the policy and ``pagedprefill tune``'s search space hand the Hopper
kernel on the H200, the flags the policy sets, the flags they resolve to (and how a caller's flags move them), the
kernel's schedule constexpr and the shared memory it allocates: a change to how the schedule is described must
leave every one as it is. After a change meant to move a route, rewrite it with
``python packages/backend-sm80/tests/test_sm80_schedule_table.py`` and read the difference.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from pagedprefill import DeviceInfo
from pagedprefill.tiling import ProblemShape
from pagedprefill_sm80.hopper.flags import FLAGS, UNVERIFIED_FLAGS, flag_table
from pagedprefill_sm80.hopper.schedule import (
    DEFAULTS,
    HEAD_SIZES,
    PADDED_HEADS,
    PARTITIONS,
    SCHEDULE_ENV,
    SPLIT_ROUTES,
    kernel_schedule,
    parse,
    resolve,
    route_flags,
    shared_bytes,
)
from pagedprefill_sm80.policy import KERNEL_ENV, hopper_search_space, sm80_policy

#: The routes' schedules as recorded (see the module's docstring).
RECORDED = Path(__file__).with_name("schedule_routes.json")
#: The page that shows :data:`FLAGS` as a table, between these two lines.
DOCS = Path(__file__).resolve().parents[3] / "docs" / "backends" / "sm80.md"
DOCS_TABLE = ("<!-- flags: rendered by pagedprefill_sm80.hopper.flags.flag_table() -->", "<!-- /flags -->")
#: Shared memory per block of the H100 and the H200.
SM90_SHARED = 227 * 1024

H200 = DeviceInfo(type="cuda", index=0, vendor="nvidia", name="NVIDIA H200", capability=(9, 0), warp_size=32,
                  num_sms=132, max_shared_mem=SM90_SHARED, triton_backend="cuda")

#: What a call may bring that the policy or the schedule reads: the query's and the new tokens' form.
QUERIES = {"plain": {}, "in-cache": dict(kv_in_cache=True), "fp8-query": dict(fp8_query=True),
           "fp8-query+in-cache": dict(fp8_query=True, kv_in_cache=True)}
#: Short calls (many sequences of few new tokens) and long ones.
WORKLOADS = {"short": dict(num_tokens=64 * 128, num_seqs=64), "long": dict(num_tokens=8192, num_seqs=4)}


def policy_shapes():
    """Every combination of what the policy and the schedule read from a call: layout, head size, cache dtype,
    input dtype, query form, workload and page size."""
    for layout, head_size, cache, dtype, query, workload, page in itertools.product(
            ("nhd", "split"), (64, 96, 128, 256), ("auto", "fp8_e4m3", "fp8_e5m2"), (torch.bfloat16, torch.float16),
            QUERIES, WORKLOADS, (16, 128)):
        yield ProblemShape(head_size, 32, 8, dtype, kv_cache_dtype=cache, block_size=page, layout=layout,
                           **QUERIES[query], **WORKLOADS[workload])


def route_name(shape: ProblemShape, config) -> str:
    """What the schedule reads of a call and its tile, as one name."""
    query = "+".join(name for name, on in (("fp8-query", shape.fp8_query), ("in-cache", shape.kv_in_cache)) if on)
    return (f"{shape.layout}/{shape.head_size}/{shape.kv_cache_dtype.value}/{str(shape.dtype).split('.')[-1]}/"
            f"{query or 'plain'}/{config.block_m}x{config.block_n}x{config.num_warps}x{config.num_stages}")


def routes() -> dict:
    """Each distinct call the Hopper kernel gets on the H200, by :func:`route_name`: the policy's tile and the
    tiles ``pagedprefill tune`` measures."""
    out = {}
    for shape in policy_shapes():
        config = sm80_policy(shape, H200)
        if config.kernel != "hopper":
            continue
        for tile in (config, *hopper_search_space(shape, H200)):
            out.setdefault(route_name(shape, tile), (shape, tile))
    return dict(sorted(out.items()))


def written(values: dict) -> str:
    """Flags or a schedule in a line: the names of those that are on, then ``NAME=value`` for each number."""
    return " ".join(sorted(name if value is True else f"{name}={value}" for name, value in values.items()
                           if value is not False))


def observed(shape: ProblemShape, config) -> dict:
    """The schedule of one route: the policy's flags, the resolved flags, the kernel's constexpr and the modelled
    shared memory."""
    flags = resolve(shape, config)
    # The policy's flags in their order, which ``pagedprefill info`` names them in.
    policy = " ".join(name for name, on in route_flags(shape, config.block_n).items() if on)
    return {"route_flags": policy, "resolved": written(flags),
            "schedule": written(kernel_schedule(flags, shape, config)._asdict()),
            "shared_bytes": shared_bytes(shape, config), "asked": asked(shape, config, flags)}


def asked(shape: ProblemShape, config, flags: dict) -> dict:
    """How a caller's flags move the resolution (``resolve``'s ``schedule``, or :data:`SCHEDULE_ENV`): for each
    flag asked the other way than it resolved, and for every flag asked on and every flag asked off, the flags
    that turn on (``+``) and off (``-``), where any do, with the registers and producer warps that follow."""
    asks = {f"{name}={int(not value)}": {name: not value} for name, value in flags.items()}
    asks.update({"all=1": dict.fromkeys(flags, True), "all=0": dict.fromkeys(flags, False)})
    base = kernel_schedule(flags, shape, config)
    out = {}
    for label, ask in asks.items():
        got = resolve(shape, config, ask)
        moved = sorted(f"+{k}" if got[k] else f"-{k}" for k in flags if got[k] != flags[k])
        schedule = kernel_schedule(got, shape, config)
        moved += [f"{k}={getattr(schedule, k)}" for k in ("KEY_LOADS", "PRODUCER_WARPS", "PRODUCER_REGS",
                                                          "CONSUMER_REGS") if getattr(schedule, k) != getattr(base, k)]
        if moved:
            out[label] = " ".join(moved)
    return out


@pytest.fixture
def policy_only(monkeypatch, tmp_path):
    """The shipped table and the rules, without a user's table, a forced kernel or schedule flags of the
    environment."""
    from pagedprefill.tuning import forget_tables

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    monkeypatch.setenv("PAGEDPREFILL_TUNE_DIR", str(tmp_path))
    forget_tables()
    yield
    forget_tables()


def grouped(found: dict) -> list[dict]:
    """The routes' schedules as :data:`RECORDED` holds them: each distinct schedule once, with the routes that
    take it."""
    groups: dict[str, dict] = {}
    for name, (shape, config) in found.items():
        row = observed(shape, config)
        groups.setdefault(json.dumps(row, sort_keys=True), {**row, "routes": []})["routes"].append(name)
    return sorted(groups.values(), key=lambda group: group["routes"][0])


def test_every_route_resolves_as_recorded(policy_only):
    recorded = {name: {k: v for k, v in group.items() if k != "routes"}
                for group in json.loads(RECORDED.read_text()) for name in group["routes"]}
    found = routes()
    assert sorted(found) == sorted(recorded)
    for name, (shape, config) in found.items():
        assert observed(shape, config) == recorded[name], name


def test_the_tables_defaults_are_the_defaults_and_its_names_what_parse_takes():
    names = [flag.name for flag in FLAGS]
    assert len(set(names)) == len(names)
    assert DEFAULTS == {flag.name: flag.default for flag in FLAGS} and list(DEFAULTS) == names
    assert parse(",".join(f"{name}=1" for name in names)) == dict.fromkeys(names, True)
    with pytest.raises(ValueError, match="one of " + ", ".join(names)):
        parse("NOT_A_FLAG=1")


def test_each_rule_reads_only_flags_resolved_before_it():
    seen = set()
    for flag in FLAGS:
        for rule in (flag.applies, flag.forced):
            assert rule is None or set(rule.requires) <= seen, flag.name
        seen.add(flag.name)


def test_the_split_routes_name_flags_of_the_table_each_route_once():
    keys = [(route.cache, head_size, route.wide) for route in SPLIT_ROUTES for head_size in route.head_sizes]
    assert len(set(keys)) == len(keys)
    for route in SPLIT_ROUTES:
        assert set(route.flags) <= set(DEFAULTS) and route.cache in ("16-bit", "fp8"), route
        assert set(route.head_sizes) <= set(HEAD_SIZES), route


def test_the_policy_sets_no_flag_its_rule_drops(policy_only):
    """Every flag a route sets (:data:`SPLIT_ROUTES`) applies to that route's calls and tiles."""
    for name, (shape, config) in routes().items():
        flags = resolve(shape, config)
        assert all(flags[flag] for flag in route_flags(shape, config.block_n)), name


def test_every_flag_is_on_somewhere_the_policy_goes(policy_only):
    """A flag that no route of the policy resolves on, and that is off by default, is dead code: it leaves. Only a
    flag still waiting for its GPU run (``UNVERIFIED_FLAGS``) is on nowhere, and off by default."""
    on = {name for shape, config in routes().values() for name, value in resolve(shape, config).items() if value}
    assert on == set(DEFAULTS) - UNVERIFIED_FLAGS
    assert not any(DEFAULTS[name] for name in UNVERIFIED_FLAGS)


def test_a_rules_full_head_is_a_head_size_the_kernel_does_not_pad():
    """The rules read a head that fills its tile from the shape (``head_size_padded``), the kernel from
    :data:`PADDED_HEADS`: the same at every head size the kernel is built for."""
    for head_size in HEAD_SIZES:
        shape = ProblemShape(head_size, 32, 8, torch.bfloat16)
        assert (shape.head_size != shape.head_size_padded) == (head_size in PADDED_HEADS), head_size


@pytest.mark.parametrize("holds", PARTITIONS)
def test_each_register_split_fits_the_sm(holds):
    """``setmaxnreg`` takes multiples of 8 from 24 to 256 per thread, and the producer's threads and the two
    consumer warpgroups' share the SM's 65,536 registers."""
    partition = PARTITIONS[holds]
    for regs in (partition.producer_regs, partition.consumer_regs):
        assert regs % 8 == 0 and 24 <= regs <= 256, partition
    assert partition.producer_warps in (1, 4), partition
    assert 32 * partition.producer_warps * partition.producer_regs + 256 * partition.consumer_regs <= 65536


def test_every_routes_partition_is_one_of_the_table(policy_only):
    found = {tuple(PARTITIONS[holds]) for holds in PARTITIONS}
    for name, (shape, config) in routes().items():
        got = kernel_schedule(resolve(shape, config), shape, config)
        assert (got.PRODUCER_WARPS, got.PRODUCER_REGS, got.CONSUMER_REGS) in found, name


def test_every_policy_tile_fits_the_shared_memory_of_an_h100_and_an_h200(policy_only):
    for name, (shape, config) in routes().items():
        assert shared_bytes(shape, config) <= SM90_SHARED, name


@pytest.mark.skipif(not DOCS.is_file(), reason=f"no {DOCS} (this checkout does not include docs/)")
def test_the_docs_flag_table_is_the_tables():
    text = DOCS.read_text()
    start, end = (text.index(marker) for marker in DOCS_TABLE)
    shown = text[start + len(DOCS_TABLE[0]):end].strip("\n") + "\n"
    assert shown == flag_table(), "docs/backends/sm80.md: paste pagedprefill_sm80.hopper.flags.flag_table()"


if __name__ == "__main__":
    import os
    import tempfile

    for name in ("TRITON_INTERPRET", KERNEL_ENV, SCHEDULE_ENV):
        os.environ.pop(name, None)
    with tempfile.TemporaryDirectory() as empty:
        os.environ["PAGEDPREFILL_TUNE_DIR"] = empty  # the shipped table and the rules only
        found = routes()
    groups = grouped(found)
    RECORDED.write_text(json.dumps(groups, indent=1, sort_keys=True) + "\n")
    print(f"{len(found)} routes in {len(groups)} schedules written to {RECORDED}")
