# Tiny Llama-shaped model preset for CPU runs (demo, tests, benchmarks): same architecture
# flags as configs/models/llama2-7b.sh at a size a laptop trains in seconds.
# Sourced by scripts/pretrain_tiny_cpu.sh; defines MODEL_ARGS.
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
