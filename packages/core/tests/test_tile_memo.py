"""The tile a Triton backend remembers per (shape, device) follows its policy's tuned tables: a table written
by ``pagedprefill tune`` (``save_table``), one written elsewhere and announced with ``forget_tables()``, and
another table directory are all used from the next call on."""

from __future__ import annotations

import json

import pytest
import torch
from pagedprefill import DeviceInfo, ProblemShape, TileConfig
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.tuning import ENV_TABLE_DIR, forget_tables, load_table, lookup, save_table, table_key, user_table_path

DEVICE = DeviceInfo(type="cuda", vendor="testvendor", name="Test GPU", index=0, capability=(9, 0), num_sms=8,
                    max_shared_mem=228 * 1024, triton_backend="cuda")
SHAPE = ProblemShape(head_size=128, num_heads=8, num_kv_heads=2, dtype=torch.float16, num_tokens=4096, num_seqs=2)
RULE = TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
TUNED = TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
RETUNED = TileConfig(block_m=32, block_n=16, num_warps=2, num_stages=2)


class TableBackend(TritonBackend):
    """A policy as sm80's: the user's tuned table first, a rule for what it lacks; counts its decisions."""

    name = "tables"
    decisions = 0

    def policy(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig:
        type(self).decisions += 1
        return lookup(table_key(shape, device), load_table(user_table_path(self.name, device))) or RULE


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TABLE_DIR, str(tmp_path / "a"))
    forget_tables()
    yield tmp_path
    forget_tables()


def test_repeated_calls_are_answered_from_memory(table_dir):
    backend = TableBackend()
    before = TableBackend.decisions
    assert backend.tile_config(SHAPE, DEVICE) == RULE
    assert backend.tile_config(SHAPE, DEVICE) == RULE
    assert TableBackend.decisions == before + 1


def test_a_saved_table_is_used_from_the_next_call(table_dir):
    backend = TableBackend()
    assert backend.tile_config(SHAPE, DEVICE) == RULE
    save_table(user_table_path("tables", DEVICE), DEVICE, {table_key(SHAPE, DEVICE): TUNED})
    assert backend.tile_config(SHAPE, DEVICE) == TUNED


def test_a_table_written_elsewhere_is_used_after_forget_tables(table_dir):
    backend = TableBackend()
    path = user_table_path("tables", DEVICE)
    save_table(path, DEVICE, {table_key(SHAPE, DEVICE): TUNED})
    assert backend.tile_config(SHAPE, DEVICE) == TUNED
    # another process rewrites the file: this one keeps its copy until told
    data = json.loads(path.read_text())
    data["entries"][table_key(SHAPE, DEVICE)] = RETUNED.to_dict()
    path.write_text(json.dumps(data))
    assert backend.tile_config(SHAPE, DEVICE) == TUNED
    forget_tables()
    assert backend.tile_config(SHAPE, DEVICE) == RETUNED


def test_another_table_directory_is_another_table(table_dir, monkeypatch):
    backend = TableBackend()
    save_table(user_table_path("tables", DEVICE), DEVICE, {table_key(SHAPE, DEVICE): TUNED})
    assert backend.tile_config(SHAPE, DEVICE) == TUNED
    monkeypatch.setenv(ENV_TABLE_DIR, str(table_dir / "b"))
    assert backend.tile_config(SHAPE, DEVICE) == RULE


def test_calls_that_differ_in_options_only_share_the_remembered_tile(table_dir):
    """The shape holds what policies read, no option value: windows of every size are one decision."""
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill.workloads import BatchSpec, make_problem

    spec = BatchSpec(query_lens=(5, 2), context_lens=(9, 0), num_heads=4, num_kv_heads=2, head_size=16)
    shapes = {problem_shape(make_problem(spec.replace(sliding_window=w, softcap=c))) for w in (None, 3, 700)
              for c in (0.0, 5.0)}
    assert len(shapes) == 1
    backend = TableBackend()
    before = TableBackend.decisions
    backend.tile_config(shapes.pop(), DEVICE)
    assert TableBackend.decisions == before + 1


def test_an_fp8_query_and_keys_in_the_cache_are_part_of_the_shape():
    """Whether ``q`` is FP8 and whether the new tokens' K/V are read from the cache reach the policy (a route may
    take FP8 MMAs only where both hold), so calls that differ in them are different shapes."""
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill.workloads import BatchSpec, make_problem

    spec = BatchSpec(query_lens=(5, 2), context_lens=(9, 0), num_heads=4, num_kv_heads=2, head_size=16)
    shapes = {(q8, cached): problem_shape(make_problem(spec.replace(fp8_query=q8, kv_in_cache=cached)))
              for q8 in (False, True) for cached in (False, True)}
    assert len(set(shapes.values())) == 4
    assert all((s.fp8_query, s.kv_in_cache) == key for key, s in shapes.items())
    assert all(s.dtype == torch.float16 for s in shapes.values())  # an FP8 q's call computes in float16 here
