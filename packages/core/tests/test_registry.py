"""The backend registry: discovery, priorities, overrides, broken plugins and error messages.

Two kinds of tests:

* in-process tests of :class:`pagedprefill.registry.Registry` with plugin objects passed to ``register()``;
* tests with real plugin packages (``tests/plugins/pagedprefill-dummy`` and ``tests/plugins/pagedprefill-broken``)
  installed with pip into a temporary directory once per session. They run in subprocesses with that
  directory on ``PYTHONPATH``, so the plugins reach pagedprefill through their entry points exactly as
  installed packages do, and the test process itself never sees them.

The ``dummy`` backend has priority 500 and supports only devices whose vendor is ``dummyvendor``; the
``broken`` plugin's entry-point module raises ImportError when imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pagedprefill
import pytest
from pagedprefill import Backend, BackendUnavailableError, DeviceInfo, hookimpl
from pagedprefill.registry import ENV_BACKEND, Registry

HERE = Path(__file__).resolve().parent
PLUGINS = HERE / "plugins"
REPO = HERE.parents[2]
TEMPLATE = REPO / "docs" / "backend-template"

GENERIC_INSTALLED = importlib.util.find_spec("pagedprefill_generic") is not None
SUBPROCESS_TIMEOUT = 120

#: Environment variables that change selection; removed from every subprocess's environment.
SELECTION_ENV = ("PAGEDPREFILL_BACKEND", "PAGEDPREFILL_VENDOR", "PAGEDPREFILL_LAZY_SELECT", "TRITON_INTERPRET")

DUMMY_REASON = "dummy runs only on dummyvendor devices"
BROKEN_ERROR = "ImportError: pagedprefill-broken needs libbrokenvendor.so, which is not installed"

CPU = DeviceInfo(type="cpu", vendor="cpu", name="test cpu")
GPU = DeviceInfo(type="cuda", vendor="testvendor", name="Test GPU", index=0, capability=(9, 0), num_sms=4,
                 max_shared_mem=64 * 1024, triton_backend="cuda")

# --------------------------------------------------------------------------------------------------------
# In-process tests: plugin objects registered with Registry.register()
# --------------------------------------------------------------------------------------------------------


class FakeBackend(Backend):
    """A backend that supports the devices whose vendor is in ``vendors``."""

    def __init__(self, name: str, priority: int, vendors=("testvendor",)) -> None:
        self.name = name
        self.priority = priority
        self.vendors = tuple(vendors)

    def supports(self, device: DeviceInfo) -> list[str]:
        if device.vendor in self.vendors:
            return []
        return [f"{self.name} needs vendor {'/'.join(self.vendors)}, got {device.vendor}"]

    def run(self, problem, device) -> None:
        raise AssertionError("not called by these tests")


class CrashingBackend(FakeBackend):
    def supports(self, device: DeviceInfo) -> list[str]:
        raise RuntimeError("driver query failed")


class Plugin:
    """A plugin object providing some backends through the hook."""

    def __init__(self, *backends: Backend) -> None:
        self._backends = list(backends)

    @hookimpl
    def pagedprefill_backends(self):
        return self._backends


def make_registry(*backends: Backend) -> Registry:
    registry = Registry(load_entry_points=False)
    for backend in backends:
        registry.register(Plugin(backend), name=f"plugin-{backend.name}")
    return registry


@pytest.fixture
def no_selection_env(monkeypatch):
    for name in SELECTION_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_backends_are_listed_by_priority_then_name():
    registry = make_registry(FakeBackend("low", 10), FakeBackend("zeta", 300), FakeBackend("alpha", 300),
                             FakeBackend("mid", 100))
    assert [b.name for b in registry.backends()] == ["alpha", "zeta", "mid", "low"]
    assert registry.get("mid").priority == 100


def test_one_plugin_may_provide_several_backends():
    registry = Registry(load_entry_points=False)
    registry.register(Plugin(FakeBackend("a", 1), FakeBackend("b", 2)))
    assert [b.name for b in registry.backends()] == ["b", "a"]


def test_highest_priority_supporting_backend_wins(no_selection_env):
    registry = make_registry(FakeBackend("everywhere", 1, vendors=("testvendor", "cpu")),
                             FakeBackend("gpu-only", 200), FakeBackend("other-gpu", 900, vendors=("othervendor",)))
    assert registry.select(GPU).name == "gpu-only"
    assert registry.select(CPU).name == "everywhere"


def test_register_invalidates_cached_choices(no_selection_env):
    registry = make_registry(FakeBackend("first", 100))
    assert registry.select(GPU).name == "first"
    registry.register(Plugin(FakeBackend("better", 200)), name="late")
    assert registry.select(GPU).name == "better"


def test_supports_that_raises_is_a_reason_not_a_crash(no_selection_env):
    registry = make_registry(CrashingBackend("crashy", 900), FakeBackend("fallback", 1))
    assert registry.select(GPU).name == "fallback"
    row = {r.name: r for r in registry.status(GPU)}["crashy"]
    assert not row.supported
    assert row.reasons == ("supports() raised RuntimeError: driver query failed",)


def test_explicit_choice_never_falls_back(no_selection_env):
    registry = make_registry(FakeBackend("gpu", 200), FakeBackend("any", 1, vendors=("testvendor", "cpu")))
    assert registry.select(CPU, backend="any").name == "any"
    with pytest.raises(BackendUnavailableError) as info:
        registry.select(CPU, backend="gpu")
    message = str(info.value)
    assert "'gpu' was requested but cannot run on" in message
    assert "gpu needs vendor testvendor, got cpu" in message
    # a Backend instance that was never registered is accepted on the same terms
    assert registry.select(GPU, backend=FakeBackend("unregistered", 0)).name == "unregistered"
    with pytest.raises(BackendUnavailableError, match="unregistered needs vendor testvendor, got cpu"):
        registry.select(CPU, backend=FakeBackend("unregistered", 0))


def test_unknown_name_lists_the_discovered_backends(no_selection_env):
    registry = make_registry(FakeBackend("a", 1), FakeBackend("b", 2))
    with pytest.raises(BackendUnavailableError) as info:
        registry.select(GPU, backend="nosuch")
    assert str(info.value) == "backend 'nosuch' was requested but is not installed; discovered backends: b, a"


def test_env_list_in_process(no_selection_env):
    registry = make_registry(FakeBackend("top", 500), FakeBackend("gpu", 200), FakeBackend("cpu-one", 1, ("cpu",)))
    no_selection_env.setenv(ENV_BACKEND, "cpu-one, gpu")
    assert registry.select(GPU).name == "gpu"  # the list's order, not priority; unsupported names skipped
    assert registry.select(CPU).name == "cpu-one"
    no_selection_env.setenv(ENV_BACKEND, "top")
    assert registry.select(GPU).name == "top"  # a changed variable is not answered from the cache
    with pytest.raises(BackendUnavailableError, match="top needs vendor testvendor, got cpu"):
        registry.select(CPU)


def test_empty_registry_explains_how_to_get_a_backend(no_selection_env):
    registry = Registry(load_entry_points=False)
    assert registry.backends() == []
    assert registry.load_errors == {}
    with pytest.raises(BackendUnavailableError) as info:
        registry.select(GPU)
    message = str(info.value)
    assert message.startswith(f"no pagedprefill backend can run on {GPU.describe()}.")
    assert "Discovered backends:\n  (none)" in message
    assert "backend=..." in message and f"{ENV_BACKEND}=name[,name...]" in message


def test_builtin_reference_is_registered_by_get_registry():
    registry = pagedprefill.get_registry()
    reference = registry.get("reference")
    assert reference.priority == 0
    assert reference.supports(CPU) == [] and reference.supports(GPU) == []


def test_plugin_whose_hook_raises_is_recorded_not_fatal(no_selection_env):
    class FailingPlugin:
        @hookimpl
        def pagedprefill_backends(self):
            raise ImportError("the backend module needs a missing runtime")

    registry = make_registry(FakeBackend("good", 100))
    registry.register(FailingPlugin(), name="failing")
    assert [b.name for b in registry.backends()] == ["good"]
    assert "the backend module needs a missing runtime" in registry.load_errors["failing"]


# --------------------------------------------------------------------------------------------------------
# Real plugin packages, installed with pip, exercised in subprocesses
# --------------------------------------------------------------------------------------------------------


def pip_install(packages: list[Path], target: Path, scratch: Path) -> None:
    """Install local package directories into ``target`` (copied first, so builds leave no files here)."""
    sources = []
    for package in packages:
        copy = scratch / package.name
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(str(copy))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target", str(target), *sources]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="session")
def pip_available() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"pip is not available to {sys.executable}, so the plugin packages cannot be installed: "
                    f"{proc.stderr.strip()}")
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail(f"setuptools is not installed for {sys.executable}: the test plugin packages are built with it "
                    "(offline, without build isolation); install it with `python -m pip install setuptools`")


@pytest.fixture(scope="session")
def dummy_site(pip_available, tmp_path_factory) -> Path:
    """A directory holding the installed ``pagedprefill-dummy`` package (and nothing else)."""
    target = tmp_path_factory.mktemp("site-dummy")
    pip_install([PLUGINS / "pagedprefill-dummy"], target, tmp_path_factory.mktemp("src-dummy"))
    return target


@pytest.fixture(scope="session")
def plugins_site(pip_available, tmp_path_factory) -> Path:
    """A directory holding the installed ``pagedprefill-dummy`` and ``pagedprefill-broken`` packages."""
    target = tmp_path_factory.mktemp("site-plugins")
    pip_install([PLUGINS / "pagedprefill-dummy", PLUGINS / "pagedprefill-broken"], target,
                tmp_path_factory.mktemp("src-plugins"))
    return target


def subprocess_env(site: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                        else []))
    env["CUDA_VISIBLE_DEVICES"] = ""  # selection is tested on described devices; keep the import device the CPU
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


PRELUDE = '''
import json, os, sys
import pagedprefill as pp
from pagedprefill import BackendUnavailableError, DeviceInfo

DUMMY = DeviceInfo(type="cuda", vendor="dummyvendor", name="Dummy X1", index=0, capability=(9, 0), warp_size=32,
                   num_sms=8, max_shared_mem=96 * 1024, triton_backend="cuda")
CPU = DeviceInfo(type="cpu", vendor="cpu", name="test cpu")

def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None

def choose(device, backend=None, env=None):
    if env is None:
        os.environ.pop("PAGEDPREFILL_BACKEND", None)
    else:
        os.environ["PAGEDPREFILL_BACKEND"] = env
    try:
        return pp.select_backend(device, backend=backend).name
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        os.environ.pop("PAGEDPREFILL_BACKEND", None)

def emit(result):
    print("RESULT:" + json.dumps(result))
'''


def run_python(site: Path, body: str, **env: str) -> dict:
    """Run ``PRELUDE + body`` in a fresh interpreter with ``site`` on PYTHONPATH; return what it emitted."""
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(site, **env),
                          cwd=str(site), timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert len(lines) == 1, f"expected one RESULT line:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT:"):])


@pytest.fixture(scope="module")
def dummy_facts(dummy_site) -> dict:
    """Discovery and selection as seen by a process where the dummy plugin is installed."""
    return run_python(dummy_site, '''
        import importlib.metadata as md
        import torch
        from pagedprefill.testing import BatchSpec, fresh_output, make_problem

        registry = pp.get_registry()
        dummy = registry.get("dummy")
        result = {
            "entry_points": sorted(f"{ep.name}={ep.value}" for ep in md.entry_points(group=pp.ENTRY_POINT_GROUP)),
            "backends": [[b.name, b.priority, type(b).__module__] for b in pp.available_backends()],
            "load_errors": registry.load_errors,
            "import_selection": pp.import_selection().name,
            "status_dummy_device": {r.name: [r.supported, list(r.reasons)] for r in registry.status(DUMMY)},
            "status_cpu": {r.name: [r.supported, list(r.reasons)] for r in registry.status(CPU)},
            "auto": {"dummy": choose(DUMMY), "cpu": choose(CPU)},
        }
        result["env"] = {
            "dummy,reference @ cpu": choose(CPU, env="dummy,reference"),
            "dummy,reference @ dummy": choose(DUMMY, env="dummy,reference"),
            "reference,dummy @ dummy": choose(DUMMY, env="reference,dummy"),
            " nosuch , reference @ cpu": choose(CPU, env=" nosuch , reference"),
            "dummy @ cpu": choose(CPU, env="dummy"),
            "generic,dummy @ cpu": choose(CPU, env="generic,dummy"),
            "nosuch @ dummy": choose(DUMMY, env="nosuch"),
        }
        result["per_call"] = {
            "dummy @ dummy": choose(DUMMY, backend="dummy"),
            "reference @ dummy": choose(DUMMY, backend="reference"),
            "dummy @ cpu": choose(CPU, backend="dummy"),
            "dummy @ dummy, env=reference": choose(DUMMY, backend="dummy", env="reference"),
            "reference @ cpu, env=dummy": choose(CPU, backend="reference", env="dummy"),
            "instance @ cpu": choose(CPU, backend=dummy),
        }

        # the real call path: CPU tensors, so an explicit backend="dummy" must fail and "reference" must work
        spec = BatchSpec(query_lens=(3, 5), context_lens=(4, 0), dtype=torch.float32)
        problem = make_problem(spec, "cpu")
        expected = pp.reference_prefill(fresh_output(problem))
        call = lambda backend: pp.prefill_attention(problem.q, problem.k, problem.v, problem.cache, problem.batch,
                                                     out=torch.empty_like(problem.q), backend=backend)
        result["prefill_attention"] = {
            "dummy": error_of(call, "dummy"),
            "reference_matches": bool(torch.equal(call("reference"), expected)),
            "default_matches": bool(torch.equal(call(None), expected)),
        }
        # the dummy backend itself computes correct results on its own device description
        out_problem = fresh_output(problem)
        dummy.check_problem(out_problem, DUMMY)
        dummy.run(out_problem, DUMMY)
        fp8 = make_problem(spec.replace(kv_cache_dtype="fp8_e4m3"), "cpu")
        result["dummy_run"] = {
            "calls": dummy.calls,
            "matches_reference": bool(torch.equal(out_problem.out, expected)),
            "fp8_check": error_of(dummy.check_problem, fp8, DUMMY),
        }
        emit(result)
    ''')


def names(facts: dict) -> list[str]:
    return [name for name, _, _ in facts["backends"]]


def test_discovery_through_the_entry_point(dummy_facts):
    assert "dummy=pagedprefill_dummy.plugin" in dummy_facts["entry_points"]
    backends = {name: (priority, module) for name, priority, module in dummy_facts["backends"]}
    assert backends["dummy"] == (500, "pagedprefill_dummy.backend")
    assert backends["reference"] == (0, "pagedprefill.backends.reference")
    assert dummy_facts["load_errors"] == {}


def test_available_backends_in_priority_order(dummy_facts):
    listed = names(dummy_facts)
    priorities = [priority for _, priority, _ in dummy_facts["backends"]]
    assert priorities == sorted(priorities, reverse=True)
    expected = ["dummy", "generic", "reference"] if GENERIC_INSTALLED else ["dummy", "reference"]
    assert [name for name in listed if name in expected] == expected
    assert listed[0] == "dummy" and listed[-1] == "reference"


def test_priority_picks_dummy_on_its_device(dummy_facts):
    status = dummy_facts["status_dummy_device"]
    assert status["dummy"] == [True, []]
    assert status["reference"] == [True, []]  # the reference supports the device too: priority decides
    assert dummy_facts["auto"]["dummy"] == "dummy"


def test_cpu_device_selects_something_else(dummy_facts):
    status = dummy_facts["status_cpu"]
    assert status["dummy"][0] is False
    assert status["dummy"][1] == [f"{DUMMY_REASON}, not on vendor 'cpu' (test cpu)"]
    if GENERIC_INSTALLED:
        assert status["generic"][0] is False  # TRITON_INTERPRET is unset in the subprocess
    assert dummy_facts["auto"]["cpu"] == "reference"
    assert dummy_facts["import_selection"] == "reference"  # chosen at import, on the (CPU-only) process


def test_env_override_is_an_ordered_list(dummy_facts):
    env = dummy_facts["env"]
    assert env["dummy,reference @ cpu"] == "reference"  # first supported wins
    assert env["dummy,reference @ dummy"] == "dummy"
    assert env["reference,dummy @ dummy"] == "reference"  # the list's order beats priority
    assert env[" nosuch , reference @ cpu"] == "reference"  # spaces and an uninstalled name are tolerated


def test_env_override_with_nothing_supported_fails_loudly(dummy_facts):
    error = dummy_facts["env"]["dummy @ cpu"]
    assert error["type"] == "BackendUnavailableError"  # never a silent fall-back to the reference
    assert error["message"].startswith("PAGEDPREFILL_BACKEND='dummy' names no backend that can run on test cpu")
    assert f"  - dummy: {DUMMY_REASON}" in error["message"]
    assert "(unset PAGEDPREFILL_BACKEND to choose automatically):\n" in error["message"]

    error = dummy_facts["env"]["generic,dummy @ cpu"]
    assert error["type"] == "BackendUnavailableError"
    lines = error["message"].splitlines()
    assert lines[1].startswith("  - generic: ") and len(lines[1]) > len("  - generic: ")
    assert lines[2].startswith(f"  - dummy: {DUMMY_REASON}")
    assert lines[-1] == lines[2], "the reasons end the message"

    error = dummy_facts["env"]["nosuch @ dummy"]
    assert error["type"] == "BackendUnavailableError"
    assert "  - nosuch: backend 'nosuch' was requested but is not installed; discovered backends: dummy" \
        in error["message"]


def test_backend_argument_per_call(dummy_facts):
    per_call = dummy_facts["per_call"]
    assert per_call["dummy @ dummy"] == "dummy"
    assert per_call["reference @ dummy"] == "reference"  # an explicit choice beats priority
    assert per_call["dummy @ dummy, env=reference"] == "dummy"  # and beats the environment variable
    assert per_call["reference @ cpu, env=dummy"] == "reference"
    for key in ("dummy @ cpu", "instance @ cpu"):
        error = per_call[key]
        assert error["type"] == "BackendUnavailableError", key
        assert error["message"] == (f"backend 'dummy' was requested but cannot run on {CPU.describe()}: "
                                    f"{DUMMY_REASON}, not on vendor 'cpu' (test cpu)"), key


def test_backend_argument_through_prefill_attention(dummy_facts):
    calls = dummy_facts["prefill_attention"]
    assert calls["dummy"]["type"] == "BackendUnavailableError"
    assert DUMMY_REASON in calls["dummy"]["message"]
    assert calls["reference_matches"] is True
    assert calls["default_matches"] is True


def test_dummy_backend_computes_with_the_reference(dummy_facts):
    run = dummy_facts["dummy_run"]
    assert run["calls"] == 1
    assert run["matches_reference"] is True
    assert run["fp8_check"]["type"] == "UnsupportedFeatureError"
    assert "has no FP8 cache support" in run["fp8_check"]["message"]


@pytest.fixture(scope="module")
def broken_facts(plugins_site) -> dict:
    """A process with the dummy and broken plugins installed, started with PAGEDPREFILL_BACKEND=broken."""
    return run_python(plugins_site, '''
        import importlib.metadata as md
        from pagedprefill.registry import Registry

        result = {
            "imported": True,
            "import_selection": pp.import_selection(),
            "first_call": error_of(pp.select_backend),
            "entry_points": sorted(ep.name for ep in md.entry_points(group=pp.ENTRY_POINT_GROUP)),
        }
        os.environ.pop("PAGEDPREFILL_BACKEND")
        registry = pp.get_registry()
        result["load_errors"] = registry.load_errors
        result["backends"] = [b.name for b in pp.available_backends()]
        result["status_cpu"] = {r.name: [r.supported, list(r.reasons)] for r in registry.status(CPU)}
        result["get"] = error_of(registry.get, "broken")
        result["per_call"] = choose(CPU, backend="broken")
        result["env_broken_then_reference"] = choose(CPU, env="broken,reference")
        result["auto"] = {"cpu": choose(CPU), "dummy": choose(DUMMY)}
        # no built-in reference: the plugins alone, on a CPU where none of them runs
        result["no_backend"] = error_of(Registry(builtins=()).select, CPU)
        result["no_backend_names"] = [b.name for b in Registry(builtins=()).backends()]
        result["no_backend_dummy"] = Registry(builtins=()).select(DUMMY).name
        emit(result)
    ''', PAGEDPREFILL_BACKEND="broken")


def test_broken_plugin_does_not_break_import(broken_facts):
    assert broken_facts["imported"] is True
    assert "broken" in broken_facts["entry_points"]
    # the import-time choice (PAGEDPREFILL_BACKEND=broken) failed quietly; the first call explains
    assert broken_facts["import_selection"] is None
    assert broken_facts["first_call"]["type"] == "BackendUnavailableError"
    assert BROKEN_ERROR in broken_facts["first_call"]["message"]


def test_broken_plugin_is_recorded_with_its_error(broken_facts):
    assert broken_facts["load_errors"] == {"broken": BROKEN_ERROR}
    assert "broken" not in broken_facts["backends"]
    assert [n for n in broken_facts["backends"] if n in ("dummy", "reference")] == ["dummy", "reference"]
    assert broken_facts["status_cpu"]["broken"] == [False, [f"plugin failed to load: {BROKEN_ERROR}"]]
    assert broken_facts["auto"] == {"cpu": "reference", "dummy": "dummy"}


def test_asking_for_a_broken_plugin_raises_its_load_error(broken_facts):
    expected = f"backend 'broken' was requested but its plugin failed to load: {BROKEN_ERROR}"
    assert broken_facts["get"] == {"type": "BackendUnavailableError", "message": expected}
    assert broken_facts["per_call"] == {"type": "BackendUnavailableError", "message": expected}
    assert broken_facts["env_broken_then_reference"] == "reference"


def test_no_backend_message_lists_every_backend_and_how_to_override(broken_facts):
    error = broken_facts["no_backend"]
    assert error["type"] == "BackendUnavailableError"
    lines = error["message"].splitlines()
    assert lines[0] == f"no pagedprefill backend can run on {CPU.describe()}."
    assert lines[1] == "Discovered backends:"
    rows = {line.split()[1]: line for line in lines if line.startswith("  - ")}
    discovered = broken_facts["no_backend_names"]
    assert "dummy" in discovered and "reference" not in discovered  # no builtins: the plugins alone
    assert set(rows) == set(discovered) | {"broken"}  # every backend, and the plugin that failed to load
    assert all(not row.endswith(": supported") for row in rows.values())
    assert rows["dummy"] == f"  - dummy (priority 500): {DUMMY_REASON}, not on vendor 'cpu' (test cpu)"
    assert rows["broken"].endswith(f"plugin failed to load: {BROKEN_ERROR}")
    if GENERIC_INSTALLED:
        assert rows["generic"].startswith("  - generic (priority 100): ") and "supported" not in rows["generic"]
    assert "backend=..." in lines[-1] and "PAGEDPREFILL_BACKEND=name[,name...]" in lines[-1]
    # the backends are not on any package index: the message points to the repository's folders
    assert "from the repository's packages/ folder" in lines[-1] and "./packages/backend-generic" in lines[-1]
    assert "pagedprefill-sm80" not in error["message"]
    assert broken_facts["no_backend_dummy"] == "dummy"


def test_info_command_reports_backends_reasons_and_load_errors(plugins_site):
    proc = subprocess.run([sys.executable, "-m", "pagedprefill", "info"], capture_output=True, text=True,
                          env=subprocess_env(plugins_site), cwd=str(plugins_site), timeout=SUBPROCESS_TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`python -m pagedprefill info` failed ({proc.returncode}):\n{output}"
    for name in ("dummy", "reference", "broken"):
        assert name in proc.stdout, f"{name!r} missing from `pagedprefill info`:\n{output}"
    assert DUMMY_REASON in proc.stdout, output  # the dummy backend's reason on this CPU-only process
    assert BROKEN_ERROR in proc.stdout, output
    if GENERIC_INSTALLED:
        assert "generic" in proc.stdout, output


def test_registering_plugins_does_not_import_triton(plugins_site):
    facts = run_python(plugins_site, '''
        import importlib
        import pagedprefill_dummy.plugin
        heavy = lambda: sorted(m for m in sys.modules
                               if m == "triton" or m.startswith("triton.") or m.startswith("pagedprefill.triton"))
        hooks = {"dummy": [b.name for b in pagedprefill_dummy.plugin.pagedprefill_backends()]}
        if importlib.util.find_spec("pagedprefill_generic") is not None:
            import pagedprefill_generic.plugin
            hooks["generic"] = [b.name for b in pagedprefill_generic.plugin.pagedprefill_backends()]
        pp.get_registry().backends()
        pp.reset_registry()
        fresh = pp.get_registry()
        rows = {r.name: r.supported for r in fresh.status(DUMMY) + fresh.status(CPU)}
        emit({"hooks": hooks, "rows": sorted(rows), "chosen": [choose(DUMMY), choose(CPU)],
              "triton_installed": importlib.util.find_spec("triton") is not None, "heavy": heavy()})
    ''')
    assert facts["hooks"]["dummy"] == ["dummy"]
    if GENERIC_INSTALLED:
        assert facts["hooks"]["generic"] == ["generic"]
    assert {"dummy", "reference", "broken"} <= set(facts["rows"])
    assert facts["chosen"] == ["dummy", "reference"]
    # importing pagedprefill, loading every plugin, asking supports() and selecting imported no Triton
    assert facts["heavy"] == [], f"Triton modules imported while registering: {facts['heavy']}"
    if not facts["triton_installed"]:
        print("Triton is not installed here, so this check cannot tell a lazy import from a missing one")


# --------------------------------------------------------------------------------------------------------
# The documented backend template (docs/backend-template) installs and registers
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def template_site(pip_available, tmp_path_factory) -> Path:
    if not TEMPLATE.is_dir():
        pytest.skip(f"no backend template at {TEMPLATE} (this checkout does not include docs/)")
    target = tmp_path_factory.mktemp("site-template")
    pip_install([TEMPLATE], target, tmp_path_factory.mktemp("src-template"))
    return target


def test_backend_template_installs_and_never_hijacks_selection(template_site):
    facts = run_python(template_site, '''
        import dataclasses
        import importlib.metadata as md
        import torch
        from pagedprefill.tiling import ProblemShape, TileConfig
        import pagedprefill_mybackend
        from pagedprefill_mybackend.backend import VENDOR

        registry = pp.get_registry()
        backend = registry.get("mybackend")
        nvidia = DeviceInfo(type="cuda", vendor="nvidia", name="NVIDIA H200", index=0, capability=(9, 0),
                            num_sms=132, max_shared_mem=227 * 1024, triton_backend="cuda")
        interp_cpu = dataclasses.replace(CPU, triton_backend="interpreter")
        own = DeviceInfo(type="xpu", vendor=VENDOR, name="My Accelerator", index=0, warp_size=64, num_sms=64,
                         max_shared_mem=64 * 1024, triton_backend="xpu")
        os.environ["TRITON_INTERPRET"] = "1"
        interp_reasons = backend.supports(interp_cpu)
        del os.environ["TRITON_INTERPRET"]
        tiles = []
        for head_size in (1, 64, 96, 128, 256):
            for dtype in (torch.float16, torch.float32):
                for num_tokens in (4, 4096):
                    shape = ProblemShape(head_size=head_size, num_heads=8, num_kv_heads=2, dtype=dtype,
                                         num_tokens=num_tokens, num_seqs=4)
                    tile = backend.tile_config(shape, own)
                    tiles.append([isinstance(tile, TileConfig) and isinstance(backend.tile_config(shape, CPU),
                                                                              TileConfig),
                                  tile.shared_mem_bytes(head_size, shape.element_size) <= own.max_shared_mem])
        emit({
            "entry_points": sorted(f"{ep.name}={ep.value}" for ep in md.entry_points(group=pp.ENTRY_POINT_GROUP)),
            "priority": backend.priority,
            "placeholder_vendor": VENDOR,
            "description": backend.description,
            "reasons": {"nvidia": backend.supports(nvidia), "cpu": backend.supports(CPU),
                        "interpreter cpu": interp_reasons, "own": backend.supports(own)},
            "chosen": {"nvidia": choose(nvidia), "cpu": choose(CPU), "own": choose(own)},
            "tiles_ok": all(ok and fits for ok, fits in tiles),
            "exports": sorted(pagedprefill_mybackend.__all__),
            "triton_imported": "triton" in sys.modules,
        })
    ''')
    detected = run_python(template_site, '''
        from pagedprefill.testing.described import described_device
        from pagedprefill_mybackend.detect import DEVICE_TYPE, NAME_PREFIX

        with described_device(DEVICE_TYPE, name=f"{NAME_PREFIX} 1"):
            own = DeviceInfo.detect(f"{DEVICE_TYPE}:0").vendor
        with described_device(DEVICE_TYPE, name="Another accelerator"):
            other = DeviceInfo.detect(f"{DEVICE_TYPE}:0").vendor
        emit({"type": DEVICE_TYPE, "own": own, "other": other})
    ''')
    assert detected["type"] != "cuda"  # the template shows a device type of its own
    assert detected["own"] == "myvendor" and detected["other"] == detected["type"]
    assert "mybackend=pagedprefill_mybackend.plugin" in facts["entry_points"]
    assert facts["priority"] == 150
    assert facts["placeholder_vendor"] == "myvendor"
    # the description follows VENDOR, so a renamed backend does not keep the template's
    assert facts["description"] == "Triton kernels tuned for myvendor accelerators"
    for device in ("nvidia", "cpu", "interpreter cpu"):
        assert facts["reasons"][device], f"the template backend accepted the {device} device"
        assert "myvendor" in facts["reasons"][device][0]
    assert facts["reasons"]["own"] == []
    assert facts["chosen"]["own"] == "mybackend"
    assert facts["chosen"]["nvidia"] != "mybackend" and facts["chosen"]["cpu"] == "reference"
    assert facts["tiles_ok"] is True
    assert facts["triton_imported"] is False
    assert {"MyBackend", "my_policy"} <= set(facts["exports"])


# --------------------------------------------------------------------------------------------------------
# A backend for a device type other than cuda, added by its package alone (tests/plugins/pagedprefill-example)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def example_site(pip_available, tmp_path_factory) -> Path:
    """A directory holding the installed ``pagedprefill-example`` package (and nothing else)."""
    target = tmp_path_factory.mktemp("site-example")
    pip_install([PLUGINS / "pagedprefill-example"], target, tmp_path_factory.mktemp("src-example"))
    return target


@pytest.fixture(scope="module")
def example_facts(example_site) -> dict:
    """Discovery, detection, selection and a run of the ``example`` backend on a described Example X1."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the example backend's kernels cannot run, nor its device be described")
    return run_python(example_site, '''
        import contextlib, dataclasses, io
        import torch
        from pagedprefill import cli
        from pagedprefill.backends.triton_base import problem_shape
        from pagedprefill.testing import BatchSpec, fresh_output, make_problem
        from pagedprefill.testing.described import described_device

        # Triton reads TRITON_INTERPRET for its own library when it is first imported, so it is imported with
        # the variable set; detection and selection then run without it, as on a machine with the device.
        import triton  # noqa: F401
        os.environ.pop("TRITON_INTERPRET")
        result = {"backends": [b.name for b in pp.available_backends()]}
        # torch and Triton report an xpu device named "Example X1"; neither reports its shared memory
        with described_device("xpu", name="Example X1", capability=(1, 0), num_sms=32, triton_backend="xpu"):
            info = DeviceInfo.detect("xpu:0")
            result["status"] = {r.name: [r.supported, list(r.reasons)] for r in pp.get_registry().status(info)}
            result["chosen"] = pp.select_backend(info).name
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                result["info_rc"] = cli.main(["info", "--device", "xpu:0"])
            result["info_cli"] = out.getvalue()
        result["detected"] = dataclasses.asdict(info)
        with described_device("xpu", name="Another XPU", num_sms=64, triton_backend="xpu", max_shared_mem=128 * 1024,
                              warp_size=32):
            other = DeviceInfo.detect("xpu:0")
            result["other"] = [other.vendor, pp.select_backend(other).name]

        # Run: the chosen backend, with the tile its policy picks for the Example X1, runs its kernels in
        # Triton's interpreter on CPU tensors, and is compared with the reference.
        os.environ["TRITON_INTERPRET"] = "1"
        backend = pp.get_registry().get(result["chosen"])
        spec = BatchSpec(query_lens=(17, 1, 40), context_lens=(33, 64, 0), num_heads=4, num_kv_heads=2, head_size=64,
                         block_size=16, dtype=torch.float32, seed=0)
        problem = make_problem(spec, torch.device("cpu"))
        backend.check_problem(problem, info)
        backend.run(problem, info)
        expect = pp.reference_prefill(fresh_output(problem))
        result["tile"] = backend.tile_config(problem_shape(problem), info).to_dict()
        result["max_abs_err"] = float((problem.out - expect).abs().max())
        emit(result)
    ''', TRITON_INTERPRET="1")


