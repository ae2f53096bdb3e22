"""One bench, several Megatron-LM clones, side by side in one run: the figures of core_v0.12.1
and core_v0.16.1 (or any clones) measured on the same machine in the same minutes.

It runs `bench/recovery.py` or `bench/overhead.py` with `--host megatron-lm DIR` once per
clone and round, the clones' order alternating from round to round (A B, then B A: a drift of
the machine's speed during the run weighs on both alike), and reports per clone the median
over rounds of each figure, and the ratio of each figure between the clones (the later clone
over the first). The bench's own arguments come after `--`; each run gets `--repeats 1`
(recovery) or its own `--rounds` (overhead).

    python bench/hosts.py --rounds 2 ../shared/megatron-lm ../shared/megatron-lm-0.16.1 \\
        -- recovery --quick
    python bench/hosts.py ../shared/megatron-lm ../shared/megatron-lm-0.16.1 \\
        -- overhead --quick --hidden 512 --ffn 1408

Output: one line per run as it ends, then a table, then as the last line one JSON object
`{"bench", "args", "rounds", "clones": [{"dir", "version", "runs", "figures": {name: median}}],
"ratios": {name: later / first}}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: the figures each bench reports (recovery: each of them per size)
FIGURES = {
    "recovery": ("arf_s", "arf_cold_s", "baseline_s", "ratio", "uce_s", "step_s",
                 "arf_lost_iterations", "bit_exact"),
    "overhead": ("step_ms_off", "step_ms_on", "ratio", "ratio_interval_90"),
}


def clone_version(clone: Path) -> str:
    """The megatron-core version of a Megatron-LM clone (its `package_info.py`)."""
    info: dict[str, Any] = {}
    exec((clone / "megatron" / "core" / "package_info.py").read_text(), info)  # noqa: S102
    return f"{info['MAJOR']}.{info['MINOR']}.{info['PATCH']}"


def run_bench(bench: str, args: list[str], clone: Path, timeout: float) -> dict[str, Any]:
    """One run of `bench` in `clone`'s loop: the figures of its last (JSON) line."""
    extra = ["--repeats", "1"] if bench == "recovery" and "--repeats" not in args else []
    cmd = [sys.executable, str(HERE / f"{bench}.py"), *args, *extra,
           "--host", "megatron-lm", str(clone)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode not in (0, 1) or not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n"
                         + (done.stdout + done.stderr)[-3000:])
    result = json.loads(lines[-1])
    if bench == "overhead":
        return {name: result.get(name) for name in FIGURES[bench]}
    # recovery: every size of the run (--sizes), its figures named "<size> <figure>"
    return {f"{size['size']} {name}": size.get(name) for size in result["sizes"]
            for name in FIGURES[bench]}


def median(values: list[Any]) -> Any:
    """The median of numbers; for flags, whether every run had it; for intervals, the median
    of each end."""
    if all(isinstance(v, bool) for v in values):
        return all(values)
    if values and all(isinstance(v, list) for v in values):
        return [median(list(ends)) for ends in zip(*values, strict=True)]
    numbers = [v for v in values if isinstance(v, int | float)]
    return round(statistics.median(numbers), 4) if numbers else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clones", nargs="+", type=Path, help="Megatron-LM clones, 2 or more")
    parser.add_argument("--rounds", type=int, default=1, help="runs per clone")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:split])
    if split == len(argv):
        parser.error("give the bench and its arguments after --, e.g. -- recovery --quick")
    bench, *args = argv[split + 1:] or [""]
    if bench not in FIGURES:
        parser.error(f"bench {bench!r} after --: expected one of {', '.join(FIGURES)}")
    if len(opts.clones) < 2:
        parser.error("give at least two clones to compare")
    runs: dict[Path, list[dict[str, Any]]] = {clone: [] for clone in opts.clones}
    for rnd in range(opts.rounds):
        order = opts.clones if rnd % 2 == 0 else list(reversed(opts.clones))
        for clone in order:
            figures = run_bench(bench, args, clone, opts.timeout)
            runs[clone].append(figures)
            print(f"round {rnd + 1} {clone_version(clone)}: {json.dumps(figures)}", flush=True)
    names = list(runs[opts.clones[0]][0])
    clones = [{"dir": str(clone), "version": clone_version(clone), "runs": runs[clone],
               "figures": {name: median([r.get(name) for r in runs[clone]]) for name in names}}
              for clone in opts.clones]
    first, last = clones[0]["figures"], clones[-1]["figures"]
    ratios = {name: round(last[name] / first[name], 4) for name in names
              if isinstance(first[name], int | float) and not isinstance(first[name], bool)
              and first[name] and isinstance(last[name], int | float)}
    print(f"\n{bench} {' '.join(args)}: median of {opts.rounds} round(s)")
    print("| figure | " + " | ".join(c["version"] for c in clones) + " |")
    print("|---|" + "---|" * len(clones))
    for name in names:
        print(f"| {name} | " + " | ".join(str(c["figures"][name]) for c in clones) + " |")
    print(json.dumps({"bench": bench, "args": args, "rounds": opts.rounds, "clones": clones,
                      "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
