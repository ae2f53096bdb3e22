"""The GPT model of the reference trainer: megatron-core's GPTModel, configured from args.

`transformer_config_from_args` maps Megatron-LM's flags onto megatron-core's
TransformerConfig (RoPE, RMSNorm, SwiGLU, bias, dropout, precision, parallelism) the way
Megatron-LM's `core_transformer_config_from_args` does. `gpt_model_provider` builds the model
chunk for this pipeline stage with megatron-core's local layer spec (no Transformer Engine).

megatron-core's torch-norm wrapper refuses sequence parallelism; `SequenceParallelTorchNorm`
is the same torch norm with its parameters marked `sequence_parallel`, so megatron-core's
`finalize_model_grads` all-reduces their gradients over the tensor-parallel group, as it does
for its fused norms.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelTorchNorm:
    """torch.nn.LayerNorm / torch.nn.RMSNorm built from a TransformerConfig, usable with
    sequence parallelism (its weights are marked so their grads are reduced over TP)."""

    # Megatron's build_module instantiates the spec's class: `__new__` returns the torch norm
    # itself, not an instance of this class (which the type checker refuses)
    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        **_: object,
    ) -> torch.nn.Module:
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization {config.normalization!r} is not supported; "
                "allowed: LayerNorm, RMSNorm"
            )
        for param in norm.parameters():
            # Megatron's own mark on a parameter (torch's Parameter type does not declare it)
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """megatron-core's TransformerConfig for Megatron-LM's flags."""
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        # Fused kernels need CUDA/TE/apex; the local layers run unfused everywhere.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=args.use_cpu_initialization,
        perform_initialization=getattr(args, "perform_initialization", True),
        deterministic_mode=False,
    )


def gpt_layer_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """megatron-core's local GPT layer spec with norms that support sequence parallelism."""
    layer_spec = get_gpt_layer_local_spec(normalization=config.normalization)
    layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    num_layers = config.num_layers // config.pipeline_model_parallel_size
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelTorchNorm
    )


def gpt_model_provider(
    args: argparse.Namespace, pre_process: bool = True, post_process: bool = True
) -> GPTModel:
    """The GPT model chunk of this rank's pipeline stage."""
    config = transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    return model

