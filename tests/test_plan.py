"""The replica planner (`tft-plan`, mindspeed_tft/tools/plan.py): its formula, parsing and parameter
count, and one small run of `bench/memory.py` that its bytes per parameter must match."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from mindspeed_tft.tools import plan

REPO = Path(__file__).resolve().parent.parent
MEMORY_BENCH = REPO / "bench" / "memory.py"
GIB = 2**30


def run_plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- formula --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "bf16", "fp32"),
    # docs/design.md section 2, worked example, d = 8
    [(1, 6.0, 7.5), (2, 8.0, 9.0), (4, 12.0, 12.0), (8, 20.0, 18.0)],
)
def test_bytes_per_param_design_table(n: int, bf16: float, fp32: float) -> None:
    ha = "on" if n > 1 else "off"
    assert plan.bytes_per_param(8, n, "bf16", ha) == bf16
    assert plan.bytes_per_param(8, n, "fp32", ha) == fp32


def test_bytes_per_param_modes_and_refusals() -> None:
    assert plan.bytes_per_param(2, 1, "bf16", "no-replica") == 12.0
    assert plan.bytes_per_param(6, 3, "fp32", "on") == 12.0
    for bad in ((4, 3, "bf16", "on"), (4, 2, "bf16", "off"), (4, 1, "bf16", "no-replica "),
                (4, 1, "fp16", "off"), (0, 1, "bf16", "off"), (4, 8, "bf16", "on")):
        with pytest.raises(ValueError):
            plan.bytes_per_param(*bad)


# --- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [
    ("7B", 7_000_000_000), ("7e9", 7_000_000_000), ("1.3b", 1_300_000_000),
    ("350M", 350_000_000), ("70G", 70_000_000_000), ("5311232", 5_311_232), ("2k", 2000),
])
def test_parse_count(text: str, value: int) -> None:
    assert plan.parse_count(text) == value


@pytest.mark.parametrize("text", ["", "0", "-7B", "7X", "B", "7 B B", "0.0001"])
def test_parse_count_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        plan.parse_count(text)


@pytest.mark.parametrize(("text", "value"), [
    ("64GiB", 64 * GIB), ("80GB", 80 * 10**9), ("80 gb", 80 * 10**9), ("1.5TiB", 3 * 2**39),
    ("512MiB", 2**29), ("100B", 100),
])
def test_parse_memory(text: str, value: int) -> None:
    assert plan.parse_memory(text) == value


@pytest.mark.parametrize("text", ["80G", "64", "-1GB", "0GB", "GiB", "64 GiBs", "1e-12GB"])
def test_parse_memory_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        plan.parse_memory(text)


# --- parameter count ------------------------------------------------------------------------


def test_llama2_7b_preset_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 2 7B: 6,738,415,616 parameters (the published count); the preset carries
    Llama-2's vocabulary (32,000), and a --vocab-size given overrides it."""
    out = run_plan(["--preset", "llama2-7b", "--data-parallel-size", "2"], capsys)
    assert out["params"] == 6_738_415_616
    out = run_plan(["--preset", "llama2-7b", "--vocab-size", "32001",
                    "--data-parallel-size", "2"], capsys)
    assert out["params"] == 6_738_415_616 + 2 * 4096  # one more row: embedding and output


