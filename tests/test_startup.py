"""A worker's imports run without the cyclic garbage collector; its host's `pretrain()`
freezes what they built and switches the collector back on (`mindspeed_tft.startup`).

Each case runs a fresh interpreter: the collector's state is per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.jobs import REPO, free_port

#: printed by a process at exit: (collector on?, objects frozen, torch imported?)
PROBE = ("import atexit, gc, sys\n"
         "atexit.register(lambda: print('GC-PROBE', gc.isenabled(), gc.get_freeze_count() > 0,"
         " 'torch' in sys.modules, 'torch._dynamo' in sys.modules, file=sys.stderr))\n")


def _python(code: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
            probe_dir: Path | None = None, megatron_lm: Path | None = None
            ) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TTP_", "TFT_"))}
    path = [str(REPO), *([str(megatron_lm)] if megatron_lm else [])]
    if probe_dir is not None:
        (probe_dir / "sitecustomize.py").write_text(PROBE)
        path.insert(0, str(probe_dir))
    full.update(env or {}, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=120)


def _probe(done: subprocess.CompletedProcess) -> tuple[bool, ...]:
    line = [x for x in done.stderr.splitlines() if x.startswith("GC-PROBE")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return tuple(word == "True" for word in line[-1].split()[1:])


def test_deferred_until_the_imports_are_done():
    done = _python(
        "import gc, sys\n"
        "from mindspeed_tft.startup import defer_gc, imports_done\n"
        "defer_gc(); off = not gc.isenabled()\n"
        "import json\n"
        "imports_done(also=['colorsys'])\n"
        "print(off, gc.isenabled(), gc.get_freeze_count() > 0, 'colorsys' in sys.modules)\n"
        "imports_done(); print(gc.isenabled())\n")
    assert done.stdout.split() == ["True"] * 5, done.stderr[-2000:]


def test_a_collector_the_user_switched_off_stays_off():
    done = _python(
        "import gc\n"
        "from mindspeed_tft.startup import defer_gc, imports_done\n"
        "gc.disable(); defer_gc(); imports_done(also=['colorsys'])\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n")
    assert done.stdout.split() == ["False", "0"], done.stderr[-2000:]


def test_the_reference_trainer_imports_torch_with_the_collector_off(tmp_path):
    """Imported as a module (its `__main__` block does not run), `pretrain_gpt.py` has done
    its imports, torch's among them, and has not switched the collector back on."""
    done = _python("import pretrain_gpt", probe_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _probe(done) == (False, False, True, False)


ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 4096 --bf16 --use-distributed-optimizer "
        "--enable-high-availability").split()


def test_the_reference_trainers_pretrain_switches_it_back_on(tmp_path):
    """Run as a script up to the plugin's first check inside `pretrain()` (high
    availability needs DP >= 2; world size 1 here): the collector is on, the imports frozen
    and torch._dynamo (which the optimizer's construction would import) imported."""
    done = _python("", str(REPO / "pretrain_gpt.py"), *ARGS, cwd=tmp_path,
                   env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, probe_dir=tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "needs a data-parallel size >= 2" in done.stderr
    assert _probe(done) == (True, True, True, True)


def test_megatron_lm_routes(megatron_lm, tmp_path):
    """The one-line import leaves the collector off for the script's own imports; with
    `python -m mindspeed_tft.megatron`, Megatron-LM's `pretrain()` switches it back on (a
    flag the plugin refuses inside it ends the run there); a loop of its own, when it
    parses Megatron-LM's arguments."""
    refused = _python("", "-m", "mindspeed_tft.megatron", "pretrain_gpt.py", *ARGS,
                      "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
                      "--exit-signal-handler", cwd=megatron_lm, probe_dir=tmp_path,
                      megatron_lm=megatron_lm, env={"RANK": "0", "WORLD_SIZE": "4",
                                                    "TTP_PORT": str(free_port())})
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "--exit-signal-handler cannot be combined" in refused.stderr
    assert _probe(refused) == (True, True, True, True)
    # a loop of its own (MindSpeed-LLM's) that parses Megatron-LM's arguments itself
    parsed = _python("import gc, sys\n"
                     "import mindspeed_tft.megatron_adaptor\n"
                     "print('after the import', gc.isenabled(), 'torch' in sys.modules)\n"
                     "from megatron.training.arguments import parse_args\n"
                     "parse_args()", "--num-layers", "2", probe_dir=tmp_path,
                     megatron_lm=megatron_lm)
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    assert "after the import False True" in parsed.stdout
    assert _probe(parsed) == (True, True, True, True)
