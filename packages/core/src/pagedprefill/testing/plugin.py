"""pytest plugin (entry point ``pytest11``): options and fixtures of the conformance suite, its longest tests
ordered first, a fixture that clears the variables steering detection and selection (:func:`gpu_env`), and a
filter for the one warning Triton's CPU interpreter floods test output with."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from ..device import ENV_VENDOR
from ..registry import ENV_BACKEND
from ..workloads import BatchSpec, make_problem

#: Triton's CPU interpreter converts 1-element numpy arrays to ints in a way NumPy >= 1.25 deprecates, once
#: per indexed element: tens of thousands of identical warnings per run that say nothing about the code under
#: test. Only that warning, and only from the interpreter, is ignored; ``-W`` on the command line still wins.
TRITON_INTERPRETER_WARNING = (
    "ignore:Conversion of an array with ndim > 0 to a scalar is deprecated:DeprecationWarning:"
    "triton.runtime.interpreter"
)


class FailuresNow:
    """Each failing test's report on the terminal as soon as it fails (``--pagedprefill-failures-now``), not only
    in pytest's summary at the end, which a run cut by a time limit never reaches. Registered on the process that
    owns the terminal: with pytest-xdist the controller, to which every worker sends its reports."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        if not report.failed:
            return
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        text = f"FAILED {report.nodeid} ({report.when}):\n{report.longreprtext.rstrip()}"
        if reporter is None:
            print(text, flush=True)
        else:
            reporter.ensure_newline()
            reporter.write_line(text)
            reporter.flush()


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", TRITON_INTERPRETER_WARNING)
    if config.getoption("--pagedprefill-failures-now", default=False) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FailuresNow(config), "pagedprefill-failures-now")
    # A conformance suite skips the cases its backend or device does not run (bf16 in the interpreter, features a
    # backend refuses): the summary says why for each, as -rs would, in a backend author's plain `pytest tests`.
    chars = getattr(config.option, "reportchars", None)
    if isinstance(chars, str) and "s" not in chars and "a" not in chars and "A" not in chars and "N" not in chars:
        config.option.reportchars = chars + "s"


@pytest.hookimpl(trylast=True)  # after ``-k``/``-m`` deselection: the runs are cut from what is left
def pytest_collection_modifyitems(config, items):
    """The conformance suites' random sweep parts run first. Each part compiles kernels for dozens of random
    shapes and runs minutes on a GPU, far longer than most other tests; queued last (their place in the class),
    they would start when the other tests are done, one after another on the same worker, and the run would end
    long after its other workers went idle.

    Under pytest-xdist each worker starts on a contiguous run of the collection (``--dist worksteal`` splits it
    evenly, ``--dist load`` in smaller chunks), so the parts go to the heads of those runs, one per worker
    (:func:`spread_first`); alone, they simply come first. The order is otherwise kept."""
    from .conformance import ConformanceSuite

    def is_sweep_part(item) -> bool:
        cls = getattr(item, "cls", None)
        return (cls is not None and issubclass(cls, ConformanceSuite)
                and getattr(item, "originalname", "") == "test_random_sweep")

    # Part 0 of every suite, then part 1, ...: mixed on workers.
    parts = sorted((item for item in items if is_sweep_part(item)), key=lambda item: item.callspec.params["part"])
    rest = [item for item in items if not is_sweep_part(item)]
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    dist = getattr(config.option, "dist", "no")
    items[:] = spread_first(parts, rest, workers, dist)