def test_gpt2_small_count(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 small (LayerNorm, biases, learned positions, tied output): 124,439,808."""
    out = run_plan(["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads",
                    "12", "--seq-length", "1024", "--vocab-size", "50257",
                    "--make-vocab-size-divisible-by", "1", "--data-parallel-size", "2"], capsys)
    assert out["params"] == 124_439_808
    # Megatron-LM's default padding (128 x TP) adds embedding rows: 50304 at TP 1, 50688 at TP 4
    out = run_plan(["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads",
                    "12", "--seq-length", "1024", "--vocab-size", "50257",
                    "--tensor-model-parallel-size", "4", "--data-parallel-size", "2"], capsys)
    assert out["params"] == 124_439_808 + (50688 - 50257) * 768
    assert out["params_per_device"] == out["params"] / 4


def test_model_flag_defaults_are_megatron_lms() -> None:
    from mindspeed_tft.training.arguments import build_parser

    trainer = vars(build_parser().parse_args([]))
    for name, default in plan.megatron_defaults().items():
        assert trainer[name] == default, name


@pytest.mark.parametrize(("vocab", "divisible", "tp"), [(32000, 128, 1), (50257, 128, 8),
                                                         (4097, 1, 1), (4097, 1, 2)])
def test_vocab_padding_is_the_trainers(vocab: int, divisible: int, tp: int) -> None:
    from mindspeed_tft.training.tokenizer import vocab_size_with_padding

    assert plan.padded_vocab_size(vocab, divisible, tp) == vocab_size_with_padding(
        vocab, divisible, tp)


# --- the plan -------------------------------------------------------------------------------


def test_plan_rows_fit_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/design.md's example, 7e9 params per device at d = 8, bf16 grads: with 80 GB and
    10 GB for activations N = 2 (56 GB) fits and N = 4 (84 GB) does not."""
    out = run_plan(["--params", "14B", "--pipeline-model-parallel-size", "2",
                    "--world-size", "16", "--grad-dtype", "bf16", "--device-memory", "80GB",
                    "--activation-memory", "10GB", "--save-interval", "100",
                    "--step-time", "2", "--reload-time", "30"], capsys)
    assert out["layout"]["dp"] == 8 and out["params_per_device"] == 7e9
    rows = {r["row"]: r for r in out["rows"]}
    assert list(rows) == ["native", "no-replica", "N=2", "N=4", "N=8"]
    assert [(r["n"], r["ha"], r["formula"]) for r in rows.values()] == [
        (1, "off", 6.0), (1, "no-replica", 6.0), (2, "on", 8.0), (4, "on", 12.0),
        (8, "on", 20.0)]
    assert rows["N=2"]["state_gib"] == pytest.approx(56e9 / GIB)
    assert rows["N=2"]["total_gib"] == pytest.approx(66e9 / GIB)
    assert [r["fits"] for r in rows.values()] == [True, True, True, False, False]
    assert out["recommendation"] == {
        "row": "N=2", "n": 2, "flags": "--enable-high-availability --optimizer-replica-num 2"}
    assert rows["native"]["lost_seconds"] == 50 * 2 + 30
    assert rows["N=2"]["lost_seconds"] == 2
    assert {k for k in rows["N=2"]} >= {"d", "n", "grad", "ha", "formula"}


def test_plan_default_activation_share_and_no_fit(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_plan(["--params", "7B", "--data-parallel-size", "8", "--device-memory",
                    "64GiB"], capsys)  # fp32 grads; 25% = 16 GiB kept: 48 GiB for state
    assert out["activation_memory_bytes"] == 16 * GIB
    fits = {r["row"]: r["fits"] for r in out["rows"]}
    assert fits == {"native": False, "no-replica": False, "N=2": False, "N=4": False,
                    "N=8": False}  # 7.5 x 7e9 = 48.9 GiB
    assert out["recommendation"]["row"] is None
    assert "nothing fits" in plan.render(out)


def test_admissible_replicas_follow_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_plan(["--params", "1B", "--data-parallel-size", "3",
                    "--context-parallel-size", "4"], capsys)
    assert [r["n"] for r in out["rows"] if r["ha"] == "on"] == [2, 3, 4, 6, 12]
    out = run_plan(["--params", "1B", "--data-parallel-size", "12",
                    "--optimizer-replica-num", "6", "--optimizer-replica-num", "1"], capsys)
    assert [r["row"] for r in out["rows"]] == ["native", "no-replica", "N=6"]
    out = run_plan(["--params", "1B", "--data-parallel-size", "1"], capsys)
    assert [r["row"] for r in out["rows"]] == ["native"]
    assert "data-parallel size >= 2" in out["high_availability_refused"]


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--params", "7B", "--data-parallel-size", "8", "--grad-dtype", "bf16",
                      "--device-memory", "80GB", "--activation-memory", "10GB"]) == 0
    text = capsys.readouterr().out
    assert "N=2        on           2      8.0000      52.15" in text
    assert "recommendation: N=2 (--enable-high-availability --optimizer-replica-num 2)" in text


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan.main(["--help"])
    assert exc.value.code == 0
    assert "--device-memory" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "words"), [
    (["--params", "7B", "--data-parallel-size", "4", "--optimizer-replica-num", "3"],
     ["--optimizer-replica-num 3", "divisor", "1, 2, 4"]),
    (["--params", "7B", "--data-parallel-size", "4", "--device-memory", "80G"],
     ["--device-memory", "'80G'", "GiB"]),
    (["--params", "7B", "--data-parallel-size", "-4"], ["--data-parallel-size", "'-4'"]),
    (["--params=-7B", "--data-parallel-size", "4"], ["--params", "'-7B'"]),
    (["--params", "7B"], ["--data-parallel-size or --world-size"]),
    (["--params", "7B", "--hidden-size", "128", "--data-parallel-size", "2"],
     ["--params", "--hidden-size", "not both"]),
    (["--hidden-size", "128", "--data-parallel-size", "2"],
     ["--num-layers", "--num-attention-heads", "--vocab-size"]),
    (["--preset", "nope", "--data-parallel-size", "2"], ["--preset 'nope'", "tiny"]),
    (["--params", "7B", "--world-size", "6", "--tensor-model-parallel-size", "4"],
     ["--world-size 6", "TP x PP x CP = 4"]),
    (["--params", "7B", "--data-parallel-size", "2", "--activation-memory", "8GiB"],
     ["--activation-memory needs --device-memory"]),
    (["--params", "7B", "--data-parallel-size", "2", "--device-memory", "8GiB",
      "--activation-memory", "100%"], ["--activation-memory", "'100%'"]),
    (["--params", "7B", "--data-parallel-size", "2", "--step-time", "nan"], ["--step-time"]),
])
def test_usage_errors(argv: list[str], words: list[str],
                      capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(argv, capsys)
    for word in words:
        assert word in err


# --- against bench/memory.py ----------------------------------------------------------------


def load_memory_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_memory", MEMORY_BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


#: a smaller model than the bench's default (vocabulary kept: mock data needs 4095 ids)
SIZE = ["--layers", "2", "--hidden", "128", "--ffn", "352", "--seq", "32"]


@pytest.mark.multiproc
def test_plan_matches_bench_memory(tmp_path: Path) -> None:
    """Two 2-rank jobs of bench/memory.py, native with bf16 grads (4 + 16/2 = 12 bytes) and
    N = 2 with fp32 grads (6 + 12 = 18): the plan of the same model flags and layout gives
    the parameter count the jobs hold and their measured bytes per parameter within 1%."""
    memory = load_memory_bench()
    model_flags = memory.model_args(memory.build_parser().parse_args(SIZE))
    start = time.monotonic()
    measured = []
    for replicas, grad in (("1", "bf16"), ("2", "fp32")):
        argv = ["--dims", "2", "--replicas", replicas, "--grads", grad, *SIZE,
                "--timeout", "120", "--keep", str(tmp_path / f"n{replicas}")]
        job = subprocess.run([sys.executable, str(MEMORY_BENCH), *argv], cwd=REPO,
                             capture_output=True, text=True, timeout=180)
        assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
        measured += json.loads(job.stdout.splitlines()[-1])["rows"]
    wall = time.monotonic() - start
    assert [(r["n"], r["grad"], r["ha"]) for r in measured] == [(1, "bf16", "off"),
                                                                (2, "fp32", "on")]
    for row in measured:
        parser, args = plan.parse(["--data-parallel-size", str(row["d"]), "--grad-dtype",
                                   row["grad"], "--optimizer-replica-num", str(row["n"])],
                                  model_args=model_flags)
        planned = plan.make_plan(parser, args)
        assert planned["params"] == row["num_params"]
        (same,) = [r for r in planned["rows"] if (r["n"], r["ha"]) == (row["n"], row["ha"])]
        assert abs(same["formula"] - row["measured"]) <= 0.01 * row["measured"], (same, row)
        print(f"d={row['d']} N={row['n']} {row['grad']} {row['ha']}: plan "
              f"{same['formula']:.4f} measured {row['measured']:.6f} B/param, "
              f"{planned['params']} params")
    print(f"bench/memory.py: 2 jobs in {wall:.1f} s")
