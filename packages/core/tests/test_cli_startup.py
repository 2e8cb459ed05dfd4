"""The ``pagedprefill`` command starts without the library: its parser is built, and its help shown, without
importing torch, Triton or a backend, so that ``--help`` answers at once.

Each check runs the command in a fresh interpreter and reads the modules it had imported when it exited (a
``sitecustomize`` on its path records them), so that an import that comes back is caught whatever it costs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pagedprefill.cli import commands

TIMEOUT = 300
#: Written where the child finds it first: on exit, one line with every module the child had imported.
RECORD_MODULES = '''
import atexit
import sys


@atexit.register
def _record():
    sys.stderr.write("MODULES " + " ".join(sorted(sys.modules)) + "\\n")
'''
#: What the command must not import before a subcommand runs.
HEAVY = ("torch", "triton", "numpy", "pagedprefill._facade", "pagedprefill.ops", "pagedprefill_sm80",
         "pagedprefill_generic", "pagedprefill_bi100")
#: The command's script as installers write it for the entry point ``pagedprefill = "pagedprefill.cli:main"``.
SCRIPT = '''import re
import sys
from pagedprefill.cli import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def recording_env(tmp_path_factory) -> dict:
    """An environment whose interpreters say, on exit, which modules they imported."""
    site = tmp_path_factory.mktemp("record_modules")
    (site / "sitecustomize.py").write_text(RECORD_MODULES)
    env = {k: v for k, v in os.environ.items() if k != "PAGEDPREFILL_LAZY_SELECT"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env


def imported(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``command``; its result and the modules it had imported when it exited."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("MODULES ")]
    assert len(lines) == 1, proc.stderr
    return proc, set(lines[0].split()[1:])


def heavy(modules: set[str], names=HEAVY) -> list[str]:
    """The modules of ``names`` (or inside them) among ``modules``."""
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


@pytest.mark.parametrize("args", [[], ["demo"], ["bench"], ["tune"]], ids=["top", "demo", "bench", "tune"])
def test_help_imports_no_torch(recording_env, args):
    proc, modules = imported([sys.executable, "-m", "pagedprefill", *args, "--help"], recording_env)
    assert proc.returncode == 0, proc.stderr
    assert "usage: pagedprefill" in proc.stdout
    assert heavy(modules) == []


def test_info_help_loads_the_backends_but_no_triton_nor_kernel(recording_env):
    """``info --describe`` lists the devices the installed backends describe: its help loads them (and torch
    with them), and nothing that compiles or launches a kernel."""
    proc, modules = imported([sys.executable, "-m", "pagedprefill", "info", "--help"], recording_env)
    assert proc.returncode == 0, proc.stderr
    assert "describe a device that is not present: " in " ".join(proc.stdout.split())
    assert heavy(modules, ("triton", "pagedprefill.triton", "pagedprefill.cli.bench", "pagedprefill.workloads")) == []


@pytest.mark.parametrize("form", [["-m", "pagedprefill"], ["-mpagedprefill"], ["-m", "pagedprefill.__main__"],
                                  ["-X", "importtime", "-m", "pagedprefill"]],
                         ids=["m", "m-joined", "main", "with-options"])
def test_every_way_of_naming_the_module_starts_light(recording_env, form):
    proc, modules = imported([sys.executable, *form, "--version"], recording_env)
    assert proc.returncode == 0 and proc.stdout == "pagedprefill 0.1.0\n", proc.stdout + proc.stderr
    assert heavy(modules) == []


def test_the_installed_script_starts_light(recording_env, tmp_path):
    script = tmp_path / "bin" / "pagedprefill"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    proc, modules = imported([sys.executable, str(script), "tune", "--help"], recording_env)
    assert proc.returncode == 0 and "usage: pagedprefill tune" in proc.stdout, proc.stderr
    assert heavy(modules) == []


def test_a_subcommand_runs_with_the_library_imported_as_import_pagedprefill_does(recording_env):
    """After parsing, the command imports the library: the operators are registered, as by ``import pagedprefill``."""
    proc, modules = imported([sys.executable, "-m", "pagedprefill", "info", "--device", "cpu"], recording_env)
    assert proc.returncode == 0, proc.stderr
    assert {"torch", "pagedprefill._facade", "pagedprefill.ops"} <= modules


def test_importing_the_package_still_imports_the_library(recording_env):
    """``import pagedprefill`` registers the operators and chooses a backend, its plugins loaded without error
    (they read ``pagedprefill.hookimpl`` while the package is being imported)."""
    code = ("import pagedprefill as pp, torch\n"
            "print(torch.ops.pagedprefill.prefill_attention.default.name())\n"
            "print(pp.get_registry().load_errors, pp.import_selection() is not None)\n")
    proc, modules = imported([sys.executable, "-c", code], recording_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["pagedprefill::prefill_attention", "{} True"], proc.stdout
    assert "pagedprefill._facade" in modules


def test_the_help_lists_the_library_s_own_choices():
    """The choices declared for the parser are the library's: the bench suites, tune's dtypes."""
    from pagedprefill.cli.tune import DTYPES
    from pagedprefill.workloads import SUITES

    assert list(commands.SUITE_NAMES) == sorted(SUITES)
    assert list(commands.DTYPE_NAMES) == sorted(DTYPES)


def test_info_help_names_every_described_device(capsys):
    from pagedprefill.cli import build_parser
    from pagedprefill.cli.info import described_devices

    with pytest.raises(SystemExit):
        build_parser().parse_args(["info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"describe a device that is not present: {', '.join(sorted(described_devices()))} " in text


def test_the_script_form_is_what_installers_write():
    """The script of :data:`SCRIPT` is named by the distribution's entry point, so the check above is the
    installed command's."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'pagedprefill = "pagedprefill.cli:main"' in pyproject
