"""The recovery callbacks Protocol (`wire.callbacks.RecoveryCallbacks`): every host defines
every method itself, and one that leaves a method out cannot be built, neither at run time
nor under mypy (a forgotten `repair` is never a silent success)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mindio_ttp._actions import SdkActions
from mypy import api as mypy_api

from mindspeed_tft.control.wire.callbacks import NoRecovery, RecoveryCallbacks
from mindspeed_tft.recovery.actions import RecoveryActions

CALLBACKS = {"stop", "clean", "repair", "rollback", "dump", "rename", "scale_in",
             "scale_out", "exit", "pause", "resume"}


def test_every_callback_is_abstract() -> None:
    assert set(RecoveryCallbacks.__abstractmethods__) == CALLBACKS


@pytest.mark.parametrize("host", [RecoveryActions, SdkActions, NoRecovery])
def test_every_host_defines_every_callback_in_its_own_body(host: type) -> None:
    assert RecoveryCallbacks in host.__mro__
    assert sorted(CALLBACKS - vars(host).keys()) == []
    assert host.__abstractmethods__ == frozenset()


def _host_without(missing: str) -> str:
    """A host module that defines every callback but `missing`, and builds one."""
    methods = "".join(f"    def {name}(self, order: Any) -> Any:\n        return None\n\n"
                      for name in sorted(CALLBACKS - {missing}))
    return ("from typing import Any\n\n"
            "from mindspeed_tft.control.wire.callbacks import RecoveryCallbacks\n\n\n"
            f"class Forgetful(RecoveryCallbacks):\n{methods}\n"
            "Forgetful()\n")


def test_a_host_without_repair_cannot_be_built() -> None:
    namespace: dict[str, object] = {}
    with pytest.raises(TypeError, match="abstract method.*repair"):
        exec(_host_without("repair"), namespace)  # noqa: S102


def test_mypy_refuses_a_host_without_repair(tmp_path: Path) -> None:
    snippet = tmp_path / "forgetful.py"
    snippet.write_text(_host_without("repair"))
    complete = tmp_path / "complete.py"
    complete.write_text(_host_without("repair").replace(
        "\nForgetful()", textwrap.dedent("""
            class Complete(Forgetful):
                def repair(self, order: Any) -> Any:
                    return None


            Complete()""")))
    args = ["--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"),
            "--no-error-summary", "--hide-error-context", "--no-pretty"]
    line = snippet.read_text().splitlines().index("Forgetful()") + 1
    out, _, code = mypy_api.run([*args, str(snippet)])
    assert (code, out) == (1, f'{snippet}:{line}: error: Cannot instantiate abstract class '
                               '"Forgetful" with abstract attribute "repair"  [abstract]\n')
    out, _, code = mypy_api.run([*args, str(complete)])
    assert (code, out) == (0, "")
