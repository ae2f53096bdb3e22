"""`mindspeed_tft.patches` is the whole truth about what mindspeed-tft changes in third-party code.

What this file proves, against each pinned version (torch 2.13; Megatron-LM core_v0.12.1 and
core_v0.16.1, each with its `megatron.core`, `megatron.training` and `megatron.legacy`, first
on the path), checking at each version the patches that claim it (`patches.applicable`):

- every target of every moment of `TABLE` that applies there exists (`patches.resolve` finds
  it), and the pinned versions are the ones imported;
- each moment's installer, run on its own in a fresh process, replaces every target it
  declares and nothing else: no other attribute of the modules and classes those targets
  live in changes, nor any attribute of any other loaded torch / megatron module or of the
  classes defined there (submodules imported on the way and the package's own
  ``_mindspeed_tft*`` markers aside); a second `install` returns False and changes nothing;
- `install` refuses unknown and scoped moments, `swapped` puts the original back (also after
  an exception) and refuses a target the table does not declare as scoped;
- importing every module of the package (but the two adaptors whose import *is* a moment, and
  `python -m mindspeed_tft.megatron`) patches nothing: every target keeps its identity and no
  moment is installed.

Patches are only ever installed in subprocesses (they would leak into other tests): one
subprocess per version imports the third-party modules once and forks a fresh child per
check (see `_PROBE`); the whole file takes a few seconds of CPU per version.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mindspeed_tft import patches
from tests.clones import VERSIONS, clone

REPO = Path(__file__).resolve().parents[1]
INSTALLED_MOMENTS = [m.name for m in patches.TABLE if m.installer is not None]
_RESULT = "PATCH-PROBE-RESULT "
Probe = dict[str, dict[str, Any]]  # check name -> its result

# The program the subprocess runs (`-c _PROBE OUT_DIR`): it imports torch and every module a
# target lives in (Megatron-LM's included) and nothing of mindspeed_tft but `patches`, then
# forks one child per check, so that each starts from that unpatched state without paying the
# imports again (seconds each on a 2-core machine). A child runs one check (installs one
# moment, or imports the package) and writes its result to OUT_DIR/NAME.json; the parent
# prints them all on one line, _RESULT + JSON, and the tests judge them.
_PROBE = r'''
import importlib, json, os, pathlib, pkgutil, sys, traceback, types

from mindspeed_tft import patches

ROOTS = ("torch", "megatron")
MARKER = "_mindspeed_tft"  # the package's own markers (e.g. torchrun's "hooked" flag)


def eager(model=None, **_):
    return model if model is not None else (lambda fn: fn)


def applicable(name):
    """The targets of moment `name` that apply to the megatron-core on the path."""
    from megatron.core.package_info import __version__
    from packaging.version import Version

    return [p.target for p in patches.applicable(name, Version(__version__))]


def all_applicable():
    return [t for m in patches.TABLE for t in applicable(m.name)]


def import_target_modules(targets):
    """Import the modules of `targets`, megatron-core's fused helpers eager (as on CPU the
    package's own `import_megatron_core` does; torch.compile would cost seconds)."""
    with patches.swapped("torch:compile", eager):
        for target in targets:
            try:
                importlib.import_module(target.partition(":")[0])
            except Exception:
                pass  # reported by resolve_all


def resolve_all(targets):
    values, missing = {}, []
    for target in targets:
        try:
            owner, attr, value = patches.resolve(target)
        except Exception as exc:
            missing.append(f"{target} ({type(exc).__name__}: {exc})")
        else:
            values[target] = (owner, attr, value)
    return values, missing


