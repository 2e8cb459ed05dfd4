"""The Hopper kernel's own argument groups (Triton-free); the rest are core's (:mod:`pagedprefill.triton.arguments`).

The kernel takes, in signature order: core's :class:`~pagedprefill.triton.arguments.Tokens`, its five TMA
descriptors (top-level arguments, where Triton's launcher looks for them), core's ``Cache``, ``Batch``,
``PerHead`` and ``ScaleTensors``; the log2-domain logit scale, core's ``Scales``, the softcap, the window,
core's ``Extents`` and :class:`Strides`; then the constexprs :class:`Tile`, :class:`Layout`, core's
``Features`` and ``ScaleFromTensor``, and the resolved :class:`~.schedule.Schedule`.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedprefill.triton.arguments import RowStrides


class Strides(NamedTuple):
    """Strides the kernel addresses with: q's and out's rows, the block table's sequences, the split layout's
    key cache (block, head and ``d // x`` strides, multiples of ``x``) and its value cache seen as rows of
    slots (``value_rows_per_block = Hkv * D`` rows per block, ``value_row`` apart). Zeros where unused."""

    q: RowStrides
    out: RowStrides
    table_seq: int
    key_block: int
    key_head: int
    key_chunk: int
    value_rows_per_block: int
    value_row: int


class Tile(NamedTuple):
    """The policy's tile as the kernel needs it: ``BLOCK_M`` rows (``HEADS_PER_TILE`` query heads of one KV
    group packed, ``HEAD_CHUNKS`` programs per KV head), ``BLOCK_N`` keys per step in a ring of ``STAGES``
    buffers, ``NUM_WARPS`` consumer warps in all (two warpgroups under ``PINGPONG``), ``KEY_SPLITS`` programs
    sharing the tile's keys (1: none; more: each writes partial rows for core's combine)."""

    BLOCK_M: int
    BLOCK_N: int
    HEADS_PER_TILE: int
    HEAD_CHUNKS: int
    STAGES: int
    NUM_WARPS: int
    KEY_SPLITS: int = 1


class Layout(NamedTuple):
    """The cache as the kernel reads it: ``SPLIT`` (else NHD), its ``X`` (the split keys' chunk), the page
    size, the tile's head width ``HEAD_SIZE`` (a power of two) and the head itself ``HEAD_DIM`` (smaller when
    padded), ``FP8_CACHE`` (widened by the producer) and ``OUT_MAX``, where an FP8 output saturates."""

    SPLIT: bool
    X: int
    PAGE: int
    HEAD_SIZE: int
    HEAD_DIM: int
    FP8_CACHE: bool
    OUT_MAX: float
