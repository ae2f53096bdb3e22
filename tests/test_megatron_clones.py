"""scripts/megatron_clones.sh: where the tests' Megatron-LM clones come from.

Run on a copy of the scripts outside any checkout with a `shared/` beside it, with a HOME of
its own: the variables win, then shared/, then the cache, else a clone into the cache (here
from a local repository with the two tags); where no clone can be had, one line on stderr
names the variable to set and the exit code is not 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _fake_megatron(path: Path, tags: tuple[str, ...]) -> Path:
    """A git repository shaped like Megatron-LM (pretrain_gpt.py, megatron/core) with `tags`."""
    (path / "megatron" / "core").mkdir(parents=True)
    (path / "pretrain_gpt.py").write_text("# Megatron-LM's entry point\n")
    (path / "megatron" / "core" / "__init__.py").write_text("")
    git = ["git", "-C", str(path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=60)
    subprocess.run([*git, "add", "-A"], check=True, timeout=60)
    subprocess.run([*git, "commit", "-qm", "megatron"], check=True, timeout=60)
    for tag in tags:
        subprocess.run([*git, "tag", tag], check=True, timeout=60)
    return path


def _run(tmp_path: Path, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    checkout = tmp_path / "nowhere" / "mindspeed-tft"
    (checkout / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "megatron_clones.sh", checkout / "scripts")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MEGATRON_LM", "MEGATRON_LM_016", "XDG_CACHE_HOME")}
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "megatron_clones.sh")], capture_output=True,
        text=True, timeout=300,
        env={**clean, "HOME": str(tmp_path / "home"), "TFT_MEGATRON_LM_URL": url, **env})


def test_no_clone_to_be_had_says_in_one_line_what_to_set(tmp_path: Path) -> None:
    done = _run(tmp_path, f"file://{tmp_path}/no-such-repository")
    assert done.returncode != 0
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Megatron-LM core_v0.12.1 not found")
    assert "set MEGATRON_LM=/path/to/a Megatron-LM core_v0.12.1 clone" in lines[0]


def test_a_variable_that_names_no_clone_is_refused(tmp_path: Path) -> None:
    done = _run(tmp_path, "file:///unused", MEGATRON_LM=str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        f"MEGATRON_LM={tmp_path} is not a Megatron-LM clone (no pretrain_gpt.py, "
        "megatron/core): set MEGATRON_LM to a clone of Megatron-LM core_v0.12.1"]


def test_clones_into_the_cache_once_then_finds_them_there(tmp_path: Path) -> None:
    source = _fake_megatron(tmp_path / "upstream", ("core_v0.12.1", "core_v0.16.1"))
    cache = tmp_path / "home" / ".cache" / "mindspeed-tft"
    done = _run(tmp_path, f"file://{source}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"MEGATRON_LM={cache}/megatron-lm-core_v0.12.1",
        f"MEGATRON_LM_016={cache}/megatron-lm-core_v0.16.1"]
    assert (cache / "megatron-lm-core_v0.16.1" / "pretrain_gpt.py").is_file()
    again = _run(tmp_path, f"file://{tmp_path}/gone")  # no clone needed any more
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert again.stdout == done.stdout


def test_the_variable_wins_and_the_second_clone_is_needed_too(tmp_path: Path) -> None:
    source = _fake_megatron(tmp_path / "upstream", ("core_v0.12.1",))  # no core_v0.16.1
    done = _run(tmp_path, f"file://{source}", MEGATRON_LM=str(source))
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        "Megatron-LM core_v0.16.1 not found and `git clone` of it failed: set "
        f"MEGATRON_LM_016=/path/to/a Megatron-LM core_v0.16.1 clone (git clone --depth 1 "
        f"--branch core_v0.16.1 file://{source})"]
