#!/usr/bin/env bash
# Demo: fault-tolerant training of a tiny Llama-shaped GPT on 4 CPU ranks (gloo).
#
# 1. Trains 20 iterations with mindspeed-tft's high-availability flags under `tft-run`
#    (a warm spare per node) and kills rank 1 (SIGKILL) halfway, in its backward pass.
#    The launcher restarts only that worker, the survivors rebuild their process groups
#    with it, it receives its model params and optimizer shard from a replica, everyone
#    rolls back to the last completed step, and training goes on.
# 2. Prints what happened, phase by phase, from the job's events file.
# 3. Trains the same job without a fault and checks that every loss is the same.
# Sets up .venv on first use. Writes under runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

DEMO_DIR="${DEMO_DIR:-$PWD/runs/demo}"
rm -rf "${DEMO_DIR}"
export TRAIN_ITERS="${TRAIN_ITERS:-20}" SAVE_INTERVAL="${SAVE_INTERVAL:-10}"
export HA_ARGS="--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot"
export LAUNCHER="tft-run --tft-spares-per-node 1"
STEP=$((TRAIN_ITERS / 2))

echo "[demo] 1/3: 4 CPU ranks, DP=4, distributed optimizer with 2 replicas;"
echo "[demo]      rank 1 is killed (SIGKILL) at step ${STEP} of ${TRAIN_ITERS}, in its backward pass"
RUN_DIR="${DEMO_DIR}/faulty" TFT_INJECT_STATE_DIR="${DEMO_DIR}/faulty/inject" \
    TFT_INJECT="kill:rank=1,step=${STEP},phase=backward" ./scripts/pretrain_tiny_cpu.sh

echo
echo "[demo] 2/3: what happened (from ${DEMO_DIR}/faulty/events.jsonl)"
python -m mindspeed_tft.report "${DEMO_DIR}/faulty/events.jsonl"

echo
echo "[demo] 3/3: the same training without a fault, for comparison"
RUN_DIR="${DEMO_DIR}/fault-free" ./scripts/pretrain_tiny_cpu.sh > "${DEMO_DIR}/fault-free.log" 2>&1 \
    || { tail -30 "${DEMO_DIR}/fault-free.log"; exit 1; }
python -m mindspeed_tft.report "${DEMO_DIR}/faulty/events.jsonl" \
    --compare "${DEMO_DIR}/fault-free/events.jsonl" | tail -1
