#!/bin/bash
# Llama2-7B pretraining with mindspeed-tft high availability: MindIO TFT's reference script
# (examples/mcore/llama2/pretrain_llama2_7b_ptd.sh of MindSpeed-LLM) for real clusters.
# Set the paths below, TTP_ADDR to the master node's IP, and run on every node with its
# NODE_RANK. It launches with `tft-run` (torchrun's arguments): worker reboot needs a launcher
# that restarts failed workers; LAUNCHER=torchrun works once torchrun is patched with
# scripts/patch_torchrun.sh (plain torchrun refuses --enable-worker-reboot at start-up).

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-enp189s0f0}
export TTP_ADDR=${TTP_ADDR:-"master node ip"}
[ -f /usr/local/Ascend/cann/set_env.sh ] && source /usr/local/Ascend/cann/set_env.sh

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-"your model save ckpt path"}
DATA_PATH=${DATA_PATH:-"your data path"}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-"your tokenizer path"}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-"your model ckpt path"}
TP=${TP:-1}
PP=${PP:-2}
LAUNCHER=${LAUNCHER:-tft-run}

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "${ROOT}/configs/models/llama2-7b.sh"

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    ${MODEL_ARGS} \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --sequence-parallel \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model ${TOKENIZER_MODEL} \
    --micro-batch-size 1 \
    --global-batch-size 256 \
    --lr 1.25e-6 \
    --train-iters 5000 \
    --lr-decay-style cosine \
    --use-fused-rmsnorm \
    --use-flash-attn \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --min-lr 1.25e-7 \
    --weight-decay 1e-1 \
    --lr-warmup-fraction 0.01 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --initial-loss-scale 65536 \
    --adam-beta2 0.95 \
    --no-gradient-accumulation-fusion \
    --no-load-optim \
    --no-load-rng \
    --use-distributed-optimizer \
    --use-fused-swiglu \
    --use-fused-rotary-pos-emb \
    --overlap-grad-reduce \
    --bf16 \
    --enable-high-availability \
    --enable-hbmfault-repair \
    --enable-worker-reboot \
    --distributed-optimizer-no-replica \
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --split 949,50,1
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10 \
"

mkdir -p logs
$LAUNCHER $DISTRIBUTED_ARGS "${ROOT}/pretrain_gpt.py" \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl \
    --load $CKPT_LOAD_DIR \
    --save $CKPT_SAVE_DIR \
    | tee logs/train_llama2_7b.log
