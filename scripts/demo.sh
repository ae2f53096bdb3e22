#!/usr/bin/env bash
# Demo: fault-tolerant training of a tiny Llama-shaped GPT on 4 CPU ranks (gloo).
#
# 1. Trains 20 iterations with mindspeed-tft's high-availability flags under `tft-run`
#    (a warm spare per node) and kills rank 1 (SIGKILL) halfway, in its backward pass.
#    The launcher restarts only that worker, the survivors rebuild their process groups
#    with it, it receives its model params and optimizer shard from a replica, everyone
#    rolls back to the last completed step, and training goes on.
# 2. Prints what happened, phase by phase, from the job's events file, and the goodput;
#    draws the recovery timeline (faulty/timeline.png, beside the events file).
# 3. Trains the same job without a fault, checks that every loss is the same, and draws
#    the timeline again with the fault-free run's loss curve.
# Sets up .venv on first use. Writes under runs/demo/.
#
#   ./scripts/demo.sh                     # the reference trainer (pretrain_gpt.py here)
#   ./scripts/demo.sh --megatron-lm DIR   # the same story in Megatron-LM's own training
#       loop: the unchanged pretrain_gpt.py of the Megatron-LM clone DIR (core_v0.12.1),
#       run by tft-run through the adaptor (scripts/pretrain_megatron_lm_cpu.sh). A
#       read-only DIR is copied once under the demo dir. Writes under runs/demo-megatron-lm/.
#   sudo ./scripts/demo.sh --hosts 3      # (root) the same tiny job over 3 hosts of a test bed
#       (network namespaces on a bridge: mindspeed_tft.tools.testbed), 2 ranks each, one
#       tft-run launcher per host with the multi-node settings; the last host dies partway
#       (all its processes killed, its link down), a replacement launcher rejoins and the job
#       finishes. Prints each host's settings, then what happened. scripts/demo_hosts.py
#       drives it. Writes under runs/demo-hosts/.
# Third-party warnings that every rank prints about its environment (megatron-core without
# Apex or Transformer Engine, torch deprecations) are left out of the screen (below); the
# plugin's lines, the training's and any error stay.
set -euo pipefail

usage() {
    echo "usage: $0 [--megatron-lm DIR | --hosts N]" >&2
    echo "  --megatron-lm DIR  run in Megatron-LM's own training loop from the clone DIR" >&2
    echo "  --hosts N          (root) run over N hosts (2..64) of a test bed and lose the last" >&2
}
MEGATRON_LM_SRC=""
HOSTS=""
check_hosts() {
    case "$1" in
        ''|*[!0-9]*) echo "$0: --hosts '$1': expected a number of hosts, 2 to 64" >&2; usage; exit 2 ;;
    esac
    local n="${1#"${1%%[!0]*}"}"  # without leading zeros
    [ "${#n}" -le 2 ] && [ "${n:-0}" -ge 2 ] && [ "${n}" -le 64 ] || {
        echo "$0: --hosts $1: the multi-host demo needs 2 to 64 hosts" >&2; usage; exit 2; }
    HOSTS="${n}"
}
while [ $# -gt 0 ]; do
    case "$1" in
        --megatron-lm)
            [ $# -ge 2 ] && [ -n "$2" ] || { echo "$0: --megatron-lm needs a directory" >&2; usage; exit 2; }
            MEGATRON_LM_SRC="$2"; shift 2 ;;
        --megatron-lm=*)
            MEGATRON_LM_SRC="${1#*=}"
            [ -n "${MEGATRON_LM_SRC}" ] || { echo "$0: --megatron-lm needs a directory" >&2; usage; exit 2; }
            shift ;;
        --hosts)
            [ $# -ge 2 ] || { echo "$0: --hosts needs a number of hosts, 2 to 64" >&2; usage; exit 2; }
            check_hosts "$2"; shift 2 ;;
        --hosts=*)
            check_hosts "${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "$0: unknown option '$1'" >&2; usage; exit 2 ;;
    esac
done
if [ -n "${MEGATRON_LM_SRC}" ]; then
    [ -f "${MEGATRON_LM_SRC}/pretrain_gpt.py" ] || {
        echo "$0: --megatron-lm ${MEGATRON_LM_SRC}: no pretrain_gpt.py there (expected a" \
             "Megatron-LM clone, core_v0.12.1)" >&2
        exit 2
    }
    MEGATRON_LM_SRC="$(cd "${MEGATRON_LM_SRC}" && pwd)"  # before the cd below
fi
if [ -n "${HOSTS}" ]; then
    [ -z "${MEGATRON_LM_SRC}" ] || {
        echo "$0: --hosts runs the reference trainer only; leave out --megatron-lm" >&2; exit 2; }
    [ "$(id -u)" -eq 0 ] || {
        echo "$0: --hosts needs root (it makes network namespaces, veth pairs and a bridge):" \
             "sudo $0 --hosts ${HOSTS}" >&2
        exit 2
    }
fi

cd "$(dirname "$0")/.."
source scripts/setup_env.sh

