"""Check the documentation: every relative link in README.md and docs/ resolves, the README's Python
examples run (on the CPU, with whatever backend is selected), and the README's options table says of each
installed backend what its ``supported_features`` say. Exit status 1 on any failure."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def check_links() -> list[str]:
    problems = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "packages").glob("*/README.md"))]
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                problems.append(f"{page.relative_to(ROOT)}: broken link {target}")
    return problems


def run_readme_examples() -> list[str]:
    problems = []
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), {})
        except Exception as exc:
            problems.append(f"README.md python block {i + 1}: {type(exc).__name__}: {exc}")
    if not blocks:
        problems.append("README.md has no python examples")
    return problems


def options_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The README's options table: its backend columns, and ``{feature name: {backend: cell}}`` for each row
    that names a feature."""
    lines = text[text.index("Options and which backends run them"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    backends = header[2:]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[1]:
            rows[cells[1].strip("`")] = dict(zip(backends, cells[2:]))
    return backends, rows


def check_options_table(supported: dict[str, frozenset], features: frozenset) -> list[str]:
    """Compare the README's options table with ``supported`` (backend name -> its ``supported_features``):
    a cell says "yes" exactly when the backend computes that feature; every feature has a row."""
    backends, rows = options_table((ROOT / "README.md").read_text())
    problems = [f"README.md options table: no row for feature {f!r}" for f in sorted(features - rows.keys())]
    problems += [f"README.md options table: row {f!r} is not a feature" for f in sorted(rows.keys() - features)]
    for name, computed in supported.items():
        if name not in backends:
            problems.append(f"README.md options table: no column for backend {name!r}")
            continue
        for feature, cells in rows.items():
            says = cells[name].startswith("yes")
            if says != (feature in computed):
                problems.append(f"README.md options table: {name} / {feature} says {cells[name]!r}, but "
                                f"{name}.supported_features {'has' if feature in computed else 'lacks'} it")
    return problems


def installed_features() -> dict[str, frozenset]:
    """``supported_features`` of every backend installed here."""
    import pagedprefill

    return {b.name: frozenset(b.supported_features) for b in pagedprefill.get_registry().backends()}


if __name__ == "__main__":
    from pagedprefill.types import FEATURES

    supported = installed_features()
    print(f"options table checked against the installed backends: {', '.join(sorted(supported))}")
    problems = check_links() + run_readme_examples() + check_options_table(supported, FEATURES)
    for p in problems:
        print(p)
    print("docs: OK" if not problems else f"docs: {len(problems)} problem(s)")
    sys.exit(1 if problems else 0)
