"""The environment variables pagedprefill and its backends read, each declared with the values it takes.

A value outside those is an error naming the variable, not a setting silently ignored: the registry checks
every declared variable (core's :data:`CORE_VARIABLES` and each backend's
:attr:`~pagedprefill.Backend.environment_variables`) whenever it selects a backend
(:meth:`pagedprefill.registry.Registry.check_environment`), so the first call, ``select_backend`` and
``pagedprefill info`` raise it. An unset or empty variable means its default and is never an error.

A backend declares its own on its class::

    from pagedprefill.variables import EnvironmentVariable

    class MyBackend(TritonBackend):
        environment_variables = (
            EnvironmentVariable("PAGEDPREFILL_MY_KERNEL", "the kernel mybackend runs",
                                choices=("auto", "fast", "safe")),
        )
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .environment import variable

__all__ = ["CORE_VARIABLES", "EnvironmentVariable"]


@dataclass(frozen=True)
class EnvironmentVariable:
    """An environment variable a package reads, with the values it takes.

    Attributes:
        name: the variable (``PAGEDPREFILL_<BACKEND>_<WHAT>`` for a backend's).
        meaning: what it sets, in a few words (shown in errors).
        choices: the values it takes, when they are a fixed set (compared with surrounding whitespace
            removed, and case-insensitively where every choice is lower case).
        check: otherwise, a function of the value (whitespace removed) that raises ``ValueError`` saying what
            is wrong with it; it runs once per distinct value, so it may import what the reader imports.
        expected: the values it takes in words, for the error (default: the choices). A variable declared
            with neither choices nor a check is documented only: its reader checks it.
    """

    name: str
    meaning: str
    choices: tuple[str, ...] = ()
    check: Optional[Callable[[str], object]] = None
    expected: str = ""
    _read: Callable[[], Optional[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.choices and self.check is None and not self.expected:
            raise ValueError(f"{self.name}: a declared variable needs choices, a check or the expected values")
        object.__setattr__(self, "_read", variable(self.name))

    def value(self) -> str:
        """The variable's value now, whitespace removed ("" when unset)."""
        return (self._read() or "").strip()

    def problem(self, value: str) -> Optional[str]:
        """What is wrong with ``value`` (whitespace removed, not empty), or None when it is accepted."""
        expected = self.expected or "one of " + ", ".join(self.choices)
        if self.choices:
            folded = value.lower() if all(c == c.lower() for c in self.choices) else value
            if folded not in self.choices:
                return f"expected {expected}"
        if self.check is not None:
            try:
                self.check(value)
            except ValueError as exc:
                return f"expected {expected} ({exc})" if self.expected else str(exc)
        return None


def _vendor_name(value: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
        raise ValueError("a vendor is one word of letters, digits, '-', '_' or '.'")


def _directory(value: str) -> None:
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")


#: The variables core reads (``TRITON_INTERPRET`` is Triton's own, and Triton reads it).
CORE_VARIABLES: tuple[EnvironmentVariable, ...] = (
    # Each name is checked against the installed backends by selection itself, which says which are not.
    EnvironmentVariable("PAGEDPREFILL_BACKEND", "the backends to use, in order of preference",
                        expected="backend names separated by commas"),
    EnvironmentVariable("PAGEDPREFILL_LAZY_SELECT", "whether selection waits for the first call",
                        choices=("0", "1")),
    EnvironmentVariable("PAGEDPREFILL_VENDOR", "the vendor of accelerator devices",
                        expected="a vendor name such as iluvatar or metax", check=_vendor_name),
    EnvironmentVariable("PAGEDPREFILL_TUNE_DIR", "where tuned tables are written and read",
                        expected="a directory (pagedprefill tune creates it)", check=_directory),
)
