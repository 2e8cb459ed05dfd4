"""Reading environment variables on the hot path.

Every call of the public functions reads two variables to build its plan signature (:mod:`pagedprefill.plans`).
``os.environ.get`` of a variable that is not set raises and catches a ``KeyError`` inside the mapping: 1.9 us per
read on a 2-core x86 host, where the whole wrapper around a remembered launch took 47 us. A
:func:`variable` reader looks the encoded name up in the mapping ``os.environ`` keeps instead, and sees every
change made through ``os.environ`` at once, as ``os.environ.get`` does.
"""

from __future__ import annotations

import os
from typing import Callable, Optional


def variable(name: str) -> Callable[[], Optional[str]]:
    """A function of no arguments returning ``os.environ.get(name)``, fast on every call."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    encodekey = getattr(environ, "encodekey", None)
    decodevalue = getattr(environ, "decodevalue", None)
    if not isinstance(data, dict) or encodekey is None or decodevalue is None:
        return lambda: os.environ.get(name)  # a Python whose os.environ is built otherwise
    key = encodekey(name)

    def read() -> Optional[str]:
        if os.environ is not environ:  # replaced (a test's stand-in mapping): read whatever is there now
            return os.environ.get(name)
        raw = data.get(key)
        return None if raw is None else decodevalue(raw)

    read.__doc__ = f"``os.environ.get({name!r})``."
    return read
