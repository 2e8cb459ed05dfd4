"""Core's modules form layers, and no module imports one of a higher layer (docs/architecture.md, "Layers").

Two checks: every module imports on its own, in a fresh interpreter, and the imports found by parsing each
module (:mod:`ast`) point only to the same layer or lower ones, without a cycle. An import inside a function
runs after every module is loaded, so it may point upward, but only where :data:`DEFERRED` says why.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pagedprefill
import pytest

PACKAGE = "pagedprefill"
ROOT = Path(pagedprefill.__file__).parent

#: The layers, lowest first; a module belongs to the layer naming it or its closest enclosing package
#: (``""`` is the package's ``__init__``, the facade).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", ("errors", "options", "lengths", "placement", "types", "environment", "variables", "timing")),
    ("inputs and hardware", ("device", "accelerator", "validation", "cache", "reference_impl", "workloads")),
    ("policy", ("tiling", "tuning", "features", "plans")),
    ("registry", ("registry",)),
    ("backends and kernels", ("backends", "triton")),
    ("dispatch", ("runtime",)),
    ("operators", ("ops",)),
    ("calls", ("calls",)),
    ("public API", ("api", "vllm", "_facade", "")),
    ("tools", ("__main__", "cli", "testing", "integrations")),
)

#: Upward imports inside a function: (importer, imported) -> why the importer needs it.
DEFERRED: dict = {}


def module_names(root: Path = ROOT) -> list[str]:
    """Every module of the package, by name relative to it (``""`` for the package itself)."""
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def layer_of(module: str, layers=LAYERS) -> int:
    """The index of ``module``'s layer (KeyError when no layer names it or a package holding it). ``""``, the
    package's ``__init__``, names itself only: a module that no layer lists does not fall into the facade's."""
    parts = module.split(".") if module else []
    for end in range(len(parts), 0 if parts else -1, -1):
        prefix = ".".join(parts[:end])
        for index, (_, members) in enumerate(layers):
            if prefix in members:
                return index
    raise KeyError(module)


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False,
               package_name: str = PACKAGE) -> list[tuple[str, bool]]:
    """``(imported module, deferred)`` for each import of the package in ``source`` (the text of ``module``,
    an ``__init__`` when ``is_package``); deferred when the import sits inside a function. The enclosing
    packages of an imported module count too (importing it runs them), all but those holding ``module``
    itself (the package itself above all), which run before it."""
    found: list[tuple[str, bool]] = []

    def add(target: str, deferred: bool) -> None:
        parts = target.split(".") if target else []
        while parts and ".".join(parts) not in modules:  # a name imported from a module, not a module
            parts.pop()
        found.append((".".join(parts), deferred))
        for end in range(len(parts) - 1, 0, -1):  # the packages holding it, unless they hold this module,
            package = ".".join(parts[:end])         # which are running already
            if package in modules and not module.startswith(package + "."):
                found.append((package, deferred))

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == package_name or alias.name.startswith(package_name + "."):
                        add(alias.name[len(package_name) + 1:], inner)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_package, child.module, child.level, package_name)
                if base is None:
                    continue
                for alias in child.names:
                    submodule = f"{base}.{alias.name}" if base else alias.name
                    add(submodule if submodule in modules else base, inner)
            visit(child, inner)

    visit(ast.parse(source), False)
    return [(target, deferred) for target, deferred in dict.fromkeys(found) if target != module]


def _resolve(module: str, is_package: bool, name, level: int, package_name: str = PACKAGE):
    """The module an ``ImportFrom`` names, relative to the package, or None when it is outside it."""
    if level == 0:
        if name == package_name or (name or "").startswith(package_name + "."):
            return name[len(package_name) + 1:]
        return None
    parts = module.split(".") if module else []
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def violations(graph: dict[str, list[tuple[str, bool]]], layers=LAYERS, deferred=DEFERRED) -> list[str]:
    """What breaks the layer order in ``graph`` (module -> its imports): an import at module level of a
    higher layer, an upward import inside a function that ``deferred`` does not explain, a module no layer
    holds, and a cycle among the module-level imports."""
    problems = []
    for module, imports in graph.items():
        try:
            own = layer_of(module, layers)
        except KeyError:
            problems.append(f"{module or PACKAGE!r} is in no layer")
            continue
        for target, is_deferred in imports:
            if layer_of(target, layers) <= own:
                continue
            if is_deferred and (module, target) in deferred:
                continue
            where = "inside a function " if is_deferred else ""
            problems.append(f"{module or PACKAGE!r} ({layers[own][0]}) imports {where}{target or PACKAGE!r} "
                            f"({layers[layer_of(target, layers)][0]})")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """One cycle through each strongly connected part of the module-level imports (depth-first search)."""
    edges = {module: sorted({t for t, deferred in imports if not deferred and t in graph})
             for module, imports in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def walk(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                walk(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module)
    return cycles


def package_graph(root: Path = ROOT, package_name: str = PACKAGE) -> dict[str, list[tuple[str, bool]]]:
    """The package's modules, each with its imports of the package (:func:`imports_of`)."""
    modules = set(module_names(root))
    graph = {}
    for name in modules:
        path = root.joinpath(*name.split(".")) if name else root
        is_package = path.is_dir()
        source = (path / "__init__.py" if is_package else path.with_suffix(".py")).read_text()
        graph[name] = imports_of(name, source, modules, is_package, package_name)
    return graph


