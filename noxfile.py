"""Sessions: ``tests`` (CPU, Triton interpreter), ``demo``, ``lint``, ``docs``, one per hardware target
(``generic``, ``sm80``, ``bi100``) that runs the conformance suite on that hardware, and ``production`` (GPU:
CUDA graphs, multi-GPU, determinism, fuzzing against the reference; see docs/reliability.md).

Every session also runs with ``--no-venv`` on a machine without a package index (torch, Triton, pytest and
pluggy preinstalled): then the project's packages are installed into the current interpreter with
``pip install --no-deps --no-build-isolation -e`` and nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / "ci" / "constraints-cpu.txt"
CORE = "packages/core"
BACKENDS = {
    "generic": "packages/backend-generic",
    "sm80": "packages/backend-sm80",
    "bi100": "packages/backend-bi100",
}

#: PyTorch's index of CPU builds: the CPU sessions (tests, docs) add it where it answers, so that they install
#: a CPU build of torch (a few hundred MB) rather than the public index's CUDA build (gigabytes).
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"

nox.options.sessions = ["lint", "tests", "demo", "docs"]
nox.options.default_venv_backend = "venv"


class _WithoutUvProbe(logging.Filter):
    """Drops nox's "uv binary not found." line: nox looks for uv before creating any environment, but these
    sessions create theirs with the standard library's venv, so uv's absence means nothing here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


logging.getLogger("nox").addFilter(_WithoutUvProbe())


def _public_torch() -> str:
    """What pip takes for torch from the public index alone, in words (for the log, before it downloads)."""
    if sys.platform.startswith("linux"):
        return ("torch 2.11.0 from the public index, whose Linux build is the CUDA one: about 4.7 GB with NVIDIA's "
                "CUDA libraries (15 nvidia-* packages), which runs on the CPU too")
    return "torch 2.11.0 from the public index"


def _nvidia_gpu() -> bool:
    """Whether NVIDIA's driver lists a GPU on this machine (asked before torch is installed to ask)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.lstrip().startswith("GPU")


def _no_venv(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _unreachable(url: str, timeout: float = 5.0) -> str:
    """Why ``url`` does not answer, or "" when it does."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return ""
    except OSError as error:  # URLError, timeouts, refused connections
        return str(getattr(error, "reason", error))


