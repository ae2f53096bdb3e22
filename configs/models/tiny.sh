# Tiny Llama-shaped model preset for CPU runs (demo, tests, benchmarks): same architecture
# flags as configs/models/llama2-7b.sh at a size a laptop trains in seconds.
# Sourced by scripts/pretrain_tiny_cpu.sh and scripts/pretrain_megatron_lm_cpu.sh (after they
# set GBS and TRAIN_ITERS); defines MODEL_ARGS and TRAIN_ARGS, the training flags both hosts
# share (the guide's Llama2 script's, at this size), so their losses can be compared.
# TINY_NUM_LAYERS, TINY_HIDDEN_SIZE, TINY_FFN_HIDDEN_SIZE, TINY_SEQ_LENGTH resize it (the
# benchmarks' size knobs); TINY_PRECISION=fp32 drops --bf16 (for CPUs without native bf16,
# where bf16 matmuls are emulated and dozens of times slower than fp32).
case "${TINY_PRECISION:-bf16}" in
    bf16) TINY_PRECISION_ARGS="--bf16" ;;
    fp32) TINY_PRECISION_ARGS="" ;;
    *) echo "TINY_PRECISION=${TINY_PRECISION}: allowed: bf16, fp32" >&2; exit 2 ;;
esac
MODEL_ARGS="
    --use-mcore-models
    --num-layers ${TINY_NUM_LAYERS:-4}
    --hidden-size ${TINY_HIDDEN_SIZE:-64}
    --ffn-hidden-size ${TINY_FFN_HIDDEN_SIZE:-176}
    --num-attention-heads 4
    --seq-length ${TINY_SEQ_LENGTH:-64}
    --max-position-embeddings ${TINY_SEQ_LENGTH:-64}
    --make-vocab-size-divisible-by 1
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --init-method-std 0.01
    --hidden-dropout 0.0
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
"
TRAIN_ARGS="
    --micro-batch-size 2
    --global-batch-size ${GBS:-16}
    --lr 1e-3
    --train-iters ${TRAIN_ITERS:-40}
    --lr-decay-style cosine
    --no-masked-softmax-fusion
    --attention-softmax-in-fp32
    --min-lr 1e-4
    --weight-decay 1e-1
    --lr-warmup-fraction 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --initial-loss-scale 65536
    --adam-beta2 0.95
    --no-gradient-accumulation-fusion
    --overlap-grad-reduce
    ${TINY_PRECISION_ARGS}
    --seed 1234
"
