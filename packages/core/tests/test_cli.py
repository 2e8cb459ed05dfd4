"""The ``pagedprefill`` command as a user runs it: ``python -m pagedprefill ...`` in a subprocess.

Every mistake a user can make on the command line is one line on stderr that says what to do, with exit
status 2 and no traceback; the help is plain text; the demo checks against an independent computation.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from pagedprefill.cli import main, one_line

TIMEOUT = 300
#: Variables that change what the command selects; removed so that each test sets what it needs.
SELECTION_ENV = ("PAGEDPREFILL_BACKEND", "PAGEDPREFILL_VENDOR", "PAGEDPREFILL_LAZY_SELECT", "TRITON_INTERPRET")


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SELECTION_ENV}
    return subprocess.run([sys.executable, "-m", "pagedprefill", *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=TIMEOUT)


def assert_user_error(proc: subprocess.CompletedProcess, command: str, *fragments: str) -> str:
    """Exit status 2, no traceback, and exactly one line on stderr naming the command and the fragments."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit status {proc.returncode}:\n{output}"
    assert "Traceback" not in output, output
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith(f"pagedprefill {command}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: these are CPU-machine errors")


@no_gpu
def test_backend_that_cannot_run_here():
    if importlib.util.find_spec("pagedprefill_sm80") is None:
        pytest.skip("pagedprefill-sm80 is not installed (install ./packages/backend-sm80)")
    line = assert_user_error(run_cli("demo", "--backend", "sm80"), "demo",
                             "backend 'sm80' was requested but cannot run on", "runs on GPUs only",
                             "leave out --backend to choose automatically")
    assert "pagedprefill info" in line


def test_backend_that_is_not_installed():
    assert_user_error(run_cli("demo", "--backend", "nonexistent"), "demo",
                      "backend 'nonexistent' was requested but is not installed", "discovered backends: ",
                      "reference", "leave out --backend")


def test_environment_names_no_usable_backend():
    assert_user_error(run_cli("demo", PAGEDPREFILL_BACKEND="nonexistent"), "demo",
                      "PAGEDPREFILL_BACKEND='nonexistent' names no backend that can run on",
                      "nonexistent: backend 'nonexistent' was requested but is not installed",
                      "(unset PAGEDPREFILL_BACKEND to choose automatically)")


@pytest.mark.parametrize("value", [",", ",, ,"])
def test_environment_with_no_names(value):
    line = assert_user_error(run_cli("demo", PAGEDPREFILL_BACKEND=value), "demo",
                             f"PAGEDPREFILL_BACKEND={value!r} names no backend: expected backend names separated "
                             "by commas, such as 'sm80,generic' (installed: ",
                             "reference", "; unset PAGEDPREFILL_BACKEND to choose automatically")
    assert "Unset" not in line, line


@pytest.mark.parametrize("command", ["demo", "bench", "tune"])
def test_meta_device_is_refused_by_the_commands_that_compute(command):
    assert_user_error(run_cli(command, "--device", "meta"), command,
                      "argument --device: meta: meta tensors hold no data", "use --device cpu or a GPU")


@no_gpu
@pytest.mark.parametrize("command", ["demo", "info"])
def test_cuda_device_without_a_gpu(command):
    line = assert_user_error(run_cli(command, "--device", "cuda"), command, "argument --device: cuda: ",
                             "or use --device cpu")
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch" in line
    else:
        assert "no CUDA device is visible" in line


@pytest.mark.parametrize("command", ["demo", "info"])
def test_unknown_device_string(command):
    assert_user_error(run_cli(command, "--device", "gpu7"), command,
                      "argument --device: expected a torch device such as cpu, cuda or cuda:1, got 'gpu7'")


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_repeats_must_be_positive(value):
    shown = value if value == "two" else str(int(value))
    assert_user_error(run_cli("demo", "--repeats", value), "demo", "argument --repeats: expected a whole number >= 1",
                      f"got {shown!r}" if value == "two" else f"got {shown}", "see 'pagedprefill demo --help'")


def test_tune_head_size_must_be_positive():
    assert_user_error(run_cli("tune", "--head-size", "0"), "tune", "argument --head-size: expected a whole number")


def test_bench_suite_must_be_one_it_has():
    assert_user_error(run_cli("bench", "--suite", "huge"), "bench", "argument --suite: invalid choice: 'huge'",
                      "'context'", "'default'")


def test_context_suite_streams_8k_to_128k_cached_tokens():
    """The context-scaling suite: the same 2 x 1024 new tokens, only the cached prefix grows; its FLOPs are the
    exact attended pairs (each new token sees the whole prefix and the new tokens up to itself)."""
    from pagedprefill.workloads import SUITES, flops

    suite = SUITES["context"]()
    assert [w.spec.context_lens for w in suite] == [(8192,) * 2, (32768,) * 2, (131072,) * 2]
    for w in suite:
        assert w.spec.query_lens == (1024, 1024) and (w.spec.num_heads, w.spec.head_size) == (32, 128)
        c = w.spec.context_lens[0]
        assert flops(w.spec) == 4 * 128 * 32 * 2 * (1024 * c + 1024 * 1025 // 2)


def test_unknown_described_device():
    assert_user_error(run_cli("info", "--describe", "nosuchgpu"), "info", "--describe: expected one of ", "h200",
                      "got 'nosuchgpu'")


def test_missing_command():
    proc = run_cli()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "pagedprefill: error: the following arguments are required: COMMAND (see 'pagedprefill --help')"]


