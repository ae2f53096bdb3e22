"""The user tools' commands (mindspeed_tft/tools/): each console script (`tft-report`,
`tft-drill`, `tft-plan`, setup.cfg) and the `python -m mindspeed_tft.NAME` users' commands
already have run the same code, with the same output and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _events(path: Path) -> Path:
    """Two logged iterations of a fault-free job."""
    lines = [{"time": 0.0, "event": "state", "rank": -1, "state": "NORMAL", "prev": None},
             {"time": 1.0, "event": "iteration", "rank": 1, "iteration": 1, "loss": 2.5},
             {"time": 2.0, "event": "iteration", "rank": 1, "iteration": 2, "loss": 2.25}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("name", "argv", "code"), [
    ("plan", ["--preset", "llama2-7b", "--data-parallel-size", "8", "--json"], 0),
    ("report", ["EVENTS"], 0),
    ("drill", ["--faults", "bogus", "--", "true"], 2),
])
def test_the_console_script_and_python_m_are_one_command(name, argv, code, tmp_path):
    argv = [str(_events(tmp_path / "events.jsonl")) if a == "EVENTS" else a for a in argv]
    runs = [subprocess.run(command + argv, capture_output=True, text=True, timeout=60)
            for command in ([str(BIN / f"tft-{name}")],
                            [sys.executable, "-m", f"mindspeed_tft.{name}"])]
    script, module = runs
    assert script.returncode == module.returncode == code, (script.stderr, module.stderr)
    assert (script.stdout, script.stderr) == (module.stdout, module.stderr)
    assert script.stdout or script.stderr.startswith(f"usage: tft-{name}")


def test_the_old_module_names_are_the_tools():
    import mindspeed_tft.drill
    import mindspeed_tft.plan
    import mindspeed_tft.report
    from mindspeed_tft.tools import drill, plan, report

    assert (mindspeed_tft.report, mindspeed_tft.drill, mindspeed_tft.plan) == (report, drill, plan)
