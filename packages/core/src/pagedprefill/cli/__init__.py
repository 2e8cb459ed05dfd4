"""The ``pagedprefill`` command (also ``python -m pagedprefill``): ``info``, ``demo``, ``bench`` and ``tune``.

Every error a user can cause (a bad option, a backend that cannot run, a device this torch cannot use) is
one line on standard error that says what to do, with exit status 2; tracebacks are left for bugs.

The parser is built from :mod:`.commands` (the subcommands' arguments and help) and :mod:`.arguments` (the
argument types they share), neither of which imports torch, so that ``--help`` answers at once; the library
is imported after parsing, or while parsing an argument that needs it (a ``--device``). One module per command
(:mod:`.info`, :mod:`.demo`, :mod:`.bench`, :mod:`.tune`) runs it, imported when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional

from .. import __version__
from ..errors import BackendUnavailableError
from . import commands
from .arguments import Parser, load_library

DESCRIPTION = ("Prefix-prefill attention over a paged KV cache: show the device and backends (info), run a "
               "checked example (demo), time backends (bench) and tune their tiles (tune).")
EPILOG = ("Core provides info, demo, bench and tune. Run 'pagedprefill COMMAND --help' for the options of a "
          "command.")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``pagedprefill`` command, every subcommand registered."""
    parser = Parser(prog="pagedprefill", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"pagedprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register_info(sub)
    commands.register_demo(sub)
    commands.register_bench(sub)
    commands.register_tune(sub)
    return parser


#: What a user's mistake raises inside a command (a backend that cannot run, an argument the library
#: refuses); anything else is a bug and keeps its traceback.
USER_ERRORS = (BackendUnavailableError, ValueError, TypeError)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line ``argv``; a user's mistake is one line on stderr and exit status 2, a fallback of
    the automatic choice one warning line."""
    args = build_parser().parse_args(argv)
    load_library()
    try:
        with warnings.catch_warnings():  # the previous warning display comes back on exit
            warnings.showwarning = _one_line_fallbacks(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        print(f"pagedprefill {args.command}: error: {error_line(exc, args)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the output went to a reader that stopped early (`pagedprefill info | head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return 1


def _one_line_fallbacks(command: str, show):
    """A ``warnings.showwarning`` that prints a :class:`~pagedprefill.registry.FallbackWarning` as one line
    naming the command (its place in the library's code says nothing to the user), and others as ``show``."""
    from ..registry import FallbackWarning

    def display(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FallbackWarning):
            print(f"pagedprefill {command}: warning: {one_line(str(message))}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return display


def error_line(exc: Exception, args: argparse.Namespace) -> str:
    """``exc``'s message on one line, with what to do when the message does not already say it."""
    text = one_line(str(exc))
    if isinstance(exc, BackendUnavailableError) and getattr(args, "backend", None):
        text += ("; leave out --backend to choose automatically ('pagedprefill info' shows which backends can "
                 "run here)")
    return text


def one_line(text: str) -> str:
    """A multi-line message (a list of reasons) joined into one line."""
    parts = [line.strip().removeprefix("- ") for line in text.splitlines() if line.strip()]
    joined = ""
    for part in parts:
        sep = "" if not joined else " " if joined.endswith((":", ".")) else "; "
        joined += sep + part
    return joined


if __name__ == "__main__":
    sys.exit(main())
