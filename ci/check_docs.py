"""Check the documentation: every relative link in README.md and docs/ resolves, and the README's Python
examples run (on the CPU, with whatever backend is selected). Exit status 1 on any failure."""

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


if __name__ == "__main__":
    problems = check_links() + run_readme_examples()
    for p in problems:
        print(p)
    print("docs: OK" if not problems else f"docs: {len(problems)} problem(s)")
    sys.exit(1 if problems else 0)
