"""What a new user reads: the README and the backend guide say who provides what and how to install, and
the template's exclusion example covers every case it means to exclude."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pagedprefill
import pytest
from pagedprefill.types import FEATURES

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
GUIDE = REPO / "docs" / "writing-a-backend.md"
TEMPLATE = REPO / "docs" / "backend-template"

pytestmark = pytest.mark.skipif(not GUIDE.is_file(), reason=f"no {GUIDE} (this checkout does not include docs/)")


def _table_row(text: str, package: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| `{package}`"))


def test_readme_credits_the_commands_to_core():
    text = README.read_text()
    assert "`info`, `demo`, `bench`, `tune`" in _table_row(text, "packages/core")
    assert "`bench`/`tune`" not in _table_row(text, "packages/backend-sm80")
    assert "install them from this repository's `packages/` folder, core\nfirst" in text


def _before_first_editable_install(text: str) -> str:
    return text[:text.index("pip install -e .")]


@pytest.mark.parametrize("page", [GUIDE, TEMPLATE / "README.md"], ids=["guide", "template"])
def test_backend_docs_install_core_before_the_backend(page):
    """pip cannot find pagedprefill on an index: core from the repository must come first."""
    before = _before_first_editable_install(page.read_text())
    assert re.search(r'pip install "[^"]*packages/core\[triton\]"', before), page
    assert "Could not find a version that satisfies the requirement pagedprefill>=0.1" in " ".join(before.split())


def test_guide_excludes_fp8_by_cache_dtype_not_by_one_case_name():
    text = GUIDE.read_text()
    assert 'exclusions = {"fp8_e4m3":' not in text
    assert "excluded_kv_cache_dtypes = {" in text
    for case in ("fp8_e4m3", "fp8_e5m2", "fp8_split_tensor_scales", "block_size_32_split_fp8"):
        assert f"`{case}`" in text, case


def test_template_readme_names_the_description_among_what_to_rename():
    text = (TEMPLATE / "README.md").read_text()
    assert "`description` in `pyproject.toml`" in text
    assert "(template)" not in (TEMPLATE / "src" / "pagedprefill_mybackend" / "backend.py").read_text()
    assert 'description = f"Triton kernels tuned for {VENDOR} accelerators"' in \
        (TEMPLATE / "src" / "pagedprefill_mybackend" / "backend.py").read_text()


def _check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", REPO / "ci" / "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["reference", "generic", "sm80", "bi100"])
def test_readme_options_table_matches_supported_features(backend):
    """Each backend's column says "yes" exactly for the features its ``supported_features`` holds."""
    found = {b.name: b for b in pagedprefill.get_registry().backends()}
    if backend not in found:
        pytest.skip(f"backend {backend!r} is not installed here (install ./packages/backend-{backend})")
    supported = {backend: frozenset(found[backend].supported_features)}
    assert _check_docs().check_options_table(supported, FEATURES) == []


def test_options_table_check_catches_a_wrong_cell():
    """The check is not vacuous: a backend that lost a feature the table promises is reported."""
    problems = _check_docs().check_options_table({"generic": FEATURES - {"skip_decode"}}, FEATURES)
    assert problems == ["README.md options table: generic / skip_decode says 'yes', but "
                        "generic.supported_features lacks it"]


#: Where the backend guide describes each tiling type: from the first text to the second.
FIELD_PARAGRAPHS = {"ProblemShape": ("`ProblemShape` (`pagedprefill.tiling`) carries", "`TileConfig` has"),
                    "TileConfig": ("`TileConfig` has", "End every policy")}


@pytest.mark.parametrize("cls", sorted(FIELD_PARAGRAPHS))
def test_guide_lists_every_field(cls):
    """The backend guide's paragraph on a tiling type names each of its fields."""
    import dataclasses

    from pagedprefill import tiling

    text = " ".join(GUIDE.read_text().split())
    begin, end = FIELD_PARAGRAPHS[cls]
    paragraph = text[text.index(begin):]
    paragraph = paragraph[:paragraph.index(end)]
    missing = [f.name for f in dataclasses.fields(getattr(tiling, cls)) if f"`{f.name}`" not in paragraph]
    assert not missing, f"docs/writing-a-backend.md does not describe {cls} fields {missing}"


@pytest.mark.parametrize("page", [GUIDE, TEMPLATE / "README.md"], ids=["guide", "template"])
def test_backend_docs_install_pytest_before_running_it(page):
    """The tests are run with pytest, and in Triton's interpreter with numpy < 2.4: the test extra brings both, and
    is installed before the first pytest command."""
    text = page.read_text()
    first_pytest = re.search(r"(^|`)(TRITON_INTERPRET=1 )?pytest tests", text, re.M)
    assert first_pytest, page
    assert re.search(r"""pip install -e ["']\.\[test\]["']""", text[:first_pytest.start()]), page


def test_guide_says_what_a_cpu_machine_installs():
    text = " ".join(GUIDE.read_text().split())
    assert '"torch==2.13.0+cpu"' in text and "https://download.pytorch.org/whl/cpu" in text
    assert "Could not find a version that satisfies the requirement torch==2.13.0+cpu" in text
    assert "numpy < 2.4" in text


def _readme_cpu_lines() -> tuple[str, str]:
    """The README's CPU install line and the one for when PyTorch's CPU index cannot be reached."""
    text = README.read_text()
    line = next(line for line in text.splitlines() if line.startswith("pip install") and line.endswith("# CPU"))
    fallback = re.search(r'`(pip install "triton[^`]*)`', text)
    assert fallback, "no install line for when PyTorch's CPU index cannot be reached"
    return line, fallback.group(1)


def test_readme_cpu_install_pins_what_the_tests_session_installs():
    """Every pin of the CPU line is one the tests session's constraints allow, and the constraints' exact pins
    (Triton's) are on the line, so that the line installs what the tests ran with."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    line, fallback = _readme_cpu_lines()
    constraints = {}
    for raw in (REPO / "ci" / "constraints-cpu.txt").read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            requirement = Requirement(raw)
            constraints[requirement.name] = requirement.specifier
    pins = {}
    for quoted in re.findall(r'"([a-z]+==[^"]+)"', line):
        requirement = Requirement(quoted)
        (spec,) = requirement.specifier
        pins[requirement.name] = spec.version
        assert constraints[requirement.name].contains(Version(spec.version)), (quoted, constraints)
    exact = {name for name, spec in constraints.items() if any(s.operator == "==" for s in spec)}
    assert exact <= set(pins), (exact, pins)
    assert "torch" in pins and "[interpreter]" in line  # numpy < 2.4 comes with the interpreter extra
    # The fallback is the same install without PyTorch's index and its torch pin.
    assert fallback.split() == [word for word in line.split("#")[0].split()
                                if word not in ("--extra-index-url", "https://download.pytorch.org/whl/cpu",
                                                f'"torch=={pins["torch"]}"')]
