"""Checks of the host-side description of a batch that :meth:`pagedprefill.BatchMetadata.from_lengths` takes.

The lengths and block table are checked where the caller wrote them, so that an error names
``query_lens[1]`` rather than the ``query_start`` offsets derived from it, and comes at construction rather
than at the first call. (The call's own validation, :mod:`pagedprefill.validation`, still checks every batch,
however it was built.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_block_table", "host_lengths"]

#: Lengths and their sums are stored as int32 (the kernels' index type).
MAX_LENGTH = 2**31 - 1
INDEX_DTYPES = (torch.int32, torch.int64)


def host_lengths(name: str, values: object) -> list[int]:
    """``values``, one length per sequence (a list or tuple of ints, or a 1-D integer tensor), as a list of
    ints in ``[0, 2**31)``; raises ``TypeError``/``ValueError`` naming ``name`` (or ``name[i]``)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex \
                or values.dtype == torch.bool:
            raise TypeError(f"{name}: expected a list of ints or a 1-D integer tensor (one length per sequence), "
                            f"got a {values.dim()}-D tensor of dtype {str(values.dtype).removeprefix('torch.')}")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a list of ints (one length per sequence), got {type(values).__name__}")
    lengths = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{name}[{i}]: expected an int >= 0, got {value!r}")
        value = int(value)
        if not 0 <= value <= MAX_LENGTH:
            raise ValueError(f"{name}[{i}]: expected a length in [0, 2**31), got {value}")
        lengths.append(value)
    return lengths


def check_block_table(table: object, num_seqs: int) -> torch.Tensor:
    """``table`` if it is a 2-D int32/int64 tensor with one row per sequence; raises naming ``block_table``."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"block_table: expected a torch.Tensor, got {type(table).__name__}")
    shape = "[" + ", ".join(str(s) for s in table.shape) + "]"
    if table.dim() != 2:
        raise ValueError(f"block_table: expected a 2-D tensor [num_seqs, max_blocks_per_seq], got shape {shape}")
    if table.dtype not in INDEX_DTYPES:
        raise TypeError(f"block_table: expected dtype int32 or int64, got {str(table.dtype).removeprefix('torch.')}")
    if table.shape[0] != num_seqs:
        raise ValueError(f"block_table: expected {num_seqs} rows (one per sequence, as many as query_lens), got "
                         f"shape {shape}")
    return table