# What every rank prints about its environment rather than the run: megatron-core on a machine
# without Apex or Transformer Engine, torch's deprecation of the all-gather megatron-core
# binds, and (Megatron-LM's loop) its data loader's pin_memory without an accelerator and its
# own deprecated fp8 argument. Python's warning filters drop exactly these messages in the
# job's processes; warnings about the run's flags stay. `quiet` drops two lines of other
# libraries: megatron-core's note that the mock dataset has no cache folder (for every
# dataset split, again in a restarted rank) and, on the hosts of --hosts, torch's note that a
# peer's address has no host name (every process: the test bed's hosts have no name
# service). Nothing else goes: the plugin's lines, the training's and any error stay.
_demo_warnings=(
    "ignore:Apex is not installed:UserWarning"
    "ignore:Transformer Engine and Apex are not installed:UserWarning"
    'ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning'
    "ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning"
    "ignore:The fp8 argument in:UserWarning"
)
PYTHONWARNINGS="$(IFS=,; echo "${_demo_warnings[*]}")${PYTHONWARNINGS:+,${PYTHONWARNINGS}}"
export PYTHONWARNINGS
export PYTHONUNBUFFERED=1  # the job's lines reach the screen as they come, through `quiet`
quiet() {
    grep --line-buffered -v -F \
        -e "Unable to save MockGPTDataset indexes because path_to_cache is None" \
        -e "[c10d] The hostname of the client socket cannot be retrieved. err=" || true
}

if [ -n "${HOSTS}" ]; then
    DEMO_DIR="${DEMO_DIR:-$PWD/runs/demo-hosts}"
    rm -rf "${DEMO_DIR}"
    mkdir -p "${DEMO_DIR}"
    python scripts/demo_hosts.py --hosts "${HOSTS}" --demo-dir "${DEMO_DIR}" \
        --train-iters "${TRAIN_ITERS:-20}" --save-interval "${SAVE_INTERVAL:-10}" 2>&1 | quiet
    exit "${PIPESTATUS[0]}"
fi

if [ -z "${MEGATRON_LM_SRC}" ]; then
    DEMO_DIR="${DEMO_DIR:-$PWD/runs/demo}"
    TRAIN=./scripts/pretrain_tiny_cpu.sh
    WHERE="4 CPU ranks"
else
    DEMO_DIR="${DEMO_DIR:-$PWD/runs/demo-megatron-lm}"
    TRAIN=./scripts/pretrain_megatron_lm_cpu.sh
    WHERE="Megatron-LM's own pretrain_gpt.py, 4 CPU ranks"
fi
rm -rf "${DEMO_DIR}"
export TRAIN_ITERS="${TRAIN_ITERS:-20}" SAVE_INTERVAL="${SAVE_INTERVAL:-10}"
export HA_ARGS="--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot"
export LAUNCHER="tft-run --tft-spares-per-node 1"
STEP=$((TRAIN_ITERS / 2))

if [ -n "${MEGATRON_LM_SRC}" ]; then
    # Megatron-LM compiles its dataset helpers into its own tree: one writable copy for both
    # runs (one compile), unless the clone itself is writable (by its mode bits too: root
    # passes -w on a read-only tree)
    MEGATRON_LM="${MEGATRON_LM_SRC}"
    if [ ! -w "${MEGATRON_LM}/megatron/core/datasets" ] \
        || [ -z "$(find "${MEGATRON_LM}/megatron/core/datasets" -maxdepth 0 -perm -u=w)" ]; then
        MEGATRON_LM="${DEMO_DIR}/megatron-lm"
        echo "[demo] ${MEGATRON_LM_SRC} is read-only: copying it to ${MEGATRON_LM}"
        mkdir -p "${DEMO_DIR}"
        cp -r "${MEGATRON_LM_SRC}" "${MEGATRON_LM}"
        chmod -R u+w "${MEGATRON_LM}"
    fi
    # tft-run sees a Megatron-LM script and runs it through the adaptor itself
    export MEGATRON_LM ENTRY=""
    echo "[demo] Megatron-LM: ${MEGATRON_LM_SRC}"
fi

echo "[demo] 1/3: ${WHERE}, DP=4, distributed optimizer with 2 replicas;"
echo "[demo]      rank 1 is killed (SIGKILL) at step ${STEP} of ${TRAIN_ITERS}, in its backward pass"
RUN_DIR="${DEMO_DIR}/faulty" TFT_INJECT_STATE_DIR="${DEMO_DIR}/faulty/inject" \
    TFT_INJECT="kill:rank=1,step=${STEP},phase=backward" "${TRAIN}" 2>&1 | quiet

echo
echo "[demo] 2/3: what happened (from ${DEMO_DIR}/faulty/events.jsonl)"
TIMELINE="${DEMO_DIR}/faulty/timeline.png"
python -m mindspeed_tft.report "${DEMO_DIR}/faulty/events.jsonl" --plot "${TIMELINE}"

echo
echo "[demo] 3/3: the same training without a fault, for comparison"
RUN_DIR="${DEMO_DIR}/fault-free" "${TRAIN}" > "${DEMO_DIR}/fault-free.log" 2>&1 \
    || { tail -30 "${DEMO_DIR}/fault-free.log"; exit 1; }
python -m mindspeed_tft.report "${DEMO_DIR}/faulty/events.jsonl" \
    --compare "${DEMO_DIR}/fault-free/events.jsonl" --plot "${TIMELINE}" | tail -1
echo "[demo] recovery timeline (with the fault-free run's loss): ${TIMELINE}"