#: The sm80 backend's layers, lowest first (``hopper`` is a package without imports): what its kernel is
#: compiled with (Triton-free, read by the policy and the launcher alike), the Gluon kernel in its parts, the
#: policy that decides, the launcher that executes, and the backend that holds them.
SM80_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("schedule", ("hopper", "hopper.arguments", "hopper.flags", "hopper.schedule")),
    ("kernel", ("hopper.state", "hopper.loads", "hopper.epilogue", "hopper.consumer", "hopper.producer",
                "hopper.kernel", "hopper.encoded")),
    ("policy", ("policy",)),
    ("launcher", ("hopper.launch", "hopper.route")),
    ("backend", ("backend", "plugin", "")),
)


def test_the_sm80_backend_has_layers_and_no_import_circle():
    sm80 = pytest.importorskip("pagedprefill_sm80", reason="the sm80 backend is not installed")
    root = Path(sm80.__file__).parent
    graph = package_graph(root, "pagedprefill_sm80")
    assert violations(graph, SM80_LAYERS, {}) == []
    # The policy decides without the launcher or Triton: not even inside a function.
    assert not [target for target, _ in graph["policy"] if target in ("hopper.launch", "hopper.kernel")]


def test_no_module_imports_a_higher_layer():
    graph = package_graph()
    assert violations(graph) == []
    in_functions = {(module, target) for module, imports in graph.items() for target, deferred in imports if deferred}
    assert set(DEFERRED) <= in_functions, "DEFERRED explains an import that is gone"


def test_every_module_is_in_a_layer_and_every_layer_entry_exists():
    modules = module_names()
    for module in modules:
        layer_of(module)
    named = {member for _, members in LAYERS for member in members}
    assert named <= set(modules), named - set(modules)


def test_the_checker_reports_an_upward_import_a_deferred_one_and_a_cycle():
    layers = (("low", ("low",)), ("high", ("high", "")))
    modules = {"low", "high", "low.part"}
    upward = imports_of("low", "from .high import run\n", modules)
    assert upward == [("high", False)]
    assert violations({"low": upward, "high": []}, layers, {}) == ["'low' (low) imports 'high' (high)"]

    source = textwrap.dedent("""
        from . import part

        def detect():
            from ..high import run
            return run()
    """)
    nested = imports_of("low", source, modules, is_package=True)
    assert nested == [("low.part", False), ("high", True)]
    assert violations({"low": nested, "low.part": [], "high": []}, layers, {}) == [
        "'low' (low) imports inside a function 'high' (high)"]
    assert violations({"low": nested, "low.part": [], "high": []}, layers, {("low", "high"): "why"}) == []

    circle = {"low": [("low.part", False)], "low.part": [("low", False)], "high": [("low", False)]}
    assert violations(circle, layers, {}) == ["import cycle: low -> low.part -> low"]


_IMPORT_EACH = textwrap.dedent("""
    import importlib, os, sys, traceback
    import pluggy, pytest, torch, triton  # the heavy dependencies load once; every module is then imported
                                          # by a forked child that has none of the package loaded
    failed = []
    for name in sys.argv[1:]:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed.append(name)
    print("FAILED", *failed)
    sys.exit(1 if failed else 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
def test_each_module_imports_alone_in_a_fresh_interpreter():
    names = [f"{PACKAGE}.{module}" if module else PACKAGE for module in module_names()
             if module != "__main__"]  # runs the command line
    env = dict(os.environ, PAGEDPREFILL_LAZY_SELECT="1")
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_module_no_layer_lists_is_a_violation():
    graph = {"": [], "api": [], "unlisted": [("api", False)]}
    layers = (("low", ("api",)), ("facade", ("",)))
    assert violations(graph, layers, {}) == ["'unlisted' is in no layer"]
    with pytest.raises(KeyError):
        layer_of("unlisted", layers)
    assert layer_of("", layers) == 1 and layer_of("api", layers) == 0
