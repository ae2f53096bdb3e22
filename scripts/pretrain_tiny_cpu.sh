#!/bin/bash
# The reference Llama2 script's flag set on a tiny model: 4 CPU ranks (gloo), mock data.
# Environment knobs (all optional):
#   NPROC (4) TP (1) PP (1) TRAIN_ITERS (40) SAVE_INTERVAL (20) GBS (16)
#   CKPT_DIR (runs/tiny/ckpt) LOAD_DIR (empty: no --load) EVENTS (runs/tiny/events.jsonl)
#   LAUNCHER (tft-run: worker reboot needs it; torchrun for the dump and in-place repairs)
#   HA_ARGS (the high-availability flags) EXTRA_ARGS
#   DIST_OPT_ARGS (--use-distributed-optimizer; set it empty for the bf16 optimizer)
#   DATA_ARGS (--mock-data --split 949,50,1) TOKENIZER_ARGS (NullTokenizer, vocab 4096)
#   NUM_WORKERS (0: data-loader worker processes per rank, --num-workers)
# Extra command-line arguments are passed to pretrain_gpt.py.
set -eo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

NPROC=${NPROC:-4}
TP=${TP:-1}
PP=${PP:-1}
TRAIN_ITERS=${TRAIN_ITERS:-40}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
GBS=${GBS:-16}
RUN_DIR=${RUN_DIR:-${ROOT}/runs/tiny}
CKPT_DIR=${CKPT_DIR:-${RUN_DIR}/ckpt}
EVENTS=${EVENTS:-${RUN_DIR}/events.jsonl}
LAUNCHER=${LAUNCHER:-tft-run}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
HA_ARGS=${HA_ARGS:-"--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot"}

source "${ROOT}/configs/models/tiny.sh"
GPT_ARGS="
    ${MODEL_ARGS}
    --tensor-model-parallel-size ${TP}
    --pipeline-model-parallel-size ${PP}
    --sequence-parallel
    ${TOKENIZER_ARGS:-"--tokenizer-type NullTokenizer --vocab-size 4096"}
    ${TRAIN_ARGS}
    --use-fused-rmsnorm
    --use-flash-attn
    ${DIST_OPT_ARGS-"--use-distributed-optimizer"}
    --use-fused-swiglu
    --use-fused-rotary-pos-emb
    ${HA_ARGS}
"
# --num-workers 0 keeps data-loader processes out of small runs (Megatron-LM's default is 2)
DATA_ARGS=${DATA_ARGS:-"--mock-data --split 949,50,1"}" --num-workers ${NUM_WORKERS:-0}"
OUTPUT_ARGS="
    --log-interval 1
    --save-interval ${SAVE_INTERVAL}
    --eval-interval 1000
    --eval-iters 0
    --tft-events-file ${EVENTS}
"
LOAD_ARGS=""
[ -n "${LOAD_DIR}" ] && LOAD_ARGS="--load ${LOAD_DIR}"

mkdir -p "${RUN_DIR}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TTP_LOG_PATH=${TTP_LOG_PATH:-${RUN_DIR}/ttp_logs}
$LAUNCHER --nproc-per-node "${NPROC}" --master-port "${MASTER_PORT}" "${ROOT}/pretrain_gpt.py" \
    $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS \
    --distributed-backend nccl \
    --save "${CKPT_DIR}" $LOAD_ARGS ${EXTRA_ARGS} "$@"
