"""Rules the source holds to: kernel building blocks with argument lists a reader can hold (grouped into named
tuples and aggregates past a few), and comments that say why the code is as it is, not which measurement run
found it (the runs are recorded in docs/performance.md and its history)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pagedprefill
import pytest

ROOT = Path(pagedprefill.__file__).resolve().parents[4]
#: Most parameters a kernel function (``@triton.jit`` / ``@gluon.jit``) may write out.
MAX_KERNEL_PARAMETERS = 30


def _source_files() -> list[Path]:
    files = sorted(ROOT.glob("packages/*/src/**/*.py")) + sorted(ROOT.glob("ci/**/*.py"))
    return [f for f in files if "backend-template" not in f.parts]


def _is_kernel(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = ast.unparse(target)
        if name.endswith(("triton.jit", "gluon.jit")) or name == "jit":
            return True
    return False


def kernel_parameter_counts(path: Path) -> dict[str, int]:
    """Each kernel function of ``path`` with the number of parameters it writes out."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_kernel(node):
            a = node.args
            out[node.name] = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return out


def test_the_source_tree_is_found():
    assert (ROOT / "packages" / "core").is_dir() and _source_files(), ROOT


def test_no_kernel_function_writes_out_more_than_30_parameters():
    if not (ROOT / "packages" / "backend-sm80").is_dir():
        pytest.skip("not run from the repository (the packages are installed elsewhere)")
    too_many = {f"{path.relative_to(ROOT)}:{name}": n for path in _source_files()
                for name, n in kernel_parameter_counts(path).items() if n > MAX_KERNEL_PARAMETERS}
    assert too_many == {}


def test_the_counter_counts_a_kernels_parameters(tmp_path):
    source = tmp_path / "k.py"
    source.write_text("import triton\n\n@triton.jit\ndef k(a, b, C: tl.constexpr, *, d=1):\n    pass\n\n"
                      "def plain(x):\n    pass\n")
    assert kernel_parameter_counts(source) == {"k": 4}


#: "run 12", "runs 3-4", "(run 7)": a measurement run cited as the reason for code.
RUN_CITATION = re.compile(r"\bruns? \d+\b", re.IGNORECASE)


def test_no_source_file_cites_a_measurement_run():
    if not (ROOT / "packages" / "backend-sm80").is_dir():
        pytest.skip("not run from the repository (the packages are installed elsewhere)")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in _source_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if RUN_CITATION.search(line)]
    assert found == []
