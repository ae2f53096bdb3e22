"""Tokenizers for the bundled GPT trainer, selected by Megatron-LM's `--tokenizer-type` names.

`build_tokenizer(args)` returns a `MegatronTokenizer`, megatron-core's abstract tokenizer (what
its datasets take; `MegatronLegacyTokenizer` in 0.16.1, `megatron_version.tokenizer_base`) and sets `args.padded_vocab_size` the way Megatron-LM does.
Supported types, with the meaning they have in Megatron-LM:

- `Llama2Tokenizer` (`--tokenizer-model m.model`): a sentencepiece model; `tokenize` prepends
  BOS (no EOS), `eod` is the model's EOS id, `bos`/`eos`/`pad` are the model's own ids (pad is
  -1 when the model has none), vocab size is the model's piece count.
- `GPTSentencePieceTokenizer` (`--tokenizer-model m.model`): the same model, no BOS added.
- `NullTokenizer` (`--vocab-size N`): text is space-separated integer ids; the vocabulary has
  N + 1 entries and the extra one, id N, is the end-of-document token.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import sentencepiece

from mindspeed_tft.platform import megatron_version

if TYPE_CHECKING:  # the type checker reads the venv's megatron-core (0.12.1)
    from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
else:
    MegatronTokenizer = megatron_version.tokenizer_base()

SUPPORTED_TOKENIZER_TYPES = ("Llama2Tokenizer", "GPTSentencePieceTokenizer", "NullTokenizer")

# Megatron-LM's defaults for the two arguments that decide the padded vocabulary size.
DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
DEFAULT_TENSOR_MODEL_PARALLEL_SIZE = 1


class _SentencePieceModelTokenizer(MegatronTokenizer):
    """Shared part of the sentencepiece tokenizers: loads the model and exposes its vocabulary."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.model_path = model_path
        self.processor = _load_sentencepiece_model(model_path)
        self._piece_to_id = {
            self.processor.id_to_piece(token_id): token_id
            for token_id in range(self.processor.get_piece_size())
        }
        self._id_to_piece = {token_id: piece for piece, token_id in self._piece_to_id.items()}

    @property
    def vocab(self) -> dict[str, int]:
        return self._piece_to_id

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._id_to_piece

    @property
    def vocab_size(self) -> int:
        return len(self._piece_to_id)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.processor.decode_ids([int(token_id) for token_id in ids])

    @property
    def bos(self) -> int:
        return self.processor.bos_id()

    @property
    def eos(self) -> int:
        return self.processor.eos_id()

    @property
    def pad(self) -> int:
        return self.processor.pad_id()

    @property
    def eod(self) -> int:
        return self.processor.eos_id()

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self) -> None:
        return None


class Llama2Tokenizer(_SentencePieceModelTokenizer):
    """Megatron-LM's `Llama2Tokenizer`: sentencepiece ids with BOS prepended by default."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize takes a str, got {type(text).__name__}")
        token_ids = self.processor.encode(text)
        if bos:
            token_ids = [self.bos, *token_ids]
        if eos:
            token_ids = [*token_ids, self.eos]
        return token_ids


class GPTSentencePieceTokenizer(_SentencePieceModelTokenizer):
    """Megatron-LM's `GPTSentencePieceTokenizer`: plain sentencepiece ids, EOS is the EOD."""

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode_as_ids(text)


class NullTokenizer(MegatronTokenizer):
    """Megatron-LM's `NullTokenizer`: text is space-separated ids below `vocab_size`.

    The vocabulary has `vocab_size + 1` entries: id `vocab_size` is the end-of-document token.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split(" ")]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(token_id)) for token_id in ids)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        token_starts = []
        position = 0
        for token_id in ids:
            token_starts.append(position)
            position += len(str(token_id)) + 1
        return token_starts

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError("NullTokenizer has no vocabulary of pieces")

    @property
    def inv_vocab(self) -> dict[int, str]:
        raise NotImplementedError("NullTokenizer has no vocabulary of pieces")

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self) -> None:
        return None


def _load_sentencepiece_model(model_path: str | None) -> sentencepiece.SentencePieceProcessor:
    if not model_path:
        raise ValueError(
            "--tokenizer-model is required for the sentencepiece tokenizer types "
            "(Llama2Tokenizer, GPTSentencePieceTokenizer): pass the path of a sentencepiece "
            ".model file"
        )
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"--tokenizer-model {model_path}: no such file")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_path)
    except (OSError, RuntimeError) as error:
        raise ValueError(
            f"--tokenizer-model {model_path}: not a readable sentencepiece model ({error})"
        ) from error
    return processor


def vocab_size_with_padding(
    vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int
) -> int:
    """Round `vocab_size` up to a multiple of `make_vocab_size_divisible_by * tp_size`.

    This is Megatron-LM's padded vocabulary: each tensor-parallel shard of the embedding gets
    the same, hardware-friendly number of rows.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) and "
            f"tensor_model_parallel_size ({tensor_model_parallel_size}) must be positive"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def build_tokenizer(args: argparse.Namespace) -> MegatronTokenizer:
    """Build the tokenizer `args.tokenizer_type` names, and set `args.padded_vocab_size`.

    Like Megatron-LM, `args.padded_vocab_size` is only set when it is not already set (a
    checkpoint's value wins).
    """
    tokenizer_type = args.tokenizer_type
    if tokenizer_type == "Llama2Tokenizer":
        tokenizer: MegatronTokenizer = Llama2Tokenizer(args.tokenizer_model)
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        tokenizer = GPTSentencePieceTokenizer(args.tokenizer_model)
    elif tokenizer_type == "NullTokenizer":
        vocab_size = getattr(args, "vocab_size", None)
        if vocab_size is None:
            raise ValueError(
                "--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids "
                "before the end-of-document token)"
            )
        if int(vocab_size) < 1:
            raise ValueError(f"--vocab-size {vocab_size}: must be a positive integer")
        tokenizer = NullTokenizer(int(vocab_size))
    else:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}"
        )

    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size,
            getattr(args, "make_vocab_size_divisible_by", DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY),
            getattr(args, "tensor_model_parallel_size", DEFAULT_TENSOR_MODEL_PARALLEL_SIZE),
        )
    return tokenizer
