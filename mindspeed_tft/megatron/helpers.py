"""Can Megatron-LM build its dataset helpers here? Asked before Megatron-LM tries.

Megatron-LM (core_v0.12.1) compiles ``megatron/core/datasets/helpers.cpp`` at start-up, on
rank 0 (`_compile_dependencies`), with ``make`` in that folder. Its Makefile runs the C++
compiler ``$(CXX)`` (make's default: ``g++``) and ``python3 -m pybind11 --includes``, each as
found on PATH. When the build fails rank 0 exits, and what the other ranks show is a closed
gloo connection. `build_problem` says in one line what is missing and the fix; the host
refuses the start with it (exit 2) after validating the flags, before torch.distributed
starts (`adaptor.wrap_validate_args`).

Nothing is asked when make would build nothing: no Makefile (the megatron-core wheel ships
the helpers built, `adaptor.wrap_compile_helpers`), or a library as new as ``helpers.cpp``
already built for this interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping

#: make's default C++ compiler (GNU make's built-in ``CXX``)
DEFAULT_CXX = "g++"
#: the bound on asking another interpreter whether it imports pybind11
PYTHON_CHECK_TIMEOUT_S = 60.0


def datasets_folder() -> str:
    """The folder of the `megatron.core.datasets` that Megatron-LM builds in."""
    import megatron.core.datasets as datasets

    return os.path.dirname(os.path.abspath(datasets.__file__))


def needs_build(folder: str) -> bool:
    """Megatron-LM's make in `folder` would compile: it has a Makefile, and no helpers
    library for this interpreter as new as ``helpers.cpp``."""
    if not os.path.isfile(os.path.join(folder, "Makefile")):
        return False
    source = os.path.join(folder, "helpers.cpp")
    library = os.path.join(folder, "helpers_cpp" + str(sysconfig.get_config_var("EXT_SUFFIX")))
    try:
        return os.path.getmtime(library) < os.path.getmtime(source)
    except OSError:
        return True


def _imports_pybind11(python: str) -> bool:
    """Whether the interpreter `python` imports pybind11 (this one: asked in-process)."""
    if (os.path.dirname(python) == os.path.dirname(sys.executable)
            and os.path.realpath(python) == os.path.realpath(sys.executable)):
        return importlib.util.find_spec("pybind11") is not None
    try:
        done = subprocess.run([python, "-c", "import pybind11"], capture_output=True,
                              timeout=PYTHON_CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _missing(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(what is missing, the fix), or None when the build has what it needs."""
    path = environ.get("PATH", "")
    here = os.path.dirname(sys.executable)
    first_on_path = f"put this Python's folder first on PATH (export PATH={here}:$PATH)"
    if shutil.which("make", path=path) is None:
        return "no make on PATH", "install make (e.g. apt-get install make)"
    cxx = environ.get("CXX") or DEFAULT_CXX
    if shutil.which(shlex.split(cxx)[0], path=path) is None:
        how = f"CXX={cxx}" if environ.get("CXX") else f"make runs {DEFAULT_CXX}; CXX is unset"
        return (f"no C++ compiler on PATH ({how})",
                f"install one (e.g. apt-get install {DEFAULT_CXX}) or set CXX to one")
    python3 = shutil.which("python3", path=path)
    if python3 is None:
        return "no python3 on PATH (the Makefile runs python3 -m pybind11)", first_on_path
    if not _imports_pybind11(python3):
        fix = (first_on_path if importlib.util.find_spec("pybind11") is not None
               else "pip install pybind11 (pip install mindspeed-tft[megatron-lm]) and "
               + first_on_path)
        return f"the python3 on PATH ({python3}) cannot import pybind11", fix
    return None


def build_problem(folder: str | None = None,
                  environ: Mapping[str, str] | None = None) -> str | None:
    """Why Megatron-LM's build of its dataset helpers in `folder` (default: the one it
    imports) would fail, with the fix, in one line; None when it would not (or builds
    nothing)."""
    folder = datasets_folder() if folder is None else folder
    if not needs_build(folder):
        return None
    missing = _missing(os.environ if environ is None else environ)
    if missing is None:
        return None
    what, fix = missing
    return (f"Megatron-LM cannot build its dataset helpers "
            f"({os.path.join(folder, 'helpers.cpp')}, compiled by rank 0 at start-up): "
            f"{what}; fix: {fix}")
