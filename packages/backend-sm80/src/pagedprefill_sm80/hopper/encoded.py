"""Launch plans that encode each TMA descriptor once per address instead of once per launch.

Triton's NVIDIA launcher takes a kernel's TMA descriptors as Python objects. On every launch it walks the
arguments in Python to find them and encodes each one again through the driver (a 128-byte tensor map per
descriptor; the Hopper kernel takes five). A launch plan's descriptors keep their shapes, strides, boxes and
layouts for every call of its signature, and their addresses change only when a tensor moves: the cache,
call after call, never does. :class:`EncodedLauncher` calls the launcher's compiled entry point itself, with
the descriptors at their positions already encoded (:meth:`EncodedLauncher.encode`), which the launch plan
(:func:`~pagedprefill_sm80.hopper.launch.bind_hopper`) does again only for a tensor that moved.

It relies on how Triton's launcher is put together (:func:`EncodedLauncher.of` checks that, and returns None
where it differs, so that the plan keeps Triton's own path, which launches the same kernel with the same
arguments).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Optional

#: What the launcher's descriptor handling closes over: the compiled entry point, the positions of the
#: descriptor arguments, and each descriptor's encoding (swizzle, element type, box).
_CLOSED_OVER = ("launcher", "tensordesc_indices", "tensordesc_meta")


def _closed_over(function: Any) -> Optional[dict]:
    """The variables ``function`` closes over, by name (None when it is no Python closure)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or cells is None:
        return None
    values = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            return None
    return values


class EncodedLauncher:
    """A stand-in for a compiled kernel's launcher (``compiled.run``, called the same way) whose arguments at
    ``positions`` are TMA descriptors passed in their encoded form (:meth:`encode`)."""

    __slots__ = ("_launch", "_cooperative", "_pdl", "_first", "_end", "_encodings", "_encoder")

    def __init__(self, launch: Callable[..., None], cooperative: bool, pdl: bool, positions: range,
                 encodings: list, encoder: Callable[[Any, dict], list]):
        self._launch = launch
        self._cooperative = cooperative
        self._pdl = pdl
        self._first, self._end = positions.start, positions.stop
        self._encodings = encodings
        self._encoder = encoder

    @classmethod
    def of(cls, compiled: Any, positions: range) -> Optional[EncodedLauncher]:
        """The encoded launcher of ``compiled`` (a kernel whose arguments at ``positions``, consecutive, are its
        TMA descriptors), or None where Triton's launcher is not built the way this module expects: descriptors
        elsewhere or encoded another way, or scratch memory that Triton allocates per launch."""
        run = compiled.run
        closed = _closed_over(getattr(run, "launch", None))
        if closed is None or any(name not in closed for name in _CLOSED_OVER):
            return None
        launch, indices, encodings = (closed[name] for name in _CLOSED_OVER)
        if not callable(launch) or set(indices) != set(positions) or len(encodings) != len(positions) \
                or any(not isinstance(e, dict) for e in encodings):
            return None
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None
        from triton.backends.nvidia.driver import make_tensordesc_arg

        return cls(launch, bool(run.launch_cooperative_grid), bool(run.launch_pdl), positions, list(encodings),
                   make_tensordesc_arg)

    def encode(self, position: int, descriptor: Any) -> tuple:
        """The argument at ``position`` (one of the descriptors') as the launcher's entry point takes it: the
        encoded tensor map, then the descriptor's shape and strides."""
        return tuple(self._encoder(descriptor, self._encodings[position - self._first]))

    def __call__(self, grid_x: int, grid_y: int, grid_z: int, stream: int, function: Any, metadata: Any,
                 launch_metadata: Any, enter_hook: Any, exit_hook: Any, *args) -> None:
        """Launch as ``compiled.run`` does, with :meth:`encode`'s tuples at the descriptors' positions."""
        first, end = self._first, self._end
        self._launch(grid_x, grid_y, grid_z, stream, function, self._cooperative, self._pdl, None, None, metadata,
                     launch_metadata, enter_hook, exit_hook, *args[:first], *chain.from_iterable(args[first:end]),
                     *args[end:])
