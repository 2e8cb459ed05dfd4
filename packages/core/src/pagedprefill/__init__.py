"""pagedprefill: prefix-prefill attention over a paged KV cache, with backends chosen per device.

Quick start::

    import pagedprefill as pp
    out = pp.prefill_attention(q, k, v, cache, batch)          # native, typed API
    pp.context_attention_fwd(q, k, v, o, "auto", k_cache, ...)  # drop-in signature

At import, pagedprefill discovers installed backend plugins (entry-point group ``pagedprefill.backends``)
and selects one for the current device. Set ``PAGEDPREFILL_LAZY_SELECT=1`` to defer that to the first call
(for processes that fork workers before touching the GPU).

The public names come from :mod:`pagedprefill._facade`, which does all of this. The ``pagedprefill`` command
(``python -m pagedprefill``, or the installed script) starts without it, so that its help answers without
importing torch: its subcommands import it when they run, and so does the first use of a public name here.
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"

#: How ``python -m`` may name the package when it runs the command (``__main__.py``).
_COMMAND_MODULES = ("pagedprefill", "pagedprefill.__main__")


def _starting_the_command() -> bool:
    """Whether this process imports the package to run the ``pagedprefill`` command, which then imports the
    library itself when a subcommand runs (:mod:`pagedprefill.cli`)."""
    argv, original = getattr(sys, "argv", []), getattr(sys, "orig_argv", [])
    if argv[:1] == ["-m"] and len(argv) <= len(original):
        # While `python -m MODULE ARGS` imports the packages holding MODULE, sys.argv is ["-m", *ARGS]; MODULE
        # is the word before ARGS in the interpreter's own arguments (or ends the option that holds it: -mMODULE).
        word = original[-len(argv)]
        module = word[word.index("m") + 1:] if word.startswith("-") and "m" in word else word
        return module in _COMMAND_MODULES
    # The script that installers write for the entry point (bin/pagedprefill; pagedprefill.exe on Windows).
    name = os.path.basename(argv[0]) if argv else ""
    return name in ("pagedprefill", "pagedprefill.exe", "pagedprefill-script.py", "pagedprefill-script.pyw")


def __getattr__(name: str):
    """A public name not bound here yet, taken from the library: while it is imported (a plugin that the choice
    at import loads reads ``pagedprefill.hookimpl``), and in the command, which imports it on first use."""
    if name.startswith("_") and name != "__all__":  # private, or looked for by an import of a module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _facade = importlib.import_module(f"{__name__}._facade")
    if name == "__all__" or name in _facade.__all__:
        return getattr(_facade, name)
    if name in globals():  # a module of the package, imported with the library
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _starting_the_command():
    from ._facade import *  # noqa: F403  (torch, the operators, the backend chosen at import)
    from ._facade import __all__  # noqa: F401  (the public names, for `from pagedprefill import *`)
