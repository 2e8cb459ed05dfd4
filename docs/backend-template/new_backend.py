"""Make a named backend package out of this template: ``python new_backend.py NAME DEST [--vendor VENDOR]``.

Copies the template to ``DEST`` (which must not exist) and renames everything that says ``mybackend``: the
distribution (``pagedprefill-NAME``), the entry point, the package directory ``src/pagedprefill_NAME``, the
backend's ``name``, its class (``MyBackend`` -> ``NameBackend``), its environment variables and the conformance
test's ``backend = "..."``; with ``--vendor``, the vendor name the detection hook gives the hardware too. What is
specific to the hardware stays for you to write (README.md, "Make it yours", steps 2-5).
"""

from __future__ import annotations

import argparse
import keyword
import re
import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent
#: Files of the template that are not part of a backend package.
LEFT_OUT = ("new_backend.py", "build", "*.egg-info", "__pycache__")


def class_name(name: str) -> str:
    """``NameBackend`` for ``name`` (``my_npu`` -> ``MyNpuBackend``)."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_")) + "Backend"


def check_name(name: str) -> str:
    """``name`` if it makes a valid package and entry-point name (lowercase letters, digits, ``_``), else a
    ``ValueError`` naming what to pass."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ValueError(f"NAME: expected lowercase letters, digits and '_' starting with a letter (it becomes the "
                         f"package pagedprefill_NAME and the backend's name), got {name!r}")
    return name


def make_backend(name: str, destination: Path, vendor: str | None = None) -> Path:
    """Copy the template to ``destination`` with every ``mybackend`` renamed to ``name`` (and ``myvendor`` to
    ``vendor`` when given); returns ``destination``."""
    check_name(name)
    if vendor is not None and not re.fullmatch(r"[a-z][a-z0-9_-]*", vendor):
        raise ValueError(f"--vendor: expected a lowercase name (as pagedprefill info shows vendors), got {vendor!r}")
    if destination.exists():
        raise ValueError(f"DEST: {destination} exists; name a directory to create")
    shutil.copytree(TEMPLATE, destination, ignore=shutil.ignore_patterns(*LEFT_OUT))
    (destination / "src" / "pagedprefill_mybackend").rename(destination / "src" / f"pagedprefill_{name}")
    replacements = [("MyBackend", class_name(name)), ("MYBACKEND", name.upper()), ("mybackend", name)]
    if vendor is not None:
        replacements.append(("myvendor", vendor))
    for path in destination.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".toml", ".md"):
            text = path.read_text()
            for old, new in replacements:
                text = text.replace(old, new)
            path.write_text(text)
    return destination


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", metavar="NAME", help="the backend's name (lowercase letters, digits, '_')")
    parser.add_argument("destination", metavar="DEST", type=Path, help="the directory to create")
    parser.add_argument("--vendor", default=None, help="the vendor name the detection hook gives your hardware")
    args = parser.parse_args(argv)
    try:
        made = make_backend(args.name, args.destination, args.vendor)
    except ValueError as exc:
        print(f"new_backend.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"{made}: pagedprefill-{args.name}, backend {args.name!r} ({class_name(args.name)}); next: README.md, "
          f"'Make it yours', steps 2-5, then pip install -e {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