def test_help_is_plain_text_and_says_who_provides_what():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for markup in ("``", ":class:", ":func:", ".. "):
        assert markup not in proc.stdout, f"{markup!r} in the help:\n{proc.stdout}"
    text = " ".join(proc.stdout.split())
    assert "Core provides info, demo, bench and tune" in text
    for command in ("info", "demo", "bench", "tune"):
        assert re.search(rf"^\s+{command}\s+\S", proc.stdout, re.M), f"{command} not listed:\n{proc.stdout}"


def test_tune_help_documents_backend_and_device_with_defaults():
    proc = run_cli("tune", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--backend BACKEND backend whose declared search space is swept" in text
    assert "(default: sm80)" in text
    assert "--device DEVICE CUDA device to tune on (default: the current one)" in text
    assert "(default: 64 128)" in text and "(default: bf16)" in text


def test_demo_compares_with_an_independent_float64_computation():
    """On a CPU the demo runs the reference backend: it must not be compared with itself."""
    proc = run_cli("demo", "--device", "cpu", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"max abs error vs float64 torch scaled_dot_product_attention \(independent of the "
                      r"backends\): (\S+) \(tolerance (\S+)\) -> OK", proc.stdout)
    assert match, proc.stdout
    err, tol = float(match.group(1)), float(match.group(2))
    # float32 against float64: a real, small difference (a comparison with itself would give exactly 0)
    assert 0 < err <= tol, proc.stdout
    assert re.search(r"^time: \S+ ms, one run \(host clock", proc.stdout, re.M), proc.stdout


def _demo_in_the_interpreter(monkeypatch, capsys, *args: str) -> list[str]:
    """``pagedprefill demo --backend generic ARGS`` under ``TRITON_INTERPRET=1``, with each run computed by the
    reference instead (the interpreter's seconds a run are not what these tests look at)."""
    pytest.importorskip("pagedprefill_generic", reason="the generic backend is not installed (it runs Triton's "
                                                       "interpreter here)")
    import pagedprefill.api as api

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PAGEDPREFILL_BACKEND", raising=False)
    real = api.dispatch
    monkeypatch.setattr(api, "dispatch", lambda problem, backend=None, validate="basic":
                        real(problem, backend="reference", validate=validate))
    assert main(["demo", "--device", "cpu", "--backend", "generic", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_demo_in_the_interpreter_runs_once_by_default_and_says_so(monkeypatch, capsys):
    lines = _demo_in_the_interpreter(monkeypatch, capsys)
    assert "Triton's CPU interpreter runs the kernels, several seconds a run: a checked warm-up run, then 1 timed " \
           "run (the default under the interpreter: --repeats N for more)" in lines
    assert [line.split(":")[0] for line in lines if line.startswith(("warm-up run", "timed run"))] == \
        ["warm-up run", "timed run 1 of 1"]
    assert any(line.startswith("time: ") and ", one run " in line for line in lines), lines


def test_demo_in_the_interpreter_reports_each_run(monkeypatch, capsys):
    lines = _demo_in_the_interpreter(monkeypatch, capsys, "--repeats", "3")
    assert "Triton's CPU interpreter runs the kernels, several seconds a run: a checked warm-up run, then 3 timed " \
           "runs" in lines
    runs = [line for line in lines if line.startswith("timed run ")]
    assert [line.split(":")[0] for line in runs] == ["timed run 1 of 3", "timed run 2 of 3", "timed run 3 of 3"]
    assert all(re.fullmatch(r"timed run \d of 3: \d+\.\d s", line) for line in runs), runs


def test_demo_off_the_interpreter_keeps_five_quiet_runs(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDPREFILL_BACKEND", raising=False)
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Triton's CPU interpreter runs" not in out and "timed run" not in out
    assert re.search(r"^time: median \S+ ms over 5 runs", out, re.M), out


def test_info_says_what_triton_none_means():
    proc = run_cli("info", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    device_line = next(line for line in proc.stdout.splitlines() if line.startswith("device: "))
    assert "unavailable" not in device_line
    if importlib.util.find_spec("triton") is None:
        assert "triton=none (Triton is not installed)" in device_line
    else:
        assert "triton=none (Triton is installed but has no CPU driver; TRITON_INTERPRET=1 runs its interpreter)" \
            in device_line


def test_info_into_a_closed_pipe_ends_quietly(monkeypatch):
    """``pagedprefill info | head -1``: the reader stops early; the command ends without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has exited
    stdout = open(write_end, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert main(["info", "--device", "cpu"]) == 1
    finally:
        monkeypatch.undo()
        stdout.close()


def test_one_line_joins_a_list_of_reasons():
    message = "no backend can run on x.\nDiscovered backends:\n  - a: why a\n  - b: why b\nInstall one."
    assert one_line(message) == "no backend can run on x. Discovered backends: a: why a; b: why b; Install one."


def test_describe_says_why_triton_has_no_target(monkeypatch):
    """``triton=`` in ``info``, ``demo`` and error messages tells a missing Triton from a missing driver."""
    import pagedprefill.device as device_module
    from pagedprefill import DeviceInfo

    cpu = DeviceInfo(type="cpu", vendor="cpu", name="test cpu")
    other = DeviceInfo(type="xpu", vendor="testvendor", name="Test XPU", index=0)
    monkeypatch.setattr(device_module, "triton_installed", lambda: False)
    assert cpu.describe() == "test cpu (cpu), vendor=cpu, triton=none (Triton is not installed)"
    monkeypatch.setattr(device_module, "triton_installed", lambda: True)
    assert cpu.describe().endswith(
        ", triton=none (Triton is installed but has no CPU driver; TRITON_INTERPRET=1 runs its interpreter)")
    assert other.describe().endswith(", triton=none (Triton is installed but has no driver for xpu)")
    interpreted = DeviceInfo(type="cpu", vendor="cpu", name="test cpu", triton_backend="interpreter")
    assert interpreted.describe() == "test cpu (cpu), vendor=cpu, triton=interpreter"


HIDE_NUMPY = '''
import sys


class _HideNumpy:
    """Import hook: numpy is absent, as in an environment installed with `pip install --no-deps`."""

    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _HideNumpy())
'''


@pytest.fixture(scope="module")
def without_numpy(tmp_path_factory) -> dict:
    """An environment whose interpreters cannot import numpy (through a sitecustomize import hook)."""
    site = tmp_path_factory.mktemp("no_numpy")
    (site / "sitecustomize.py").write_text(HIDE_NUMPY)
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    probe = subprocess.run([sys.executable, "-c", "import numpy"], capture_output=True, text=True, env=env,
                           timeout=TIMEOUT)
    assert probe.returncode != 0 and "No module named 'numpy'" in probe.stderr, "numpy is not hidden"
    return env


@pytest.mark.parametrize("args", [["-c", "import pagedprefill"], ["-m", "pagedprefill", "info", "--device", "cpu"]],
                         ids=["import", "info"])
def test_no_numpy_warning_without_numpy(without_numpy, args):
    """Without numpy, importing pagedprefill and running the command print no NumPy warning, even with every
    UserWarning shown (the reference backend needs no numpy)."""
    control = subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", "import torch"],
                             capture_output=True, text=True, env=without_numpy, timeout=TIMEOUT)
    if "Failed to initialize NumPy" not in control.stderr:
        pytest.skip(f"torch {torch.__version__} does not warn when numpy is missing: nothing to silence")
    proc = subprocess.run([sys.executable, "-W", "always::UserWarning", *args], capture_output=True, text=True,
                          env=without_numpy, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NumPy" not in proc.stderr, proc.stderr


def test_host_overhead_alternates_rounds_and_reports_the_median():
    from pagedprefill.cli.bench import format_overhead, host_overhead

    result = host_overhead(torch.device("cpu"), "reference", "nhd", calls=14, rounds=7)
    assert result["calls"] == 14 and result["bare_launch_us"] is None  # the reference has no Triton launch
    cells = []
    for name in ("drop_in_us", "vllm_drop_in_us"):  # the classic signature and the serving engine's
        low, high = result["spread_us"][name]
        assert 0 < low <= result[name] <= high
        cells.append(f"{result[name]:.1f} ({low:.1f}-{high:.1f})")
    table = format_overhead([result])
    assert f"| reference | nhd | {cells[0]} | {cells[1]} | - |" in table


def test_info_shows_the_tile_and_head_packing_of_each_models_row():
    proc = run_cli("info", "--describe", "h200", "--suite", "models")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("tiles and kernels for the models suite" in line for line in lines)
    three = [line for line in lines if line.lstrip().startswith("Llama-3.2-3B TP1 24/8 D128 ")]
    assert len(three) == 3 and all(" engine " in line for line in three), three
    assert "[1 head x 128 tokens, 3 tiles per group]" in three[0]  # prefix-cached: a group of 3, one head per tile
    assert "[3 heads x 42 tokens]" in three[2]  # decode: the whole group in one tile


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_timing_commands_without_a_gpu_answer_in_the_common_form(command):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the commands run instead of refusing")
    line = assert_user_error(run_cli(command), command, "needs a GPU", "none is visible", "pagedprefill info")
    assert command != "bench" or "'pagedprefill bench --suite default --list'" in line
