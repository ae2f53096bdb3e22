"""Set-ups whose first fault could only fail stop at start-up: exit code 2 and one line naming
the flag (or variable) and the fix, no traceback, before the model is built. In both hosts
(this project's trainer and Megatron-LM's own `pretrain_gpt.py`, each started as rank 0 of 4
as plain torchrun starts it: it stops in argument validation, before torch.distributed) and
in `tft-run`'s early check (before any worker starts).

- high availability without `--save` (the dump has nowhere to go), and elastic training
  without it (a shrink goes through the dump);
- `--save` that cannot be written;
- worker reboot under a launcher that never restarts a worker (plain torchrun);
- the controller's port taken (rank 0 hosts the controller under plain torchrun, node 0's
  launcher under `tft-run`);
- `--max-restarts` and `TFT_MAX_WORKER_RESTARTS` that disagree (`tft-run`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs import REPO, free_port
from tests.test_environment import _start

BIN = Path(sys.executable).parent
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
         "--train-iters 4 --save-interval 4 --lr 1e-3 --bf16 --use-distributed-optimizer "
         "--mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 4096").split()
HA = ["--enable-high-availability"]
ELASTIC = [*HA, "--enable-worker-reboot", "--enable-elastic-training"]
#: what tft-run's workers get: a launcher that restarts failed workers hosts the controller
LAUNCHED = {"TFT_CONTROLLER_IN_LAUNCHER": "1"}

NO_SAVE = ("--enable-high-availability needs --save DIR: the dying-gasp checkpoint is written "
           "there, and without it the first fault ends the job with nothing saved; allowed: "
           "add --save DIR")
ELASTIC_NO_SAVE = ("--enable-elastic-training needs --save DIR: a shrink continues from the "
                   "dying-gasp checkpoint written there, and without it the first lost worker "
                   "ends the job with nothing saved; allowed: add --save DIR")
NO_RESTARTS = ("--enable-worker-reboot needs a launcher that restarts failed workers, and this "
               "one never does (a killed worker would leave the others waiting for it until "
               "the launcher kills them, with nothing saved); allowed: launch with tft-run "
               "(torchrun's arguments) or a torchrun patched by scripts/patch_torchrun.sh, or "
               "remove worker reboot")


def _unwritable(save: str) -> str:
    return (f"--save {save}: it is a file, not a folder, so the dying-gasp checkpoint could not "
            "be written there; allowed: a folder this process can create and write")


def _port_in_use(port: int) -> str:
    return (f"the controller cannot listen on 127.0.0.1:{port}: the port is in use (another "
            "job's controller or another program listens there); allowed: a free port in "
            "TTP_PORT")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        yield port


def _host(host: str, args: list[str], env: dict[str, str], cwd: Path,
          megatron_lm: Path | None) -> subprocess.CompletedProcess:
    if host == "reference":
        return _start([sys.executable, str(REPO / "pretrain_gpt.py"), *MODEL, *args], cwd, env)
    assert megatron_lm is not None
    return _start([sys.executable, "-m", "mindspeed_tft.megatron", "pretrain_gpt.py", *MODEL,
                   "--transformer-impl", "local", *args], megatron_lm, env, str(megatron_lm))


def _assert_refused(done: subprocess.CompletedProcess, line: str) -> None:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "\n" not in line
    assert line in done.stderr.splitlines(), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


HOSTS = ["reference", pytest.param("megatron-lm", marks=pytest.mark.multiproc)]


@pytest.fixture
def host_megatron_lm(request: pytest.FixtureRequest) -> Path | None:
    """The Megatron-LM copy for the megatron-lm cases only (its fixture copies the clone)."""
    if request.node.callspec.params["host"] != "megatron-lm":
        return None
    return request.getfixturevalue("megatron_lm")


# --- the hosts ----------------------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize(("flags", "message"), [(HA, NO_SAVE), (ELASTIC, ELASTIC_NO_SAVE)],
                         ids=["ha", "elastic"])
def test_high_availability_without_save_is_refused(host, flags, message, host_megatron_lm,
                                                   tmp_path):
    done = _host(host, flags, LAUNCHED, tmp_path, host_megatron_lm)
    _assert_refused(done, f"[mindspeed-tft] error: {message}")


@pytest.mark.parametrize("host", HOSTS)
def test_an_unwritable_save_is_refused(host, host_megatron_lm, tmp_path):
    save = tmp_path / "a-file"
    save.write_text("")
    done = _host(host, [*HA, "--save", str(save)], {}, tmp_path, host_megatron_lm)
    _assert_refused(done, f"[mindspeed-tft] error: {_unwritable(str(save))}")


@pytest.mark.parametrize("host", HOSTS)
def test_worker_reboot_under_plain_torchrun_is_refused(host, host_megatron_lm, tmp_path):
    done = _host(host, [*HA, "--enable-worker-reboot", "--save", str(tmp_path / "ckpt")], {},
                 tmp_path, host_megatron_lm)
    _assert_refused(done, f"[mindspeed-tft] error: {NO_RESTARTS}")


@pytest.mark.parametrize("host", HOSTS)
def test_rank_0_refuses_a_controller_port_in_use(host, host_megatron_lm, taken_port, tmp_path):
    done = _host(host, [*HA, "--save", str(tmp_path / "ckpt")], {"TTP_PORT": str(taken_port)},
                 tmp_path, host_megatron_lm)
    _assert_refused(done, f"[mindspeed-tft] error: {_port_in_use(taken_port)}")


# --- tft-run ------------------------------------------------------------------------------


def _tft_run(args: list[str], env: dict[str, str], cwd: Path,
             launcher_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return _start([str(BIN / "tft-run"), "--nproc-per-node", "2", "--master-port",
                   str(free_port()), *launcher_args, str(REPO / "pretrain_gpt.py"), *MODEL,
                   *args], cwd, env)


@pytest.mark.parametrize(("flags", "message"), [(HA, NO_SAVE), (ELASTIC, ELASTIC_NO_SAVE)],
                         ids=["ha", "elastic"])
def test_tft_run_refuses_high_availability_without_save(flags, message, tmp_path):
    done = _tft_run(flags, {}, tmp_path)
    _assert_refused(done, f"[tft-run] error: {message}")
    assert "[mindspeed-tft]" not in done.stdout + done.stderr  # no worker started


def test_tft_run_refuses_an_unwritable_save(tmp_path):
    save = tmp_path / "a-file"
    save.write_text("")
    _assert_refused(_tft_run([*HA, "--save", str(save)], {}, tmp_path),
                    f"[tft-run] error: {_unwritable(str(save))}")


def test_tft_run_refuses_a_controller_port_in_use(taken_port, tmp_path):
    done = _tft_run([*HA, "--save", str(tmp_path / "ckpt")], {"TTP_PORT": str(taken_port)},
                    tmp_path)
    _assert_refused(done, f"[tft-run] error: {_port_in_use(taken_port)}")


def test_tft_run_refuses_contradicting_restart_budgets(tmp_path):
    done = _tft_run([*HA, "--enable-worker-reboot", "--save", str(tmp_path / "ckpt")],
                    {"TFT_MAX_WORKER_RESTARTS": "3"}, tmp_path, ("--max-restarts", "0"))
    _assert_refused(done, "[tft-run] error: --max-restarts 0 contradicts "
                          "TFT_MAX_WORKER_RESTARTS=3: both set how many times this node's "
                          "launcher restarts failed workers; allowed: one of the two, or the "
                          "same number")


@pytest.mark.multiproc
def test_tft_run_passes_its_workers_refusal_through(tmp_path):
    """A bad value only the workers read (TFT_INJECT naming a rank outside the 2-rank job):
    every worker refuses it with exit code 2, and so does tft-run."""
    done = _tft_run([], {"TFT_INJECT": "kill:rank=7,step=3"}, tmp_path)
    line = ("[mindspeed-tft] error: TFT_INJECT item 1 'kill:rank=7,step=3,phase=forward': rank "
            "7 is outside the job's 2 ranks; allowed: 0 to 1")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert line in (done.stdout + done.stderr).splitlines()
    assert "refused their settings (exit code 2" in done.stderr


def test_a_controller_whose_port_is_taken_says_so_in_one_line(taken_port, tmp_path):
    """The bind itself (a port taken between the start-up check and the controller's start):
    the same line, as the error `tft-run` and rank 0 print, not ZeroMQ's traceback."""
    from mindspeed_tft.control import ControlConfig, Controller
    from mindspeed_tft.control.wire.config import ControlConfigError

    controller = Controller(2, ControlConfig(port=taken_port, log_path=str(tmp_path)))
    with pytest.raises(ControlConfigError) as info:
        controller.start()
    assert str(info.value) == _port_in_use(taken_port)
