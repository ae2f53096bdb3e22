#!/usr/bin/env python3
"""Tokenize a JSON-lines corpus into megatron-core `.bin/.idx` datasets (Megatron-LM's CLI).

    python scripts/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix out --tokenizer-type Llama2Tokenizer --tokenizer-model m.model \
        --append-eod --workers 1

writes `out_text_document.bin` and `out_text_document.idx` (one pair per JSON key) with
megatron-core's `IndexedDatasetBuilder`; pass `out_text_document` to the trainer's
`--data-path`. Each input line is one JSON object (one document); the value under a key is a
string, or a list of strings (sentences) that become the document's sequences. With
`--append-eod` the tokenizer's end-of-document id ends every non-empty document. Blank lines are
skipped. The token dtype is uint16 for vocabularies under 65500 entries, else int32 (megatron-
core's `DType.optimal_dtype`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence

try:
    from mindspeed_tft.training.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mindspeed_tft.training.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class PreprocessError(Exception):
    """A problem with the input, reported as one line without a traceback."""


# (token ids of the document, length of each of its sequences) for each JSON key.
EncodedDocument = dict[str, tuple[list[int], list[int]]]


class DocumentEncoder:
    """Turns one JSON line into token ids per key; one instance per worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer: MegatronTokenizer | None = None

    def initializer(self) -> None:
        self.tokenizer = build_tokenizer(tokenizer_args(self.args))

    def encode(self, numbered_line: tuple[int, str]) -> tuple[int, EncodedDocument | None, int]:
        """Returns (line number, encoded document or None for a blank line, bytes read)."""
        line_number, line = numbered_line
        if self.tokenizer is None:
            self.initializer()
        if not line.strip():
            return line_number, None, len(line)
        where = f"{self.args.input} line {line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PreprocessError(
                f"{where}: not valid JSON ({error.msg} at column {error.colno})"
            ) from None
        if not isinstance(record, dict):
            raise PreprocessError(
                f"{where}: expected a JSON object, got {type(record).__name__}"
            )
        document: EncodedDocument = {}
        for key in self.args.json_keys:
            if key not in record:
                present = ", ".join(repr(k) for k in record) or "none"
                raise PreprocessError(f"{where}: no key {key!r} (keys present: {present})")
            value = record[key]
            sentences = value if isinstance(value, list) else [value]
            if not all(isinstance(sentence, str) for sentence in sentences):
                raise PreprocessError(
                    f"{where}: the value of {key!r} must be a string or a list of strings"
                )
            try:
                document[key] = self._encode_sentences(sentences)
            except ValueError as error:
                raise PreprocessError(
                    f"{where}: the tokenizer cannot encode the value of {key!r} ({error})"
                ) from None
        return line_number, document, len(line)

    def _encode_sentences(self, sentences: Sequence[str]) -> tuple[list[int], list[int]]:
        assert self.tokenizer is not None
        token_ids: list[int] = []
        sequence_lengths: list[int] = []
        for sentence in sentences:
            sentence_ids = list(self.tokenizer.tokenize(sentence))
            if sentence_ids:
                token_ids.extend(sentence_ids)
                sequence_lengths.append(len(sentence_ids))
        if token_ids and self.args.append_eod:
            token_ids.append(self.tokenizer.eod)
            sequence_lengths[-1] += 1
        return token_ids, sequence_lengths


def tokenizer_args(args: argparse.Namespace) -> argparse.Namespace:
    """The Namespace `build_tokenizer` reads, from this script's arguments."""
    return argparse.Namespace(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
    )


_worker_encoder: DocumentEncoder | None = None


def _start_worker(args: argparse.Namespace) -> None:
    global _worker_encoder
    _worker_encoder = DocumentEncoder(args)
    _worker_encoder.initializer()


def _encode_in_worker(numbered_line: tuple[int, str]) -> tuple[int, EncodedDocument | None, int]:
    assert _worker_encoder is not None
    return _worker_encoder.encode(numbered_line)


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: `<output-prefix>_<key>_document` (document-level datasets)."""
    return f"{output_prefix}_{key}_document"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file, one document a line")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each line"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type", required=True, choices=SUPPORTED_TOKENIZER_TYPES,
        help="tokenizer, as Megatron-LM's --tokenizer-type",
    )
    group.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocab size")
    group.add_argument(
        "--append-eod", action="store_true", help="end every document with the EOD token"
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True,
        help="writes <output-prefix>_<key>_document.bin/.idx for each key",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers", type=int, default=1,
        help="tokenizer processes; 1 tokenizes in this process (output order is input order "
        "either way)",
    )
    group.add_argument(
        "--log-interval", type=int, default=10000, help="report progress every N documents"
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: must be at least 1")
    return args


def _numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as lines:
        yield from enumerate(lines, start=1)


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Write one `.bin/.idx` dataset per JSON key; returns {key: dataset prefix}."""
    if not os.path.isfile(args.input):
        raise PreprocessError(f"--input {args.input}: no such file")
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(output_dir):
        raise PreprocessError(f"--output-prefix {args.output_prefix}: no directory {output_dir}")

    encoder = DocumentEncoder(args)
    encoder.initializer()  # fails here, before any output, on a bad tokenizer argument
    assert encoder.tokenizer is not None
    token_dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)

    dataset_prefixes = {key: output_prefix_for_key(args.output_prefix, key) for key in args.json_keys}
    builders = {
        key: IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype)
        for key, prefix in dataset_prefixes.items()
    }
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_start_worker, initargs=(args,))
            encoded = pool.imap(_encode_in_worker, _numbered_lines(args.input), chunksize=32)
        else:
            encoded = map(encoder.encode, _numbered_lines(args.input))
        start = time.time()
        num_documents = 0
        for _, document, _ in encoded:
            if document is None:
                continue
            for key, (token_ids, sequence_lengths) in document.items():
                builders[key].add_document(token_ids, sequence_lengths)
            num_documents += 1
            if num_documents % args.log_interval == 0:
                print(
                    f"processed {num_documents} documents "
                    f"({num_documents / (time.time() - start):.1f} docs/s)",
                    file=sys.stderr,
                )
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for prefix in dataset_prefixes.values():
            for path in (prefix + ".bin", prefix + ".idx"):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(dataset_prefixes[key] + ".idx")
    print(
        f"wrote {num_documents} documents to "
        f"{', '.join(p + '.bin/.idx' for p in dataset_prefixes.values())}",
        file=sys.stderr,
    )
    return dataset_prefixes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preprocess(args)
    except (PreprocessError, FileNotFoundError, ValueError) as error:
        print(f"preprocess_data.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