def test_example_backend_is_discovered_detected_and_selected(example_facts):
    assert "example" in example_facts["backends"]
    detected = example_facts["detected"]
    # core's view (type, name, capability, SMs, Triton's target) refined by the example package's hook
    assert detected == {"type": "xpu", "index": 0, "vendor": "examplevendor", "name": "Example X1",
                        "capability": [1, 0], "warp_size": 16, "num_sms": 32, "max_shared_mem": 64 * 1024,
                        "triton_backend": "xpu"}
    assert example_facts["chosen"] == "example"
    assert example_facts["status"]["example"] == [True, []]
    if GENERIC_INSTALLED:  # generic also runs on any Triton device; the example wins by priority
        assert example_facts["status"]["generic"] == [True, []]


def test_example_backend_shows_in_info_for_its_device(example_facts):
    out = example_facts["info_cli"]
    assert example_facts["info_rc"] == 0, out
    assert "device: Example X1 (xpu:0), vendor=examplevendor" in out and "triton=xpu" in out
    assert "choice: example (priority 200)" in out


def test_example_backend_leaves_other_xpu_devices_alone(example_facts):
    vendor, chosen = example_facts["other"]
    assert vendor == "xpu"  # nobody recognised it: core's general view
    assert chosen == ("generic" if GENERIC_INSTALLED else "reference")


