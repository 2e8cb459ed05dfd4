"""pagedprefill: prefix-prefill attention over a paged KV cache, with backends chosen per device.

Quick start::

    import pagedprefill as pp
    out = pp.prefill_attention(q, k, v, cache, batch)          # native, typed API
    pp.context_attention_fwd(q, k, v, o, "auto", k_cache, ...)  # drop-in signature

At import, pagedprefill discovers installed backend plugins (entry-point group ``pagedprefill.backends``)
and selects one for the current device. Set ``PAGEDPREFILL_LAZY_SELECT=1`` to defer that to the first call
(for processes that fork workers before touching the GPU).

The public names come from :mod:`pagedprefill._facade`, which does all of this.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name not bound here yet, taken from the library while it is imported (a plugin that the choice
    at import loads reads ``pagedprefill.hookimpl``)."""
    if name.startswith("_") and name != "__all__":  # private, or looked for by an import of a module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _facade = importlib.import_module(f"{__name__}._facade")
    if name == "__all__" or name in _facade.__all__:
        return getattr(_facade, name)
    if name in globals():  # a module of the package, imported with the library
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from ._facade import *  # noqa: E402,F403  (torch, the operators, the backend chosen at import)
from ._facade import __all__  # noqa: E402,F401  (the public names, for `from pagedprefill import *`)
