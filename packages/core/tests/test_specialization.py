"""A serving engine's steps differ in their sequences, tokens and block-table widths; core's kernels must not
compile once per such step. Triton keys compiled kernels on how it specialises each argument (an integer equal to
1 becomes a constant, one divisible by 16 is marked); the extents of a call (sequences, token rows, cache blocks,
table columns) take no specialisation, so the steps of a model share one compiled kernel per tile and block-table
stride (no GPU needed: :func:`pagedprefill.triton.codegen.argument_specialization` asks Triton's own binder)."""

from __future__ import annotations

import pytest
import torch
from pagedprefill.testing import BatchSpec, make_problem
from pagedprefill.tiling import TileConfig

pytest.importorskip("triton", reason="the specialisation is Triton's")

from pagedprefill.triton.arguments import VARYING_EXTENTS  # noqa: E402
from pagedprefill.triton.codegen import argument_specialization  # noqa: E402
from pagedprefill.triton.combine import combine_splits_kernel  # noqa: E402
from pagedprefill.triton.kernel import prefix_prefill_kernel  # noqa: E402
from pagedprefill.triton.launch import call_tensors, combine_call, kernel_call  # noqa: E402

#: Steps of one model: one sequence or many, token counts 1, 16 and 37, block tables 1, 16 and 3 columns wide.
STEPS = {
    "one decode row": ((1,), (5,)),
    "sixteen decode rows": ((1,) * 16, tuple(range(3, 19))),
    "a prefill and two decode rows": ((35, 1, 1), (0, 40, 9)),
    "one long prefill": ((16,), (240,)),
}
CONFIG = TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, heads_per_tile=2)


def step(query_lens, context_lens):
    return make_problem(BatchSpec(query_lens=query_lens, context_lens=context_lens, num_heads=4, num_kv_heads=2,
                                  head_size=32, block_size=16, dtype=torch.float16, kv_in_cache=True))


def specialisations(kernel, calls) -> dict:
    answers = [argument_specialization(kernel, call) for call in calls]
    return {name: {answer[name] for answer in answers} for name in answers[0]}


def test_the_portable_kernel_compiles_once_for_every_step_of_a_model():
    calls = [kernel_call(step(*lengths), CONFIG) for lengths in STEPS.values()]
    per_argument = specialisations(prefix_prefill_kernel, calls)
    assert all(len(per_argument[name]) == 1 for name in VARYING_EXTENTS), per_argument
    # The block table's row stride (in cache_strides) follows its width, which these steps vary; an engine's table
    # keeps one width (vLLM's) or changes it by whole pages: at most three value classes, as any stride.
    assert {name for name, answers in per_argument.items() if len(answers) > 1} <= {"cache_strides"}


def test_the_combine_of_split_keys_compiles_once_for_every_step_of_a_model():
    config = CONFIG.with_(key_splits=2)
    calls = []
    for lengths in STEPS.values():
        problem = step(*lengths)
        grid = kernel_call(problem, config).grid
        calls.append(combine_call(problem, config, call_tensors(problem, 2), grid))
    per_argument = specialisations(combine_splits_kernel, calls)
    assert all(len(answers) == 1 for answers in per_argument.values()), \
        {name: answers for name, answers in per_argument.items() if len(answers) > 1}
