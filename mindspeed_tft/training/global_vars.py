"""Process-wide training globals, in Megatron-LM's manner: the parsed args and the tokenizer.

Megatron-LM's `pretrain_gpt.py` reads `get_args()` and `get_tokenizer()` from anywhere;
the reference trainer keeps the same shape so user code written for Megatron-LM reads alike.
"""

from __future__ import annotations

import argparse
from typing import Any

_ARGS: argparse.Namespace | None = None
_TOKENIZER: Any = None


def set_args(args: argparse.Namespace) -> None:
    """Install the parsed and validated args."""
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The parsed args (after `initialize_megatron`)."""
    if _ARGS is None:
        raise RuntimeError("args are not initialized: call initialize_megatron() first")
    return _ARGS


def set_tokenizer(tokenizer: Any) -> None:
    """Install the tokenizer built from the args."""
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer() -> Any:
    """The tokenizer (after `initialize_megatron`)."""
    if _TOKENIZER is None:
        raise RuntimeError("tokenizer is not initialized: call initialize_megatron() first")
    return _TOKENIZER
