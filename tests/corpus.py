"""Test helper: a tiny, deterministic English-like corpus, its sentencepiece model and dataset.

`build_tiny_corpus(tmpdir)` writes a JSON-lines corpus generated from word lists with a fixed
seed, trains a small Llama2-style sentencepiece model on it (unk=0, bos=1, eos=2, no pad) and
tokenizes it with `scripts/preprocess_data.py` into a megatron-core `.bin/.idx` dataset. Nothing
is downloaded. The result is cached by content: a second call with the same arguments in the
same process, or on a `tmpdir` that already holds the finished files, does no work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from types import ModuleType

import sentencepiece

REPO_ROOT = Path(__file__).resolve().parent.parent
PREPROCESS_SCRIPT = REPO_ROOT / "scripts" / "preprocess_data.py"

TINY_VOCAB_SIZE = 320
# Enough documents that Megatron-LM's usual "949,50,1" split leaves the test split a document
# (megatron-core rounds each split's bookend to a whole document).
TINY_NUM_DOCUMENTS = 1200

_SUBJECTS = [
    "the farmer", "a young teacher", "the old captain", "my neighbour", "the small dog",
    "a quiet student", "the baker", "our doctor", "the tired pilot", "a clever fox",
    "the river", "the city council", "a travelling musician", "the gardener", "her brother",
]
_VERBS = [
    "carried", "painted", "found", "watched", "followed", "repaired", "opened", "described",
    "remembered", "visited", "counted", "borrowed", "cleaned", "measured", "explained",
]
_OBJECTS = [
    "the wooden boat", "a basket of apples", "the long road", "an empty house", "the bright lamp",
    "a map of the valley", "the broken clock", "a letter from home", "the green hills",
    "a bag of flour", "the morning train", "an old song", "the stone bridge", "a red kite",
]
_ENDINGS = [
    "before sunrise", "after the storm", "near the market", "in the afternoon", "with great care",
    "without a word", "during the winter", "at the edge of town", "for the third time",
    "under the tall trees", "across the field", "by the harbour",
]
_CONNECTIVES = ["Then", "Later", "Meanwhile", "Afterwards", "Still", "Soon"]

_SENTENCEPIECE_OPTIONS = {
    "vocab_size": TINY_VOCAB_SIZE,
    "model_type": "bpe",
    "character_coverage": 1.0,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
    "num_threads": 1,
    "shuffle_input_sentence": False,
    "input_sentence_size": 0,
    "minloglevel": 2,
}

_memo: dict[tuple[str, str], dict] = {}


def generate_documents(num_documents: int, seed: int) -> list[str]:
    """`num_documents` short English-like paragraphs (2 to 5 sentences), fixed by `seed`."""
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        sentences = []
        for position in range(rng.randint(2, 5)):
            sentence = (
                f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                f"{rng.choice(_ENDINGS)}."
            )
            if position > 0 and rng.random() < 0.4:
                sentence = f"{rng.choice(_CONNECTIVES)} {sentence}"
            sentences.append(sentence[0].upper() + sentence[1:])
        documents.append(" ".join(sentences))
    return documents


def write_jsonl(path: str | os.PathLike, documents: list[str], key: str = "text") -> None:
    """One JSON object per line, the document under `key`."""
    with open(path, "w", encoding="utf-8") as out:
        for document in documents:
            out.write(json.dumps({key: document}) + "\n")


def load_preprocess_module() -> ModuleType:
    """`scripts/preprocess_data.py` imported as module `preprocess_data` (it is a script).

    It is registered in `sys.modules` so that its worker functions pickle by reference when
    `--workers` > 1.
    """
    if "preprocess_data" in sys.modules:
        return sys.modules["preprocess_data"]
    spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["preprocess_data"]
        raise
    return module


def preprocess(jsonl: str | os.PathLike, output_prefix: str | os.PathLike, model: str) -> str:
    """Tokenize `jsonl` with the Llama2Tokenizer `model`, appending EOD; returns the prefix."""
    exit_code = load_preprocess_module().main(
        [
            "--input", str(jsonl),
            "--json-keys", "text",
            "--output-prefix", str(output_prefix),
            "--tokenizer-type", "Llama2Tokenizer",
            "--tokenizer-model", str(model),
            "--append-eod",
            "--workers", "1",
        ]
    )
    if exit_code != 0:
        raise RuntimeError(f"preprocess_data.py failed on {jsonl} (exit code {exit_code})")
    return f"{output_prefix}_text_document"


def build_tiny_corpus(
    tmpdir: str | os.PathLike, num_documents: int = TINY_NUM_DOCUMENTS, seed: int = 1234
) -> dict:
    """Build (or reuse) the tiny corpus under `tmpdir`.

    Returns dict(model=<sentencepiece .model path>, prefix=<dataset prefix for --data-path>,
    vocab_size=<tokenizer vocab size>, jsonl=<corpus path>, documents=<the document texts>).
    """
    documents = generate_documents(num_documents, seed)
    fingerprint = hashlib.sha256()
    fingerprint.update(json.dumps(documents).encode())
    fingerprint.update(json.dumps(_SENTENCEPIECE_OPTIONS, sort_keys=True).encode())
    fingerprint.update(PREPROCESS_SCRIPT.read_bytes())
    content_key = fingerprint.hexdigest()[:16]
    memo_key = (str(Path(tmpdir).resolve()), content_key)
    if memo_key in _memo:
        return _memo[memo_key]

    corpus_dir = Path(tmpdir) / f"tiny-corpus-{content_key}"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    jsonl = corpus_dir / "corpus.jsonl"
    model_prefix = corpus_dir / "tiny_spm"
    model = f"{model_prefix}.model"
    prefix = f"{corpus_dir / 'tiny'}_text_document"
    finished_marker = corpus_dir / "finished"

    if not finished_marker.exists():
        write_jsonl(jsonl, documents)
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(documents), model_prefix=str(model_prefix),
            **_SENTENCEPIECE_OPTIONS,
        )
        preprocess(jsonl, corpus_dir / "tiny", model)
        finished_marker.write_text(content_key)

    vocab_size = sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size()
    result = dict(model=model, prefix=prefix, vocab_size=vocab_size, jsonl=str(jsonl),
                  documents=documents)
    _memo[memo_key] = result
    return result
