#!/bin/bash
# Megatron-LM's own pretrain_gpt.py (core_v0.12.1, unchanged) with mindspeed-tft, on CPU:
# the tiny Llama-shaped preset, 4 CPU ranks (gloo), mock data, the reference script's flag
# shape plus Megatron-LM's CPU flags.
#   MEGATRON_LM=/path/to/Megatron-LM ./scripts/pretrain_megatron_lm_cpu.sh [extra args]
# Environment knobs (all optional unless said):
#   MEGATRON_LM (required: a Megatron-LM clone; copied to RUN_DIR when it is read-only,
#     once for every launcher of the job that shares RUN_DIR, since Megatron-LM compiles its
#     dataset helpers into its own tree; a tree without
#     megatron/core uses the megatron-core wheel's, whose helpers ship built)
#   ENTRY ("-m mindspeed_tft.megatron": how the adaptor is installed; empty when the script
#     imports mindspeed_tft.megatron_adaptor itself or under tft-run) SCRIPT (pretrain_gpt.py)
#   NPROC (4) TP (1) PP (1) TRAIN_ITERS (20) SAVE_INTERVAL (10) GBS (16) RUN_DIR
#   (runs/megatron-lm) CKPT_DIR LOAD_DIR EVENTS LAUNCHER (tft-run) HA_ARGS EXTRA_ARGS
#   NUM_WORKERS (0: data-loader worker processes per rank, --num-workers)
set -eo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM clone (core_v0.12.1)}"
[ -f "${MEGATRON_LM}/pretrain_gpt.py" ] || { echo "MEGATRON_LM=${MEGATRON_LM}: no pretrain_gpt.py there" >&2; exit 2; }

NPROC=${NPROC:-4}
TP=${TP:-1}
PP=${PP:-1}
TRAIN_ITERS=${TRAIN_ITERS:-20}
SAVE_INTERVAL=${SAVE_INTERVAL:-10}
GBS=${GBS:-16}
RUN_DIR=${RUN_DIR:-${ROOT}/runs/megatron-lm}
CKPT_DIR=${CKPT_DIR:-${RUN_DIR}/ckpt}
EVENTS=${EVENTS:-${RUN_DIR}/events.jsonl}
LAUNCHER=${LAUNCHER:-tft-run}
ENTRY=${ENTRY-"-m mindspeed_tft.megatron"}
SCRIPT=${SCRIPT:-pretrain_gpt.py}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
HA_ARGS=${HA_ARGS-"--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot"}

mkdir -p "${RUN_DIR}"
MLM="${MEGATRON_LM}"
# (by the mode bits too: root passes -w on a read-only tree)
if [ -d "${MLM}/megatron/core/datasets" ] && { [ ! -w "${MLM}/megatron/core/datasets" ] \
    || [ -z "$(find "${MLM}/megatron/core/datasets" -maxdepth 0 -perm -u=w)" ]; }; then
    MLM="${RUN_DIR}/megatron-lm"
    if [ ! -d "${MLM}" ]; then
        # copied aside, then renamed into place: the launchers of several nodes sharing
        # RUN_DIR (a test bed of hosts) never run a half-made copy; the second rename fails
        cp -r "${MEGATRON_LM}" "${MLM}.$$" && chmod -R u+w "${MLM}.$$"
        mv -T "${MLM}.$$" "${MLM}" 2>/dev/null || rm -rf "${MLM}.$$"
    fi
fi

# The guide's Llama2 script shape on Megatron-LM's flags, at the tiny preset's size.
# --sequence-parallel only with TP 1 (where Megatron-LM turns it off itself): with TP > 1
# megatron-core's torch RMSNorm, the one there is without Apex / Transformer Engine (CPU),
# refuses sequence parallelism.
if [ "${TP}" = 1 ]; then SP_ARGS=${SP_ARGS-"--sequence-parallel"}; else SP_ARGS=${SP_ARGS-""}; fi
source "${ROOT}/configs/models/tiny.sh"
GPT_ARGS="
    ${MODEL_ARGS/--use-mcore-models/}
    --tensor-model-parallel-size ${TP}
    --pipeline-model-parallel-size ${PP}
    ${SP_ARGS}
    --tokenizer-type NullTokenizer --vocab-size 4096
    ${TRAIN_ARGS}
    --use-distributed-optimizer
    ${HA_ARGS}
"
CPU_ARGS="--transformer-impl local --no-rope-fusion --no-bias-swiglu-fusion
    --no-persist-layer-norm --num-workers ${NUM_WORKERS:-0}"
DATA_ARGS="--mock-data --split 949,50,1"
OUTPUT_ARGS="
    --log-interval 1
    --save-interval ${SAVE_INTERVAL}
    --eval-interval 1000
    --eval-iters 0
    --tft-events-file ${EVENTS}
"
LOAD_ARGS=""
[ -n "${LOAD_DIR}" ] && LOAD_ARGS="--load ${LOAD_DIR}"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # as the guide's script (TP needs it)
export TTP_LOG_PATH=${TTP_LOG_PATH:-${RUN_DIR}/ttp_logs}
export PYTHONPATH="${MLM}${PYTHONPATH:+:${PYTHONPATH}}"
cd "${RUN_DIR}"
# shellcheck disable=SC2086
$LAUNCHER --nproc-per-node "${NPROC}" --master-port "${MASTER_PORT}" ${ENTRY} "${MLM}/${SCRIPT}" \
    $GPT_ARGS $CPU_ARGS $DATA_ARGS $OUTPUT_ARGS \
    --distributed-backend nccl \
    --save "${CKPT_DIR}" $LOAD_ARGS ${EXTRA_ARGS} "$@"
