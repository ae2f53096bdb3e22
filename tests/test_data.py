"""Tests for the trainer's tokenizers, `scripts/preprocess_data.py` and the datasets/data order.

Everything runs on a tiny corpus generated and tokenized locally (tests/corpus.py), built once
per session.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy
import pytest
import sentencepiece
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from mindspeed_tft.training.data import (
    MegatronPretrainingSampler,
    build_data_iterator,
    build_train_valid_test_datasets,
    get_train_valid_test_num_samples,
    parse_data_path,
)
from mindspeed_tft.training.tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from tests.corpus import (
    PREPROCESS_SCRIPT,
    TINY_NUM_DOCUMENTS,
    TINY_VOCAB_SIZE,
    build_tiny_corpus,
    generate_documents,
    load_preprocess_module,
    preprocess,
    write_jsonl,
)

SEQ_LENGTH = 64


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_tiny_corpus(tmp_path_factory.getbasetemp() / "corpus")


@pytest.fixture(scope="session")
def second_prefix(corpus: dict, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second dataset (different documents, same tokenizer) for blending."""
    directory = tmp_path_factory.mktemp("second")
    write_jsonl(directory / "second.jsonl", generate_documents(600, seed=99))
    return preprocess(directory / "second.jsonl", directory / "second", corpus["model"])


def make_args(corpus: dict, **overrides) -> argparse.Namespace:
    values = dict(
        tokenizer_type="Llama2Tokenizer",
        tokenizer_model=corpus["model"],
        vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        data_path=[corpus["prefix"]],
        split="949,50,1",
        mock_data=False,
        seq_length=SEQ_LENGTH,
        seed=1234,
        train_iters=20,
        global_batch_size=8,
        micro_batch_size=2,
        eval_interval=10,
        eval_iters=2,
        data_cache_path=None,
        num_workers=0,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


# ---------------------------------------------------------------- tokenizers


def test_llama2_tokenizer_ids_and_round_trip(corpus: dict) -> None:
    args = make_args(corpus)
    tokenizer = build_tokenizer(args)
    processor = sentencepiece.SentencePieceProcessor(model_file=corpus["model"])
    text = corpus["documents"][0]

    assert isinstance(tokenizer, Llama2Tokenizer)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, -1)
    assert tokenizer.vocab_size == TINY_VOCAB_SIZE == corpus["vocab_size"]
    assert args.padded_vocab_size == 384
    assert tokenizer.vocab["<unk>"] == 0 and tokenizer.vocab["<s>"] == 1
    assert tokenizer.inv_vocab[2] == "</s>"
    assert tokenizer.tokenize(text) == [1, *processor.encode(text)]
    assert tokenizer.tokenize(text, bos=False, eos=True) == [*processor.encode(text), 2]
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert all(0 <= token_id < TINY_VOCAB_SIZE for token_id in tokenizer.tokenize(text))


def test_gpt_sentencepiece_tokenizer_adds_no_bos(corpus: dict) -> None:
    tokenizer = build_tokenizer(make_args(corpus, tokenizer_type="GPTSentencePieceTokenizer"))
    processor = sentencepiece.SentencePieceProcessor(model_file=corpus["model"])
    text = corpus["documents"][1]

    assert isinstance(tokenizer, GPTSentencePieceTokenizer)
    assert tokenizer.tokenize(text) == processor.encode(text)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, -1)
    assert tokenizer.vocab_size == TINY_VOCAB_SIZE
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


@pytest.mark.parametrize(
    ("divisible_by", "tensor_parallel", "padded"),
    [(128, 1, 384), (128, 2, 512), (64, 1, 320), (64, 4, 512), (1, 1, 320), (100, 3, 600),
     (8, 8, 320), (128, 8, 1024)],
)
def test_padded_vocab_size(corpus: dict, divisible_by: int, tensor_parallel: int, padded: int):
    args = make_args(
        corpus, make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tensor_parallel
    )
    build_tokenizer(args)
    assert args.padded_vocab_size == padded
    assert vocab_size_with_padding(TINY_VOCAB_SIZE, divisible_by, tensor_parallel) == padded


def test_padded_vocab_size_from_checkpoint_is_kept(corpus: dict) -> None:
    args = make_args(corpus, padded_vocab_size=4096)
    build_tokenizer(args)
    assert args.padded_vocab_size == 4096


