"""Backend discovery (pluggy + entry points), device detection through the plugins, and selection.

Selection rules, in order:

1. an explicit ``backend=`` (a name or a :class:`Backend`): used if it supports the device, else an error
   with its reasons;
2. ``PAGEDPREFILL_BACKEND`` (comma-separated names, in order of preference): the first listed backend that
   supports the device; if none does, an error listing each one's reasons (an explicit choice never
   silently falls back to something else);
3. otherwise the supporting backend with the highest priority (ties broken by name).

A plugin that fails to load is recorded with its error and skipped; asking for it by name raises that
error. An automatic choice that passes over a backend for a reason of the installation (a
:class:`~pagedprefill.registry.fallback.Fallback`), or made while a plugin failed, warns once per process.

Every selection first checks the environment variables core and the backends declare
(:mod:`pagedprefill.variables`): a value outside those declared is a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Iterable, Optional, Union

import pluggy
import torch

from ..device import DeviceInfo, fill_defaults, general_info, interpreter_enabled, vendor_override
from ..variables import CORE_VARIABLES, EnvironmentVariable
from . import hookspecs
from .backend import Backend, BackendUnavailableError
from .fallback import fallbacks_of, warn_fallback

ENV_BACKEND = "PAGEDPREFILL_BACKEND"


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``pagedprefill info``: a backend and why it can or cannot run on a device."""

    name: str
    priority: Optional[int]
    reasons: tuple[str, ...]
    backend: Optional[Backend] = None

    @property
    def supported(self) -> bool:
        return self.backend is not None and not self.reasons


