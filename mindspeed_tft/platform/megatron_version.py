"""Which megatron-core this process runs on, read once at start-up, and the range supported.

mindspeed-tft installs beside the megatron-core a user has, from 0.12.1 (the version the
MindIO TFT guide pairs with) to 0.16.1 (the newest release that installs on Python 3.11);
both ends are pinned and tested, and every run-time patch says which of them it applies to
(`mindspeed_tft.patches`).

The version is the one `import megatron.core` would import: a Megatron-LM clone first on
the path shadows the megatron-core wheel, so it is read from the ``megatron/core`` that
Python finds first (its ``package_info.py``, parsed, not imported: an unsupported
megatron-core may not even import), and from the wheel's metadata only when no such file is
there. `check()` refuses a version outside the range with one line and exit code 2, before
anything imports megatron-core (`mindspeed_tft.platform.import_megatron_core`).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from mindspeed_tft.process_exit import print_error

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: the supported range of megatron-core, both ends included
LOWEST = Version("0.12.1")
HIGHEST = Version("0.16.1")
#: the versions that are pinned and tested (tests/test_patches.py checks each patch against
#: each of these that it claims)
PINNED = (LOWEST, HIGHEST)
RANGE = f"{LOWEST} to {HIGHEST}"


class UnsupportedVersion(RuntimeError):
    """megatron-core is missing or outside the supported range."""


def _package_info_version(path: str) -> str | None:
    """The version a ``megatron/core/package_info.py`` declares (MAJOR, MINOR, PATCH,
    PRE_RELEASE as literals), or None when the file does not say it that way."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    parts: dict[str, object] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            try:
                parts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    try:
        return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}"
    except KeyError:
        return None


def _find_version() -> tuple[str, str]:
    """(version string, where it was read) of the megatron-core that would be imported."""
    module = sys.modules.get("megatron.core.package_info")
    if module is not None:
        return str(module.__version__), str(module.__file__)
    spec = importlib.util.find_spec("megatron")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        core = os.path.join(folder, "core")
        if os.path.isfile(os.path.join(core, "__init__.py")):
            info = os.path.join(core, "package_info.py")
            found = _package_info_version(info)
            if found is not None:
                return found, info
            break
    try:
        return importlib.metadata.version("megatron-core"), "the megatron-core distribution"
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedVersion(
            f"megatron-core is not installed; mindspeed-tft needs megatron-core {RANGE} "
            f"(pip install 'megatron-core>={LOWEST},<={HIGHEST}', or a Megatron-LM clone of "
            "one of these first on PYTHONPATH)"
        ) from None


@functools.cache
def version() -> Version:
    """The megatron-core version of this process (read once); UnsupportedVersion when it is
    missing or outside the supported range."""
    found, where = _find_version()
    try:
        parsed = Version(found)
    except InvalidVersion:
        raise UnsupportedVersion(
            f"megatron-core version {found!r} ({where}) is not a version; supported: {RANGE}"
        ) from None
    if not LOWEST <= parsed <= HIGHEST:
        raise UnsupportedVersion(
            f"megatron-core {found} ({where}) is not supported; supported: {RANGE} "
            f"(pip install 'megatron-core>={LOWEST},<={HIGHEST}')"
        )
    return parsed


def check() -> Version:
    """`version()`, or exit code 2 when it is unsupported, with one line on stderr (from every
    rank: the first to exit makes the launcher stop the others)."""
    try:
        return version()
    except UnsupportedVersion as error:
        print_error(str(error))
        raise SystemExit(2) from None


def at_least(release: str) -> bool:
    """Whether this process's megatron-core is `release` or newer."""
    return version() >= Version(release)


# --- megatron-core names that differ across the supported range ------------------------------


def replica_instance_group() -> ProcessGroup:
    """megatron-core's group of the ranks that hold the same distributed-optimizer shard, one
    per optimizer instance (`--num-distributed-optimizer-instances`):
    `get_inter_partial_data_parallel_group` in 0.12.1, renamed
    `get_inter_distributed_optimizer_instance_group` by 0.16.1."""
    from megatron.core import parallel_state as ps

    group = getattr(ps, "get_inter_distributed_optimizer_instance_group", None)
    if group is None:
        group = ps.get_inter_partial_data_parallel_group
    return group()


def tokenizer_base() -> type:
    """megatron-core's abstract tokenizer, the one its GPT datasets take:
    `megatron.core.datasets.megatron_tokenizer.MegatronTokenizer` in 0.12.1, renamed
    `MegatronLegacyTokenizer` by 0.16.1 (where `MegatronTokenizer` is the new tokenizer
    system's factory, in `megatron.core.tokenizers`)."""
    from megatron.core.datasets import megatron_tokenizer

    base = getattr(megatron_tokenizer, "MegatronLegacyTokenizer", None)
    return base if base is not None else megatron_tokenizer.MegatronTokenizer
