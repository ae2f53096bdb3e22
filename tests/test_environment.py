"""Every environment value the plugin reads is checked at start-up, in both hosts (this
project's trainer and Megatron-LM's own `pretrain_gpt.py`), before the model is built: a bad
`TFT_INJECT` or `TTP_*` value ends the process with exit code 2 and one line naming the
variable and what is allowed, no traceback, no fallback.

Every case goes through `check_environment`, what both hosts' argument validation calls;
three of them (a `TTP_*` value and rank 0's bind in the trainer, `TFT_INJECT` in
Megatron-LM) through one real process each, started as rank 0 of 4, so it stops in argument
validation, before torch.distributed: a start that went on would wait for 3 ranks that
never come.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_tft.arguments import TFTArgumentError, check_environment
from tests.jobs import free_port

REPO = Path(__file__).resolve().parents[1]
ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 4 --lr 1e-3 --bf16 --use-distributed-optimizer --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 4096 --enable-high-availability "
        "--save ckpt --save-interval 4").split()
CASES = [
    ({"TFT_INJECT": "kill:rank=x,step=3"},
     "TFT_INJECT item 1 'kill:rank=x,step=3': rank must be a non-negative integer, got 'x'"),
    ({"TTP_HEARTBEAT_MISSES": "abc"},
     "TTP_HEARTBEAT_MISSES='abc' is not an integer in [1, 100] (unset: 3)"),
    ({"TTP_NORMAL_ACTION_TIME_LIMIT": "5"},
     "TTP_NORMAL_ACTION_TIME_LIMIT='5' is not a number in [30, 1800] (unset: 180)"),
    ({"CONTROLLER_ADDR": "0.0.0.0"},  # rank 0 hosts the controller under torchrun
     "the controller would listen on 0.0.0.0, which is not a loopback address, without CURVE "
     "keys: anyone who reaches it could end the job. Set TTP_CURVE_SERVER_KEY and "
     "TTP_CURVE_AUTHORIZED_KEYS (python -m mindspeed_tft.control.wire.keys DIR), or "
     "TTP_ALLOW_INSECURE=1 to run an unauthenticated control plane anyway"),
    ({"TFT_CONTROL_NICE": "5"}, "TFT_CONTROL_NICE='5' is not an integer in [-20, 0] (unset: -10)"),
    # a rank outside the job (WORLD_SIZE 4) would never fire
    ({"TFT_INJECT": "kill:rank=0,step=3;kill:rank=7,step=3"},
     "TFT_INJECT item 2 'kill:rank=7,step=3,phase=forward': rank 7 is outside the job's 4 "
     "ranks; allowed: 0 to 3"),
    # a number too long for int() (4300 digits): refused by its text, echoed cut
    ({"TFT_INJECT": f"kill:rank={'9' * 5000},step=1"},
     f"TFT_INJECT item 1 'kill:rank={'9' * 50}'… (5017 characters): rank must be at most "
     f"2147483647, got '{'9' * 60}'… (5000 characters)"),
]


def _start(command: list[str], cwd: Path, env: dict[str, str], extra_path: str = "") -> \
        subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("TTP_", "TFT_")) and k != "HIGH_AVAILABILITY"}
    full.update({"TTP_PORT": str(free_port())}, **env, RANK="0", WORLD_SIZE="4", LOCAL_RANK="0",
                PYTHONPATH=os.pathsep.join(p for p in (extra_path, str(REPO)) if p))
    return subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("env", "message"), CASES)
def test_every_bad_environment_value_is_refused_naming_it(env, message):
    args = argparse.Namespace(rank=0, world_size=4, enable_high_availability=True)
    with pytest.raises(TFTArgumentError) as info:
        check_environment(args, env)
    assert str(info.value) == message


@pytest.mark.parametrize(("env", "message"), [CASES[1], CASES[3]])
def test_reference_trainer_refuses_a_bad_environment_value(env, message, tmp_path):
    done = _start([sys.executable, str(REPO / "pretrain_gpt.py"), *ARGS], tmp_path, env)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"[mindspeed-tft] error: {message}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize(("env", "message"), CASES[:1])
def test_megatron_lm_refuses_a_bad_environment_value(env, message, megatron_lm):
    done = _start([sys.executable, "-m", "mindspeed_tft.megatron", "pretrain_gpt.py", *ARGS,
                   "--transformer-impl", "local"], megatron_lm, env, str(megatron_lm))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"[mindspeed-tft] error: {message}" in done.stderr
    assert "Traceback" not in done.stderr