def install(session: nox.Session, *packages: str, extras: str = "", cpu_torch: bool = False) -> None:
    """Install the project's packages (editable, each once); pinned deps in a venv (with ``cpu_torch``, a
    CPU build of torch where PyTorch's CPU index answers), nothing fetched without one.

    In a venv the install is said first (what, under which pins, which torch), and pip's own output follows:
    nox would hide it unless run with ``--verbose``, and downloading torch takes minutes."""
    paths = [p for p in dict.fromkeys(packages) if (ROOT / p).exists()]
    if _no_venv(session):
        session.run("python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    *[a for p in paths for a in ("-e", p)], external=True)
        return
    core = f"{CORE}[{extras}]" if extras else CORE
    targets = [core if p == CORE else p for p in paths]
    index = []
    torch = _public_torch()
    if cpu_torch:
        why = _unreachable(f"{CPU_TORCH_INDEX}/torch/")
        if why:
            session.log(f"PyTorch's CPU index {CPU_TORCH_INDEX} does not answer ({why}), so pip takes "
                        f"{torch} (unless the configured indexes offer another build)")
        else:
            index = ["--extra-index-url", CPU_TORCH_INDEX]
            torch = f"torch's CPU build from {CPU_TORCH_INDEX} (about 200 MB)"
    session.log(f"pip installs {', '.join(targets)} (editable) and their dependencies, pinned by "
                f"{CONSTRAINTS.relative_to(ROOT)}; it takes {torch}")
    session.install(*index, "-c", str(CONSTRAINTS), *[a for p in targets for a in ("-e", p)], silent=False)


def pytest_args(session: nox.Session) -> list[str]:
    return ["-q", "-rs", "-p", "no:cacheprovider", *session.posargs]


def parallel_args() -> list[str]:
    """pytest-xdist over the machine's cores (the test extra brings it): one worker per core, idle workers taking
    queued tests from busy ones (the conformance suites' random sweeps run minutes each)."""
    cores = os.cpu_count() or 1
    return ["-n", str(cores), "--dist", "worksteal"] if cores > 1 else []


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests on the CPU; Triton kernels under TRITON_INTERPRET=1."""
    if not _no_venv(session):
        # The same requirements, resolved against the public index alone (metadata only): the pins must hold
        # for a user without this machine's local wheels. Skips with the reason when the index is unreachable.
        session.run("python", "ci/check_pins.py", f"{CORE}[triton,test,transformers]", *BACKENDS.values())
    install(session, CORE, *BACKENDS.values(), extras="triton,test,transformers", cpu_torch=True)
    session.run("pytest", *pytest_args(session), *parallel_args(), f"{CORE}/tests")
    # The backends' suites in one run: sm80's ahead-of-time compiles (one test of them takes two minutes) share the
    # workers with the other suites' interpreter cases instead of leaving a worker idle at the end of each run.
    suites = [f"{path}/tests" for path in BACKENDS.values() if (ROOT / path / "tests").exists()]
    session.run("pytest", *pytest_args(session), *parallel_args(), *suites, "--pagedprefill-device=cpu",
                env={"TRITON_INTERPRET": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """Run the demo: a realistic paged batch on the selected backend, checked against the reference.

    On a machine without an NVIDIA GPU it runs the reference and Triton's interpreter, for which the CPU build of
    torch (a few hundred MB) does; it is taken where PyTorch's CPU index answers."""
    cpu_torch = not _no_venv(session) and not _nvidia_gpu()  # (without a venv nothing is installed)
    if cpu_torch:
        session.log("no NVIDIA GPU listed by its driver: the demo runs on the CPU, with the CPU build of torch")
    # test: numpy, for Triton's interpreter
    install(session, CORE, *BACKENDS.values(), extras="triton,test", cpu_torch=cpu_torch)
    session.run("pagedprefill", "info")
    session.run("pagedprefill", "demo", *session.posargs)
    gpu = session.run("python", "-c", "import torch; print('GPU', torch.cuda.is_available())", silent=True) or ""
    if "GPU False" in gpu:
        session.log("no GPU: the same batch through the generic backend's Triton kernels in Triton's CPU interpreter")
        session.run("pagedprefill", "demo", "--backend", "generic", env={"TRITON_INTERPRET": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every package, the noxfile and CI scripts."""
    if not _no_venv(session):
        session.install("ruff", silent=False)
    session.run("ruff", "check", "packages", "ci", "noxfile.py", "docs")


@nox.session
def docs(session: nox.Session) -> None:
    """Check the docs: relative links resolve and the README's Python examples run (CPU, reference)."""
    install(session, CORE, cpu_torch=True)
    session.run("python", "ci/check_docs.py")


def _hardware_session(session: nox.Session, target: str) -> None:
    install(session, CORE, BACKENDS["generic"], BACKENDS[target], extras="triton,test")
    forced = os.environ.get("PAGEDPREFILL_FORCE_TARGET") == "1"
    verdict = session.run("python", "ci/detect_target.py", target, silent=True, success_codes=[0, 3]) or ""
    session.log(verdict.strip())
    if verdict.startswith("absent") and not forced:
        reason = verdict.strip().removeprefix("absent:").strip()
        session.skip(f"{target} hardware not present: {reason}; set PAGEDPREFILL_FORCE_TARGET=1 to run "
                     "its kernels with its policy forced on another GPU")
    session.run("pagedprefill", "info")
    session.run("pytest", *pytest_args(session), f"{BACKENDS[target]}/tests", "--pagedprefill-device=cuda")


@nox.session
def generic(session: nox.Session) -> None:
    """Conformance of the generic backend on the present GPU (bf16 and large sizes included)."""
    _hardware_session(session, "generic")


@nox.session
def sm80(session: nox.Session) -> None:
    """Conformance of the sm80 backend on an NVIDIA GPU of capability >= 8.0."""
    _hardware_session(session, "sm80")


@nox.session
def bi100(session: nox.Session) -> None:
    """Conformance of the bi100 backend on an Iluvatar CoreX GPU (or, forced, its policy on another GPU)."""
    _hardware_session(session, "bi100")


@nox.session
def production(session: nox.Session) -> None:
    """GPU reliability tests (packages/core/tests/gpu) on the selected backend; skips when no GPU is present.

    ``nox -s production -- --pagedprefill-fuzz=N`` sets the number of fuzz cases (default 2000).
    """
    install(session, CORE, *BACKENDS.values(), extras="triton,test")
    probe = "import torch; print('gpus:', torch.cuda.device_count(), torch.__version__)"
    output = session.run("python", "-c", probe, silent=True) or ""
    line = next((x for x in output.splitlines() if x.startswith("gpus: ")), "gpus: 0 unknown")
    _, count, version = line.split()
    if count == "0":
        session.skip(f"no GPU visible to torch {version}: the production tests need a CUDA GPU "
                     "(two for the multi-GPU tests)")
    session.log(f"{count} GPU(s) visible to torch {version}")
    session.run("pagedprefill", "info")
    session.run("pytest", *pytest_args(session), f"{CORE}/tests/gpu", "--pagedprefill-device=cuda")