class Registry:
    """Discovers backends and picks one per device.

    Args:
        load_entry_points: discover installed plugins through the ``pagedprefill.backends`` group.
        builtins: plugin objects registered first (core's reference backend).
    """

    def __init__(self, load_entry_points: bool = True, builtins: Iterable[object] = ()) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._load_errors: dict[str, str] = {}
        self._backends: Optional[dict[str, Backend]] = None
        self._selected: dict[tuple, tuple[Backend, tuple]] = {}  # the choice and what it fell back from
        self._detected: dict[tuple, DeviceInfo] = {}
        self._accepted_values: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        for plugin in builtins:
            self._pm.register(plugin)
        if load_entry_points:
            self._load_entry_points()

    # -- discovery -------------------------------------------------------------------------------
    def _load_entry_points(self) -> None:
        for ep in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if self._pm.get_plugin(ep.name) is not None or ep.name in self._load_errors:
                continue
            try:
                self._pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # a broken plugin must never break import pagedprefill
                self._load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
                self._load_errors[ep.name + ":traceback"] = traceback.format_exc()

    def register(self, plugin: object, name: Optional[str] = None) -> None:
        """Register a plugin object (a module or instance with ``@hookimpl`` functions) in-process."""
        self._pm.register(plugin, name=name)
        self._backends = None
        self._selected.clear()
        self._detected.clear()

    @property
    def load_errors(self) -> dict[str, str]:
        """``{plugin name: error}`` for plugins that failed to load."""
        return {k: v for k, v in self._load_errors.items() if not k.endswith(":traceback")}

    def backends(self) -> list[Backend]:
        """Every discovered backend, highest priority first."""
        with self._lock:
            if self._backends is None:
                self._backends = self._collect()
            return sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))

    def _collect(self) -> dict[str, Backend]:
        """Call each plugin's hook on its own (in registration order), so one failing hook or a duplicate
        name is recorded against that plugin instead of breaking every backend."""
        found: dict[str, Backend] = {}
        for impl in self._pm.hook.pagedprefill_backends.get_hookimpls():
            try:
                result = list(impl.function() or ())
            except Exception as exc:
                self._load_errors[impl.plugin_name] = f"{type(exc).__name__}: {exc}"
                self._load_errors[impl.plugin_name + ":traceback"] = traceback.format_exc()
                continue
            for backend in result:
                if backend.name in found:
                    self._load_errors[impl.plugin_name] = (
                        f"backend name {backend.name!r} is already taken by {type(found[backend.name]).__module__}; "
                        "this one is ignored")
                    continue
                found[backend.name] = backend
        return found

    def environment_variables(self) -> list[tuple[str, EnvironmentVariable]]:
        """``(who reads it, declaration)`` of every environment variable core and the backends declare."""
        declared = [("core", variable) for variable in CORE_VARIABLES]
        for backend in self.backends():
            declared += [(f"backend {backend.name!r}", variable) for variable in backend.environment_variables]
        return declared

    def check_environment(self) -> None:
        """Raise ``ValueError`` naming the first declared environment variable whose value is not one it takes
        (each distinct value is checked once per registry)."""
        for owner, declared in self.environment_variables():
            value = declared.value()
            if not value or (declared.name, value) in self._accepted_values:
                continue
            problem = declared.problem(value)
            if problem:
                raise ValueError(f"{declared.name}={value!r}: {problem} ({declared.meaning}, read by {owner}); "
                                 f"correct it, or unset {declared.name} for the default")
            self._accepted_values.add((declared.name, value))

    def described_devices(self) -> dict[str, DeviceInfo]:
        """``{lower-case name: DeviceInfo}`` contributed by plugins (a failing hook is recorded and skipped)."""
        found: dict[str, DeviceInfo] = {}
        for impl in self._pm.hook.pagedprefill_described_devices.get_hookimpls():
            try:
                result = dict(impl.function() or {})
            except Exception as exc:
                self._load_errors[impl.plugin_name] = f"{type(exc).__name__}: {exc}"
                continue
            for name, info in result.items():
                found.setdefault(name.lower(), info)
        return found

    # -- detection -------------------------------------------------------------------------------
    def detect_device(self, device: torch.device) -> DeviceInfo:
        """Describe ``device``: torch's and Triton's general view, refined by the first plugin whose
        ``pagedprefill_detect_device`` hook recognises it, then general defaults for what is still unknown.

        Cached per device, ``PAGEDPREFILL_VENDOR`` and ``TRITON_INTERPRET`` (a change of either detects again).
        """
        override = vendor_override()
        key = (device, override, interpreter_enabled())
        info = self._detected.get(key)
        if info is None:
            info = self._detect_uncached(device, override)
            self._detected[key] = info
        return info

    def _detect_uncached(self, device: torch.device, override: Optional[str]) -> DeviceInfo:
        info = general_info(device)
        if override and device.type != "cpu":
            info = info.replace(vendor=override)
        # Each hook on its own, in pluggy's calling order, so that one that raises is recorded against its
        # plugin and the others still answer (the first answer wins, as the hookspec's firstresult says).
        for impl in reversed(self._pm.hook.pagedprefill_detect_device.get_hookimpls()):
            kwargs = {"device": device, "info": info}
            try:
                found = impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:
                self._load_errors[impl.plugin_name] = f"pagedprefill_detect_device raised {type(exc).__name__}: {exc}"
                self._load_errors[impl.plugin_name + ":traceback"] = traceback.format_exc()
                continue
            if found is not None:
                info = found
                break
        if override and device.type != "cpu":
            info = info.replace(vendor=override)
        return fill_defaults(info)

    def get(self, name: str) -> Backend:
        """The backend called ``name``; raises with the known names (and load errors) if there is none."""
        for backend in self.backends():
            if backend.name == name:
                return backend
        if name in self._load_errors:
            raise BackendUnavailableError(
                f"backend {name!r} was requested but its plugin failed to load: {self._load_errors[name]}"
            )
        known = ", ".join(b.name for b in self.backends()) or "none"
        raise BackendUnavailableError(
            f"backend {name!r} was requested but is not installed; discovered backends: {known}"
        )

    # -- selection -------------------------------------------------------------------------------
    def status(self, device: DeviceInfo) -> list[BackendStatus]:
        """Every backend (and every plugin that failed to load) with its reasons for ``device``."""
        rows = [BackendStatus(b.name, b.priority, tuple(_safe_supports(b, device)), b) for b in self.backends()]
        rows += [BackendStatus(name, None, (f"plugin failed to load: {err}",)) for name, err in
                 self.load_errors.items()]
        return rows

    def select(self, device: DeviceInfo, backend: Union[str, Backend, None] = None, *, warn: bool = True) -> Backend:
        """Pick the backend for ``device`` following the module's rules (cached per device and choice).

        An automatic choice that falls back warns (once per process) each time it is returned, unless ``warn``
        is False: the selection at import, which runs nothing, leaves the warning to the first use."""
        self.check_environment()
        if isinstance(backend, Backend):
            return self._require(backend, device)
        env = os.environ.get(ENV_BACKEND, "").strip()
        key = (device, backend, env, interpreter_enabled())
        found = self._selected.get(key)
        if found is None:
            found = self._select_uncached(device, backend, env)
            self._selected[key] = found
        chosen, fallbacks = found
        if fallbacks and warn:
            warn_fallback(fallbacks, chosen.name, device)
        return chosen

    def _select_uncached(self, device: DeviceInfo, backend: Optional[str], env: str) -> tuple[Backend, tuple]:
        """The choice, and what it fell back from (:func:`~pagedprefill.registry.fallback.fallbacks_of`)."""
        if backend is not None:
            return self._require(self.get(backend), device), ()
        if env:
            names = [n.strip() for n in env.split(",") if n.strip()]
            if not names:
                installed = ", ".join(b.name for b in self.backends()) or "none"
                raise BackendUnavailableError(
                    f"{ENV_BACKEND}={env!r} names no backend: expected backend names separated by commas, "
                    f"such as 'sm80,generic' (installed: {installed}); unset {ENV_BACKEND} to choose automatically")
            problems = []
            for name in names:
                try:
                    candidate = self.get(name)
                except BackendUnavailableError as exc:
                    problems.append(f"  - {name}: {exc}")
                    continue
                reasons = _safe_supports(candidate, device)
                if not reasons:
                    return candidate, ()
                problems.append(f"  - {name}: " + "; ".join(reasons))
            raise BackendUnavailableError(
                f"{ENV_BACKEND}={env!r} names no backend that can run on {device.describe()} (unset "
                f"{ENV_BACKEND} to choose automatically):\n" + "\n".join(problems))
        passed_over = []
        for candidate in self.backends():
            reasons = _safe_supports(candidate, device)
            if not reasons:
                return candidate, fallbacks_of(passed_over, self.load_errors)
            passed_over.append((candidate.name, reasons))
        raise BackendUnavailableError(self.no_backend_message(device))

    def _require(self, backend: Backend, device: DeviceInfo) -> Backend:
        reasons = _safe_supports(backend, device)
        if reasons:
            raise BackendUnavailableError(
                f"backend {backend.name!r} was requested but cannot run on {device.describe()}: "
                + "; ".join(reasons)
            )
        return backend

    def no_backend_message(self, device: DeviceInfo) -> str:
        lines = [f"no pagedprefill backend can run on {device.describe()}.", "Discovered backends:"]
        for row in self.status(device):
            why = "; ".join(row.reasons) or "supported"
            lines.append(f"  - {row.name} (priority {row.priority}): {why}")
        if len(lines) == 2:
            lines.append("  (none)")
        lines.append(
            "Install the backend packages for this device from the repository's packages/ folder (pip install "
            "\"./packages/core[triton]\" ./packages/backend-generic, plus ./packages/backend-sm80 on NVIDIA or "
            "./packages/backend-bi100 on Iluvatar), move the tensors to a supported device, or choose one "
            f"explicitly with backend=... or {ENV_BACKEND}=name[,name...]."
        )
        return "\n".join(lines)


def _safe_supports(backend: Backend, device: DeviceInfo) -> list[str]:
    try:
        return list(backend.supports(device))
    except Exception as exc:  # a backend's own check failing is a reason, not a crash
        return [f"supports() raised {type(exc).__name__}: {exc}"]
