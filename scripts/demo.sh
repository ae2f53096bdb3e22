#!/usr/bin/env bash
# Demo: train the tiny Llama-shaped model on 4 CPU ranks (gloo) with mindspeed-tft's
# high-availability flags, printing Megatron's log lines. Sets up .venv on first use.
# Knobs: TRAIN_ITERS (default 20); the demo writes under runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

export RUN_DIR="${RUN_DIR:-$PWD/runs/demo}"
export TRAIN_ITERS="${TRAIN_ITERS:-20}"
export SAVE_INTERVAL="${SAVE_INTERVAL:-10}"
rm -rf "${RUN_DIR}"
echo "[demo] 4 CPU ranks, DP=4, distributed optimizer with 2 replicas; events: ${RUN_DIR}/events.jsonl"
./scripts/pretrain_tiny_cpu.sh
echo "[demo] done: checkpoints in ${RUN_DIR}/ckpt, events in ${RUN_DIR}/events.jsonl"
