# Llama2-7B model preset (Megatron-LM flags), as in MindIO TFT's reference script.
# Sourced by scripts/pretrain_llama2_7b_ptd.sh; defines MODEL_ARGS. --vocab-size is Llama-2's
# tokenizer's 32,000 pieces: training with --tokenizer-type Llama2Tokenizer takes the size from
# the tokenizer model (the flag is ignored), `tft-plan --preset llama2-7b` counts with it.
MODEL_ARGS="
    --use-mcore-models
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 11008
    --num-attention-heads 32
    --seq-length 4096
    --max-position-embeddings 4096
    --vocab-size 32000
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