def test_example_backend_runs_its_tile_in_the_interpreter(example_facts):
    assert example_facts["tile"]["block_m"] == 32 and example_facts["tile"]["heads_per_tile"] == 2
    assert example_facts["max_abs_err"] < 1e-4


def test_missing_triton_reason_points_to_the_repository(monkeypatch):
    """A Triton backend without Triton says how to install it without a package index knowing pagedprefill."""
    import pagedprefill.backends.triton_base as triton_base

    monkeypatch.setattr(triton_base, "triton_installed", lambda: False)
    reasons = triton_base.TritonBackend().supports(CPU)
    assert reasons == ['Triton is not installed (pip install triton, or pip install "./packages/core[triton]" '
                       'from the repository)']


def test_the_backend_contract_declares_every_question_with_its_default():
    """What core asks a backend about is declared on ``Backend``, so a plugin that says nothing gets the
    documented answer: no optional feature, no host reads of the metadata, nothing to tune, no tile."""
    import ast

    import torch
    from pagedprefill.tiling import ProblemShape

    plain = type("Plain", (Backend,), {"name": "plain"})()
    shape = ProblemShape(head_size=64, num_heads=4, num_kv_heads=2, dtype=torch.float16)
    assert plain.supported_features == frozenset()
    assert plain.reads_metadata_on_host is False
    assert plain.search_space(shape, CPU) == []
    assert plain.tile_config(shape, CPU) is None
    # core finds none of them by introspection: no getattr/hasattr on a backend anywhere in the package
    root = Path(pagedprefill.__file__).parent
    asked = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("backend", "chosen", "b"):
                asked.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not asked, f"a backend asked by introspection at {asked}; declare the attribute on Backend"