def spread_first(first: list, rest: list, workers: int, dist: str = "worksteal") -> list:
    """``first`` and ``rest`` in one list where ``workers`` xdist workers, handed their initial runs of it by the
    ``dist`` mode, each start on one item of ``first`` (several where there are more of those than workers).

    Both modes hand out contiguous runs in worker order: ``worksteal`` the whole collection evenly (each idle
    worker gets ``pending // workers_left``), ``load`` runs of ``max(n // workers // 4, 2)`` items (one item per
    worker in turn when there are fewer than ``2 * workers``). A single process takes ``first`` first."""
    n = len(first) + len(rest)
    if workers <= 1 or not first or (dist == "load" and n < 2 * workers):
        return first + rest  # (round robin: the first items go to different workers)
    if dist == "load":
        sizes = [max(n // workers // 4, 2)] * workers
    else:
        sizes, left = [], n
        for i in range(workers):
            sizes.append(left // (workers - i))
            left -= sizes[-1]
    heads = [first[i::workers] for i in range(workers)]  # worker i's share of ``first``, in order
    out, rest = [], list(rest)
    for size, head in zip(sizes, heads):
        take = max(0, size - len(head))
        out += head + rest[:take]
        del rest[:take]
    return out + rest


def pytest_addoption(parser):
    group = parser.getgroup("pagedprefill")
    group.addoption("--pagedprefill-device", default=None,
                    help="device for conformance tests (default: cuda when available, else cpu)")
    group.addoption("--pagedprefill-size", default=None, choices=("small", "large"),
                    help="case sizes: small (interpreter-friendly) or large (default on GPUs)")
    group.addoption("--pagedprefill-sweep", type=int, default=None,
                    help="number of random cases in the conformance sweep (default 8 on CPU, 200 on GPU); the "
                         "model-heads sweep draws a quarter as many, at least 8")
    group.addoption("--pagedprefill-seeds", default=None, metavar="SEED,...",
                    help="check only these cases of the two sweeps, by the seed a failing case names "
                         "(seed=5027), e.g. 5027,1003; the sweep's size still bounds which seeds exist")
    group.addoption("--pagedprefill-failures-now", action="store_true",
                    help="print each failing test's report as soon as it fails (with pytest-xdist too), not only "
                         "in the summary at the end: a run cut by a time limit keeps them")
    group.addoption("--pagedprefill-fuzz", type=int, default=2000,
                    help="number of random cases of the GPU fuzz against the reference (default 2000)")
    group.addoption("--pagedprefill-fuzz-engine", type=int, default=0,
                    help="number of random cases of the GPU fuzz of the serving engine's call (k = v = None, "
                         "pages of 16 and up, mixed decode, speculative and chunk rows; default 0: not run)")


@pytest.fixture(scope="session")
def pagedprefill_device(request) -> torch.device:
    """The torch device the conformance suite runs on."""
    name = request.config.getoption("--pagedprefill-device")
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"--pagedprefill-device={name} but torch sees no CUDA device")
    return device


@pytest.fixture(scope="session")
def pagedprefill_size(request, pagedprefill_device) -> str:
    size = request.config.getoption("--pagedprefill-size")
    return size or ("small" if pagedprefill_device.type == "cpu" else "large")


@pytest.fixture(scope="session")
def pagedprefill_sweep(request, pagedprefill_device) -> int:
    n = request.config.getoption("--pagedprefill-sweep")
    return n if n is not None else (8 if pagedprefill_device.type == "cpu" else 200)


@pytest.fixture(scope="session")
def pagedprefill_seeds(request) -> Optional[frozenset]:
    """The sweep cases ``--pagedprefill-seeds`` names (None: every case of the sweeps)."""
    text = request.config.getoption("--pagedprefill-seeds")
    if text is None:
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise pytest.UsageError(f"--pagedprefill-seeds: expected seeds separated by commas (e.g. 5027,1003), "
                                f"got {text!r}") from None


@pytest.fixture(scope="session")
def pagedprefill_fuzz(request) -> int:
    """Number of cases of the GPU fuzz (``--pagedprefill-fuzz``)."""
    return _case_count(request, "--pagedprefill-fuzz")


@pytest.fixture(scope="session")
def pagedprefill_fuzz_engine(request) -> int:
    """Number of cases of the GPU fuzz of the engine's call (``--pagedprefill-fuzz-engine``)."""
    return _case_count(request, "--pagedprefill-fuzz-engine")


def _case_count(request, option: str) -> int:
    n = request.config.getoption(option)
    if n < 0:
        raise pytest.UsageError(f"{option}: expected a number of cases >= 0, got {n}")
    return n


@pytest.fixture
def terminal_line(request):
    """``terminal_line(text)`` prints one line on the terminal at once, even while pytest captures output
    (progress of long tests such as the GPU fuzz shows without ``-s``)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")

    def write(text: str) -> None:
        if capture is None or reporter is None:
            print(text, flush=True)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(text)
            reporter.flush()

    return write


#: What a test under :func:`gpu_env` runs without: the interpreter, a forced vendor and a forced backend.
GPU_ENV_UNSET = ("TRITON_INTERPRET", ENV_VENDOR, ENV_BACKEND)


@pytest.fixture
def gpu_env(monkeypatch):
    """Device detection and backend selection as on a GPU machine: the variables of :data:`GPU_ENV_UNSET`
    (``TRITON_INTERPRET``, ``PAGEDPREFILL_VENDOR``, ``PAGEDPREFILL_BACKEND``) are unset for the test. Returns
    ``monkeypatch``, for the test's own changes (undone with these when it ends)."""
    for name in GPU_ENV_UNSET:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def make_paged_batch(pagedprefill_device):
    """Factory fixture: ``make_paged_batch(**BatchSpec fields)`` -> a random PrefillProblem."""

    def build(**fields):
        return make_problem(BatchSpec(**fields), pagedprefill_device)

    return build