def test_padded_vocab_size_uses_megatron_defaults(corpus: dict) -> None:
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000)
    build_tokenizer(args)
    assert args.padded_vocab_size == 1024  # 1001 rounded up to a multiple of 128 * 1


def test_null_tokenizer() -> None:
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=1000, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=8,
    )
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 1001
    assert tokenizer.eod == 1000
    assert args.padded_vocab_size == 1024
    assert tokenizer.tokenize("5 17 3") == [5, 17, 3]
    assert tokenizer.detokenize([5, 17, 3]) == "5 17 3"
    assert tokenizer.offsets([5, 17, 3], "5 17 3") == [0, 2, 5]


def test_tokenizer_errors(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        build_tokenizer(make_args(corpus, tokenizer_type="GPT2BPETokenizer"))
    assert str(error.value) == (
        "--tokenizer-type 'GPT2BPETokenizer' is not supported; supported types: "
        "Llama2Tokenizer, GPTSentencePieceTokenizer, NullTokenizer"
    )

    missing = str(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError) as error:
        build_tokenizer(make_args(corpus, tokenizer_model=missing))
    assert str(error.value) == f"--tokenizer-model {missing}: no such file"

    garbage = tmp_path / "garbage.model"
    garbage.write_text("not a model")
    with pytest.raises(ValueError) as error:
        build_tokenizer(make_args(corpus, tokenizer_model=str(garbage)))
    assert str(error.value).startswith(
        f"--tokenizer-model {garbage}: not a readable sentencepiece model ("
    )

    with pytest.raises(ValueError) as error:
        build_tokenizer(make_args(corpus, tokenizer_model=None))
    assert str(error.value) == (
        "--tokenizer-model is required for the sentencepiece tokenizer types "
        "(Llama2Tokenizer, GPTSentencePieceTokenizer): pass the path of a sentencepiece "
        ".model file"
    )

    with pytest.raises(ValueError) as error:
        build_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=None))
    assert str(error.value) == (
        "--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids before the "
        "end-of-document token)"
    )


# ---------------------------------------------------------------- preprocess_data.py


def test_preprocess_output_has_the_tokenizer_ids(corpus: dict) -> None:
    tokenizer = build_tokenizer(make_args(corpus))
    dataset = IndexedDataset(corpus["prefix"])

    assert len(dataset) == TINY_NUM_DOCUMENTS
    assert dataset.index.dtype == numpy.uint16  # vocabulary < 65500
    assert dataset.document_indices.tolist() == list(range(TINY_NUM_DOCUMENTS + 1))
    for document_number in range(5):
        expected = tokenizer.tokenize(corpus["documents"][document_number]) + [tokenizer.eod]
        assert dataset[document_number].tolist() == expected
        assert dataset.sequence_lengths[document_number] == len(expected)