def snapshot(extra_owners=()):
    """{id: (label, object, copy of its namespace)} of every loaded torch / megatron module,
    every class defined in one, and `extra_owners`."""
    objects = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in ROOTS:
            continue
        objects[id(module)] = (name, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                objects.setdefault(id(value), (f"{name}:{value.__qualname__}", value))
    for label, owner in extra_owners:
        objects.setdefault(id(owner), (label, owner))
    return {key: (label, obj, dict(vars(obj))) for key, (label, obj) in objects.items()}


def changes(before):
    """[(owner id, label, attribute, how)] since `before`."""
    found = []
    for key, (label, obj, old) in before.items():
        new = vars(obj)
        for attr, value in old.items():
            if attr not in new:
                found.append((key, label, attr, "removed"))
            elif new[attr] is not value:
                found.append((key, label, attr, "replaced"))
        for attr in new.keys() - old.keys():
            if isinstance(new[attr], types.ModuleType) or attr.startswith(MARKER):
                continue  # a submodule imported on the way / a marker that shadows nothing
            found.append((key, label, attr, "added"))
    return found


def owner_label(target):
    module, _, name = target.partition(":")
    path = name.rpartition(".")[0]
    return f"{module}:{path}" if path else module


def probe_install(name, absent_before=False):
    # Every installer runs standalone, no other moment first. Preconditions: "megatron-lm" and
    # "megatron-lm-cpu" import megatron.training (Megatron-LM on PYTHONPATH); "cpu" changes
    # nothing where CUDA is available (the test hides it); "torch-adam" nothing with Apex/TE.
    # "stand-ins" runs in the parent before the other targets are imported (Megatron-LM
    # core_v0.16.1 cannot import without them where Triton is absent): its targets do not
    # resolve before it (`absent_before`), and the checks after it do not count it. Where no
    # row of a moment fits this megatron-core (no target), its installer must change nothing.
    targets = applicable(name)
    if name == "torch-adam":
        from megatron.core.optimizer import distrib_optimizer

        if distrib_optimizer.HAVE_APEX_OR_TE:
            return {"skip": "Apex or Transformer Engine is installed: megatron-core does not "
                            "fall back to torch's Adam, the installer rightly does nothing"}
    values, missing = resolve_all(targets)
    if absent_before:
        if values:
            return {"skip": f"{sorted(values)} import here: nothing to stand in for"}
        values = {t: (importlib.import_module(t.partition(":")[0]), t.partition(":")[2], None)
                  for t in targets}
    elif missing:
        return {"error": f"unresolved targets: {missing}"}
    owners = {id(o): (owner_label(t), o) for t, (o, _, _) in values.items()}
    declared = {(id(o), attr) for o, attr, _ in values.values()}
    before = snapshot(owners.values())
    first = patches.install(name)
    after_values, _ = resolve_all(targets)
    unchanged = [t for t in targets if t not in after_values
                 or after_values[t][2] is values[t][2]]
    undeclared = [f"{label}.{attr} ({how})" for key, label, attr, how in changes(before)
                  if (key, attr) not in declared]
    in_owners = [f"{label}.{attr} ({how})" for key, label, attr, how in changes(before)
                 if key in owners and (key, attr) not in declared]
    again_before = snapshot(owners.values())
    second = patches.install(name)
    again = [f"{label}.{attr} ({how})" for _, label, attr, how in changes(again_before)]
    return {"first": first, "second": second, "installed": installed_here(name),
            "unchanged": unchanged, "undeclared": undeclared, "undeclared_in_owners": in_owners,
            "changed_by_second": again, "owners": sorted(v[0] for v in owners.values()),
            "scanned": len(before)}


def package_modules(path, prefix):
    """Every module under `path` (pkgutil, plus the namespace packages it does not list)."""
    for info in pkgutil.iter_modules([str(path)], prefix):
        yield info.name
        if info.ispkg:
            yield from package_modules(path / info.name.rpartition(".")[2], info.name + ".")
    for sub in sorted(path.iterdir()):
        if sub.is_dir() and not (sub / "__init__.py").exists() and any(sub.glob("*.py")):
            yield prefix + sub.name
            yield from package_modules(sub, prefix + sub.name + ".")


def probe_imports():
    import megatron.core.package_info as info
    import torch

    early = [m for m in sys.modules if m.startswith("mindspeed_tft.") and
             m not in ("mindspeed_tft.patches", "mindspeed_tft.stand_ins")]
    assert not early, f"imported before the check: {early}"
    values, missing = resolve_all(all_applicable())
    before = snapshot()
    import mindspeed_tft
    skip = {"mindspeed_tft.megatron_adaptor", "mindspeed_tft.torchrun_adaptor"}
    names = sorted(m for m in set(package_modules(pathlib.Path(mindspeed_tft.__file__).parent,
                                                  "mindspeed_tft.")) - skip
                   if not m.endswith(".__main__"))  # a `python -m` entry runs on import
    failed = []
    for module in names:
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed.append(f"{module} ({type(exc).__name__}: {exc})")
    after_values, _ = resolve_all(values)
    moved = [t for t in values if after_values[t][2] is not values[t][2]]
    return {"torch": torch.__version__, "mcore": info.__version__,
            "mcore_file": info.__file__, "training_file": sys.modules["megatron.training"].__file__,
            "missing": missing, "modules": names, "failed": failed, "moved": moved,
            "changed": [f"{label}.{attr} ({how})" for _, label, attr, how in changes(before)],
            "installed": installed_here(), "scanned": len(before)}


def installed_here(name=None):
    """The moments installed in this process, but "stand-ins" (installed by the parent)."""
    return [m for m in patches.installed() if m != "stand-ins" or name == "stand-ins"]


def main(out_dir):
    with patches.swapped("torch:compile", eager):
        import megatron.core  # noqa: F401
        stand_ins = probe_install("stand-ins", absent_before=True)
    with open(os.path.join(out_dir, "stand-ins.json"), "w") as f:
        json.dump(stand_ins, f)
    import_target_modules(all_applicable())
    checks = ["imports", *[m.name for m in patches.TABLE
                           if m.installer is not None and m.name != "stand-ins"]]
    children = {}
    for name in checks:
        pid = os.fork()
        if pid == 0:  # the child: one check, then out without the interpreter's teardown
            try:
                result = probe_imports() if name == "imports" else probe_install(name)
            except BaseException:
                result = {"error": traceback.format_exc()}
            with open(os.path.join(out_dir, name + ".json"), "w") as f:
                json.dump(result, f)
            os._exit(0)
        children[pid] = name
    results = {"stand-ins": stand_ins}
    for pid, name in children.items():
        _, status = os.waitpid(pid, 0)
        try:
            with open(os.path.join(out_dir, name + ".json")) as f:
                results[name] = json.load(f)
        except OSError:
            results[name] = {"error": f"the check's process ended ({status}) with no result"}
    print("''' + _RESULT + r'''" + json.dumps(results), flush=True)


main(sys.argv[1])
'''


def _run_probe(version: str, out_dir: Path) -> Probe | str:
    """Every check's result on megatron-core `version`, by name ("imports", or a moment's);
    or why there are none."""
    mlm = clone(version)
    if isinstance(mlm, str):
        return mlm
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(mlm), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the "cpu" moments patch only where CUDA is absent
    env["PYTHONWARNINGS"] = "ignore"  # megatron-core's "Apex is not installed" notices
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(out_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the forked checks too
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return f"the probe ran past 300 s:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    for line in stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    return f"the probe exited {proc.returncode} without a result:\n{stdout[-3000:]}\n" + (
        stderr[-5000:])


@pytest.fixture(scope="module", params=VERSIONS)
def probe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Probe | str:
    """The subprocess checks on one pinned version, run once for the whole file."""
    return _run_probe(request.param, tmp_path_factory.mktemp(f"patch-probe-{request.param}"))


def result_of(probe: Probe | str, name: str) -> dict[str, Any]:
    """The result of check `name`; the test fails (not skips) when the probe could not run."""
    if isinstance(probe, str):
        pytest.fail(probe, pytrace=False)
    return probe[name]


# --- 1. every target exists in the pinned versions -------------------------------------------


def test_pinned_versions(probe: Probe | str, request: pytest.FixtureRequest) -> None:
    version = request.node.callspec.params["probe"]
    result = result_of(probe, "imports")
    mlm = Path(clone(version)).resolve()
    assert result["torch"].startswith("2.13"), result["torch"]
    assert result["mcore"] == version, result["mcore"]  # the clone's, first on the path
    assert importlib.metadata.version("megatron-core") == "0.12.1"  # the wheel in the venv
    for found in ("mcore_file", "training_file"):
        assert Path(result[found]).resolve().is_relative_to(mlm), result[found]


def test_every_target_resolves(probe: Probe | str) -> None:
    missing = result_of(probe, "imports")["missing"]
    assert not missing, "targets of mindspeed_tft.patches.TABLE that do not exist:\n" + "\n".join(
        missing)


def test_table_is_well_formed() -> None:
    names = [m.name for m in patches.TABLE]
    assert len(names) == len(set(names)), names
    for row in patches.TABLE:
        targets = [p.target for p in row.patches]
        assert row.patches and len(targets) == len(set(targets)), row.name
        for p in row.patches:
            module, sep, name = p.target.partition(":")
            assert sep and module and name and p.why and p.version, p
            assert p.version in patches.VERSIONS, p


# --- 2. each installer changes exactly its targets -------------------------------------------


@pytest.mark.parametrize("name", INSTALLED_MOMENTS)
def test_installer_changes_exactly_its_targets(probe: Probe | str, name: str) -> None:
    result = result_of(probe, name)
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "error" not in result, result.get("error")
    assert result["first"] is True and result["installed"] == [name], result
    assert not result["unchanged"], (
        f"{name}: declared targets its installer did not replace: {result['unchanged']}")
    assert not result["undeclared_in_owners"], (
        f"{name}: attributes of the targets' owners changed but not declared in the table: "
        f"{result['undeclared_in_owners']}")
    assert not result["undeclared"], (
        f"{name}: third-party attributes changed but not declared in the table: "
        f"{result['undeclared']}")
    # idempotent: the second call says so and changes nothing
    assert result["second"] is False, result
    assert not result["changed_by_second"], result["changed_by_second"]


# --- 3. the install / swapped API -------------------------------------------------------------


def test_unknown_moment_is_refused() -> None:
    with pytest.raises(ValueError) as error:
        patches.install("no-such-moment")
    for name in [m.name for m in patches.TABLE]:
        assert name in str(error.value)
    assert patches.installed() == []


def test_scoped_moment_cannot_be_installed() -> None:
    with pytest.raises(ValueError, match="scoped"):
        patches.install("scoped")
    assert patches.installed() == []


def test_swapped_restores_the_original() -> None:
    import torch.distributed as dist

    original = dist.barrier

    def stand_in(*args: Any, **kwargs: Any) -> None:
        return None

    with patches.swapped("torch.distributed:barrier", stand_in):
        assert dist.barrier is stand_in
    assert dist.barrier is original
    with pytest.raises(RuntimeError, match="inside"):
        with patches.swapped("torch.distributed:barrier", stand_in):
            raise RuntimeError("inside")
    assert dist.barrier is original


def test_swapped_refuses_an_undeclared_target() -> None:
    import torch

    zeros = torch.zeros
    for target in ("torch:zeros",  # declared, but installed by a moment, not scoped
                   "torch:ones_like"):  # not declared at all
        with pytest.raises(ValueError, match="not declared"):
            with patches.swapped(target, lambda *a, **k: None):
                pass
    assert torch.zeros is zeros


# --- 4. importing the package patches nothing -------------------------------------------------


def test_importing_the_package_patches_nothing(probe: Probe | str) -> None:
    result = result_of(probe, "imports")
    assert not result["failed"], f"modules that failed to import: {result['failed']}"
    for module in ("mindspeed_tft.platform.cpu_adaptor", "mindspeed_tft.recovery.collectives",
                   "mindspeed_tft.megatron.adaptor", "mindspeed_tft.launcher.torchrun_hook"):
        assert module in result["modules"], f"{module} was not walked"
    assert not result["moved"], f"targets replaced by a mere import: {result['moved']}"
    assert not result["changed"], f"third-party attributes changed by imports: {result['changed']}"
    assert result["installed"] == []