def test_preprocess_null_tokenizer_sentences_and_int32(tmp_path: Path) -> None:
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text(
        '{"text": ["1 2 3", "69999 5"], "other": "7"}\n'
        "\n"
        '{"text": "4", "other": "8 9"}\n'
    )
    preprocess_module = load_preprocess_module()
    exit_code = preprocess_module.main([
        "--input", str(jsonl), "--json-keys", "text", "other", "--output-prefix",
        str(tmp_path / "ids"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000",
        "--append-eod",
    ])
    assert exit_code == 0

    text = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert text.index.dtype == numpy.int32  # vocabulary of 70001 >= 65500
    assert text.sequence_lengths.tolist() == [3, 3, 2]  # the EOD ends each document
    assert text.document_indices.tolist() == [0, 2, 3]
    assert [sequence.tolist() for sequence in text[0:3]] == [[1, 2, 3], [69999, 5, 70000],
                                                             [4, 70000]]
    other = IndexedDataset(str(tmp_path / "ids_other_document"))
    assert [sequence.tolist() for sequence in other[0:2]] == [[7, 70000], [8, 9, 70000]]


def test_preprocess_workers_give_the_same_output(corpus: dict, tmp_path: Path) -> None:
    preprocess_module = load_preprocess_module()
    exit_code = preprocess_module.main([
        "--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "parallel"),
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", corpus["model"],
        "--append-eod", "--workers", "2",
    ])
    assert exit_code == 0
    for suffix in (".bin", ".idx"):
        parallel = (tmp_path / f"parallel_text_document{suffix}").read_bytes()
        assert parallel == Path(corpus["prefix"] + suffix).read_bytes()


def _run_preprocess(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    exit_code = load_preprocess_module().main(list(argv))
    return exit_code, capsys.readouterr().err.strip()


def test_preprocess_errors(corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    common = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", corpus["model"]]
    out = str(tmp_path / "out")

    missing = str(tmp_path / "missing.jsonl")
    assert _run_preprocess(capsys, "--input", missing, "--output-prefix", out, *common) == (
        1, f"preprocess_data.py: error: --input {missing}: no such file"
    )

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    assert _run_preprocess(capsys, "--input", str(bad_json), "--output-prefix", out, *common) == (
        1,
        f"preprocess_data.py: error: {bad_json} line 3: not valid JSON "
        "(Expecting value at column 10)",
    )
    assert not os.path.exists(out + "_text_document.bin")  # no half-written dataset is left

    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "fine"}\n{"body": "x", "id": 2}\n')
    assert _run_preprocess(capsys, "--input", str(no_key), "--output-prefix", out, *common) == (
        1,
        f"preprocess_data.py: error: {no_key} line 2: no key 'text' (keys present: 'body', 'id')",
    )

    not_ids = tmp_path / "notids.jsonl"
    not_ids.write_text('{"text": "1 2 three"}\n')
    assert _run_preprocess(
        capsys, "--input", str(not_ids), "--output-prefix", out, "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "10",
    ) == (
        1,
        f"preprocess_data.py: error: {not_ids} line 1: the tokenizer cannot encode the value of "
        "'text' (invalid literal for int() with base 10: 'three')",
    )

    not_text = tmp_path / "nottext.jsonl"
    not_text.write_text('{"text": 5}\n')
    assert _run_preprocess(capsys, "--input", str(not_text), "--output-prefix", out, *common) == (
        1,
        f"preprocess_data.py: error: {not_text} line 1: the value of 'text' must be a string or "
        "a list of strings",
    )


def test_preprocess_cli_exit_status(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    completed = subprocess.run(
        [sys.executable, str(PREPROCESS_SCRIPT), "--input", missing, "--output-prefix",
         str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 1
    assert completed.stderr.strip().endswith(
        f"preprocess_data.py: error: --input {missing}: no such file"
    )


# ---------------------------------------------------------------- datasets


def test_num_samples_as_megatron() -> None:
    args = argparse.Namespace(train_iters=20, global_batch_size=8, eval_interval=10, eval_iters=2)
    assert get_train_valid_test_num_samples(args) == (160, 48, 16)
    args = argparse.Namespace(
        train_iters=1000, global_batch_size=32, eval_interval=300, eval_iters=5, train_samples=None
    )
    assert get_train_valid_test_num_samples(args) == (32000, 4 * 5 * 32, 5 * 32)


def test_parse_data_path() -> None:
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "7", "b"]) == (["a", "b"], [0.3, 7.0])
    with pytest.raises(ValueError) as error:
        parse_data_path(["0.3", "a", "b", "c"])
    assert str(error.value) == (
        "--data-path 0.3 a b c: a weighted list must alternate weight and prefix "
        "('w1 p1 w2 p2 ...'); these weight positions are not numbers: b"
    )


def _expected_num_samples(token_counts: int, requested: int) -> int:
    """GPTDataset's length: whole epochs of the split's tokens, enough for `requested`."""
    epochs = 1
    while epochs * token_counts < requested * SEQ_LENGTH + 1:
        epochs += 1
    return (epochs * token_counts - 1) // SEQ_LENGTH


def test_split_ratios_give_megatron_sample_counts(corpus: dict, tmp_path: Path) -> None:
    args = make_args(corpus, data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(args, build_tokenizer(args))
    # Keep the IndexedDataset alive: its sequence_lengths view dies with its memory map.
    indexed = IndexedDataset(corpus["prefix"])
    lengths = indexed.sequence_lengths

    # round(0.949 * 1200) = 1139, round(0.999 * 1200) = 1199
    assert (train.indices[0], train.indices[-1] + 1) == (0, 1139)
    assert (valid.indices[0], valid.indices[-1] + 1) == (1139, 1199)
    assert test.indices.tolist() == [1199]
    for dataset, requested in ((train, 160), (valid, 48), (test, 16)):
        assert isinstance(dataset, GPTDataset)
        assert dataset.num_samples == requested
        tokens = int(lengths[dataset.indices].sum())
        assert len(dataset) == _expected_num_samples(tokens, requested) >= requested

    _, no_valid, no_test = build_train_valid_test_datasets(
        make_args(corpus, split="100,0,0", data_cache_path=str(tmp_path / "cache")),
        build_tokenizer(args),
    )
    assert (no_valid, no_test) == (None, None)


def test_gpt_samples_are_deterministic_windows(corpus: dict, tmp_path: Path) -> None:
    tokenizer = build_tokenizer(make_args(corpus))
    first = build_train_valid_test_datasets(
        make_args(corpus, data_cache_path=str(tmp_path / "a")), tokenizer)[0]
    cached = build_train_valid_test_datasets(
        make_args(corpus, data_cache_path=str(tmp_path / "a")), tokenizer)[0]
    fresh = build_train_valid_test_datasets(
        make_args(corpus, data_cache_path=str(tmp_path / "b")), tokenizer)[0]
    other_seed = build_train_valid_test_datasets(
        make_args(corpus, data_cache_path=str(tmp_path / "a"), seed=7), tokenizer)[0]
    assert first.built_anew_on_cache_miss and not cached.built_anew_on_cache_miss

    indexed = IndexedDataset(corpus["prefix"])
    token_stream = numpy.concatenate([indexed[int(d)] for d in first.document_index])
    for sample_number in range(20):
        sample = first[sample_number]
        for dataset in (cached, fresh):
            for name, value in dataset[sample_number].items():
                assert torch.equal(value, sample[name]), (sample_number, name)
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        window = int(first.shuffle_index[sample_number]) * SEQ_LENGTH
        expected = token_stream[window:window + SEQ_LENGTH + 1]
        assert sample["tokens"].tolist() == expected[:-1].tolist()
        assert sample["labels"].tolist() == expected[1:].tolist()
        assert sample["position_ids"].tolist() == list(range(SEQ_LENGTH))
        assert sample["loss_mask"].tolist() == [1.0] * SEQ_LENGTH
    assert any(
        not torch.equal(other_seed[n]["tokens"], first[n]["tokens"]) for n in range(20)
    )


def test_index_cache_defaults_next_to_the_data(corpus: dict, tmp_path: Path) -> None:
    # A private copy of the dataset, so the default cache lands in this test's directory.
    prefix = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        Path(prefix + suffix).write_bytes(Path(corpus["prefix"] + suffix).read_bytes())
    args = make_args(corpus, data_path=[prefix])
    build_train_valid_test_datasets(args, build_tokenizer(args))
    cache_files = sorted(os.listdir(os.path.join(prefix, "cache", "GPTDataset_indices")))
    assert len(cache_files) == 12  # 3 splits x (description, document, sample, shuffle index)
    assert sum(name.endswith("-train-shuffle_index.npy") for name in cache_files) == 1


def test_missing_data_and_empty_split_errors(corpus: dict, tmp_path: Path) -> None:
    tokenizer = build_tokenizer(make_args(corpus))
    missing = str(tmp_path / "nothing_text_document")
    with pytest.raises(FileNotFoundError) as error:
        build_train_valid_test_datasets(make_args(corpus, data_path=[missing]), tokenizer)
    assert str(error.value) == (
        f"--data-path prefix {missing}: missing {missing}.bin and {missing}.idx (write them with "
        "scripts/preprocess_data.py; the prefix is the path without .bin/.idx)"
    )

    with pytest.raises(ValueError) as error:
        build_train_valid_test_datasets(make_args(corpus, data_path=None), tokenizer)
    assert str(error.value) == "--data-path is required unless --mock-data is set"

    # 999.9 of 1000 parts of 1200 documents round to all of them: no test document.
    with pytest.raises(ValueError) as error:
        build_train_valid_test_datasets(make_args(corpus, split="9990,9,1"), tokenizer)
    assert str(error.value) == (
        f"--split '9990,9,1' gives the test split no documents of the 1200 in "
        f"{corpus['prefix']} (16 samples requested); use more documents, or weight 0 for that "
        "split to build none"
    )


def test_blending_two_prefixes(corpus: dict, second_prefix: str, tmp_path: Path) -> None:
    args = make_args(
        corpus, data_path=["0.3", corpus["prefix"], "0.7", second_prefix], split="90,10,0",
        data_cache_path=str(tmp_path / "cache"),
    )
    train, valid, test = build_train_valid_test_datasets(args, build_tokenizer(args))
    assert isinstance(train, BlendedDataset) and test is None
    assert [d.dataset_path for d in train.datasets] == [corpus["prefix"], second_prefix]
    # ceil(160 * 0.3) = 48 and ceil(160 * 0.7) = 112 samples; ceil(48 * .3) + ceil(48 * .7)
    assert numpy.bincount(train.dataset_index).tolist() == [48, 112]
    assert len(train) == 160 and len(valid) == 49
    for sample_number in range(0, 160, 7):
        source = train.datasets[train.dataset_index[sample_number]]
        expected = source[train.dataset_sample_index[sample_number]]
        assert torch.equal(train[sample_number]["tokens"], expected["tokens"])

    batch = next(build_data_iterator(train, 0, 4, 0, 1))
    assert batch["dataset_id"].tolist() == train.dataset_index[:4].tolist()
    assert batch["tokens"].shape == (4, SEQ_LENGTH)

    unweighted = make_args(corpus, data_path=[corpus["prefix"], second_prefix], split="90,10,0")
    train, _, _ = build_train_valid_test_datasets(unweighted, build_tokenizer(unweighted))
    assert isinstance(train, BlendedDataset) and len(train) == 160


def test_mock_data() -> None:
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=4094, mock_data=True, data_path=None,
        split=None, seq_length=SEQ_LENGTH, seed=1234, train_iters=20, global_batch_size=8,
        eval_interval=10, eval_iters=2, data_cache_path=None,
    )
    tokenizer = build_tokenizer(args)
    train, valid, test = build_train_valid_test_datasets(args, tokenizer)
    assert all(isinstance(d, MockGPTDataset) for d in (train, valid, test))
    assert (train.num_samples, valid.num_samples, test.num_samples) == (160, 48, 16)
    batch = next(build_data_iterator(train, 0, 4, 0, 1))
    assert batch["tokens"].shape == (4, SEQ_LENGTH) and batch["tokens"].dtype == torch.int64
    # Mock documents count 1, 2, 3, ... and end with the EOD id (4094 here).
    tokens = batch["tokens"][0]
    steps = (tokens[1:] - tokens[:-1]).tolist()
    assert all(step == 1 or tokens[i] == 4094 or tokens[i + 1] == 4094
               for i, step in enumerate(steps))
    assert int(batch["tokens"].max()) <= 4094 < tokenizer.vocab_size

    small = argparse.Namespace(**{**vars(args), "vocab_size": 1000, "padded_vocab_size": None})
    with pytest.raises(ValueError) as error:
        build_train_valid_test_datasets(small, build_tokenizer(small))
    assert str(error.value) == (
        "--mock-data: megatron-core's MockGPTDataset uses token ids up to 4094, but the "
        "tokenizer's vocabulary has 1001 ids; use a vocabulary of at least 4095 ids "
        "(NullTokenizer: --vocab-size 4094 or more)"
    )


# ---------------------------------------------------------------- sampler and resume


def test_sampler_indices() -> None:
    def batches(consumed: int, rank: int, drop_last: bool = True) -> list[list[int]]:
        return list(MegatronPretrainingSampler(10, consumed, 2, rank, 2, drop_last))

    assert batches(0, 0) == [[0, 1], [4, 5]]
    assert batches(0, 1) == [[2, 3], [6, 7]]
    assert batches(4, 0) == [[4, 5]]
    assert batches(4, 1) == [[6, 7]]
    assert batches(4, 0, drop_last=False) == [[4, 5], [8, 9]]
    assert batches(4, 1, drop_last=False) == [[6, 7]]
    with pytest.raises(ValueError) as error:
        MegatronPretrainingSampler(10, 10, 2, 0, 2)
    assert str(error.value) == (
        "consumed_samples 10 is outside the dataset's 10 samples: nothing is left to consume"
    )
    with pytest.raises(ValueError) as error:
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    assert str(error.value) == "data_parallel_rank 2 is not in [0, 2)"


def test_rebuilt_iterator_resumes_exactly(corpus: dict, tmp_path: Path) -> None:
    args = make_args(corpus, data_cache_path=str(tmp_path / "cache"))
    train = build_train_valid_test_datasets(args, build_tokenizer(args))[0]
    micro_batch_size, data_parallel_size, num_steps = 2, 2, 12
    samples_per_step = micro_batch_size * data_parallel_size

    continuing = {
        rank: [next(iterator) for _ in range(num_steps)]
        for rank in range(data_parallel_size)
        for iterator in [build_data_iterator(train, 0, micro_batch_size, rank, data_parallel_size)]
    }
    for rank, batches in continuing.items():
        for step, batch in enumerate(batches):
            first_sample = step * samples_per_step + rank * micro_batch_size
            assert batch["tokens"].shape == (micro_batch_size, SEQ_LENGTH)
            assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
            assert "attention_mask" not in batch
            for row in range(micro_batch_size):
                assert torch.equal(batch["tokens"][row], train[first_sample + row]["tokens"])

    for resume_step in (1, 5, 11):
        for rank in range(data_parallel_size):
            resumed = build_data_iterator(
                train, resume_step * samples_per_step, micro_batch_size, rank, data_parallel_size
            )
            for step in range(resume_step, num_steps):
                batch = next(resumed)
                for name, value in continuing[rank][step].items():
                    assert torch.equal(batch[name], value), (resume_step, rank, step, name)


def test_worker_processes_give_the_same_batches(corpus: dict, tmp_path: Path) -> None:
    """`--num-workers 2` (Megatron-LM's default): real worker processes read the samples,
    the batches come in the sampler's order, bit for bit those of loading in the training
    process, from the start and from a resume point."""
    args = make_args(corpus, data_cache_path=str(tmp_path / "cache"))
    train = build_train_valid_test_datasets(args, build_tokenizer(args))[0]
    for consumed in (0, 20):
        inline = build_data_iterator(train, consumed, 2, 1, 2, num_workers=0)
        loaded = build_data_iterator(train, consumed, 2, 1, 2, num_workers=2)
        workers = loaded._workers  # type: ignore[union-attr]
        assert len(workers) == 2 and all(w.pid != os.getpid() for w in workers)
        for _ in range(10):
            expected, got = next(inline), next(loaded)
            assert expected.keys() == got.keys()
            for name, value in expected.items():
                assert torch.equal(got[name], value), (consumed, name)
        del loaded  # its workers end with it
    with pytest.raises(ValueError, match="--num-workers -1: allowed: 0"):
        build_data_iterator(train, 0, 2, 0, 1, num_workers=-1)


def test_iterator_is_none_without_dataset() -> None:
    assert build_data_iterator(None, 0, 2, 0, 1) is None


# ---------------------------------------------------------------- one cache builder at a time


def test_barrier_lets_one_process_build_the_cache_first(corpus: dict, tmp_path: Path) -> None:
    args = make_args(corpus, data_cache_path=str(tmp_path / "cache"))
    tokenizer = build_tokenizer(args)
    meeting = threading.Barrier(3)
    results: dict[str, tuple] = {}

    def run(name: str, **options) -> None:
        results[name] = build_train_valid_test_datasets(
            args, tokenizer, barrier=meeting.wait, **options
        )

    threads = [
        threading.Thread(target=run, args=("leader",), kwargs=dict(builds_cache_first=True)),
        threading.Thread(target=run, args=("follower",), kwargs=dict(builds_cache_first=False)),
        threading.Thread(
            target=run, args=("idle",),
            kwargs=dict(builds_cache_first=False, is_built_on_rank=lambda: False),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert [d.built_anew_on_cache_miss for d in results["leader"]] == [True, True, True]
    assert [d.built_anew_on_cache_miss for d in results["follower"]] == [False, False, False]
    assert results["idle"] == (None, None, None)
    assert torch.equal(results["leader"][0][3]["tokens"], results["follower"][0][3]["tokens"])

    with pytest.raises(ValueError) as error:
        build_train_valid_test_datasets(args, tokenizer, barrier=lambda: None)
    assert str(error.value) == (
        "build_train_valid_test_datasets: with a barrier, pass builds_cache_first=True on "
        "exactly one process (the one that writes the index cache) and False on the others"
    )


def _build_in_process_group(rank: int, store_path: str, corpus: dict, cache: str, queue) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2
    )
    try:
        args = make_args(corpus, data_cache_path=cache)
        datasets = build_train_valid_test_datasets(args, build_tokenizer(args))
        queue.put((rank, [d.built_anew_on_cache_miss for d in datasets],
                   datasets[0][0]["tokens"].tolist()))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.multiproc
def test_torch_distributed_rank0_builds_the_cache_first(corpus: dict, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(
            target=_build_in_process_group,
            args=(rank, str(tmp_path / "store"), corpus, str(tmp_path / "cache"), queue),
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    results = dict((rank, (built, tokens)) for rank, built, tokens in
                   (queue.get(timeout=120) for _ in processes))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results[0][0] == [True, True, True]
    assert results[1][0] == [False, False, False]
    assert results[0][1] == results[1][1]
