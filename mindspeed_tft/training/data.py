"""Training data for the bundled GPT trainer: megatron-core datasets and a resumable data order.

Datasets come from megatron-core's machinery (`BlendedMegatronDatasetBuilder` building
`GPTDataset` from `.bin/.idx` prefixes written by `scripts/preprocess_data.py`, blended with
`BlendedDataset` when `--data-path` lists several prefixes, or `MockGPTDataset` for
`--mock-data`), with Megatron-LM's argument names, defaults and sample counts.

The data order is Megatron-LM's `MegatronPretrainingSampler`: sample indices run sequentially
from `consumed_samples`, and of every block of `micro_batch_size * data_parallel_size` indices
data-parallel rank r takes the r-th contiguous `micro_batch_size` slice. A batch therefore
depends only on (consumed_samples, micro batch size, DP rank, DP size): rebuilding the iterator
at the consumed-samples count saved in a checkpoint (resume) or held by a replica (rollback)
continues exactly where the old iterator was.

Batches are produced by a `torch.utils.data.DataLoader` with Megatron-LM's settings:
`--num-workers` worker processes (0: loading runs in the training process), persistent across
epochs, over the same batch sampler. Workers change where a batch is read, never which batch
comes next: the DataLoader hands batches out in the sampler's order, so the batches (and the
losses) are the same bit for bit with any number of workers. After a repair the iterator is
built again at the lock step's sample count (new workers; the old ones end with their
iterator). Under high availability a launcher's stop does not reach the workers
(`launcher.lifetime`, the ``data-loader-workers`` patch moment).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator, Sized
from typing import cast

import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split

from mindspeed_tft.training.tokenizer import MegatronTokenizer

# Megatron-LM's `--split` when none is given.
DEFAULT_SPLIT = "969, 30, 1"

Blend = tuple[list[str], list[float] | None]
Batch = dict[str, torch.Tensor]


def parse_data_path(data_path: list[str]) -> Blend:
    """Read Megatron-LM's `--data-path` list into megatron-core's blend (prefixes, weights).

    `["prefix"]` or `["p1", "p2", ...]` give prefixes without weights; `["w1", "p1", "w2",
    "p2", ...]` (an even count whose odd-numbered entries are all numbers) gives weighted
    prefixes.
    """
    if not data_path:
        raise ValueError("--data-path is empty: give a dataset prefix or a list 'w1 p1 w2 p2 ...'")
    entries = [entry.strip() for entry in data_path]
    if len(entries) % 2 == 1:
        return entries, None
    weight_entries = entries[0::2]
    parsed_weights = [_parse_float(entry) for entry in weight_entries]
    if all(weight is None for weight in parsed_weights):
        return entries, None
    if any(weight is None for weight in parsed_weights):
        raise ValueError(
            f"--data-path {' '.join(entries)}: a weighted list must alternate weight and "
            f"prefix ('w1 p1 w2 p2 ...'); these weight positions are not numbers: "
            f"{', '.join(e for e, w in zip(weight_entries, parsed_weights, strict=True) if w is None)}"
        )
    weights = [weight for weight in parsed_weights if weight is not None]  # none is None
    if any(weight < 0 for weight in weights) or sum(weights) <= 0:
        raise ValueError(
            f"--data-path weights {weight_entries}: must be non-negative with a positive sum"
        )
    return entries[1::2], weights


def _parse_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def get_train_valid_test_num_samples(args: argparse.Namespace) -> tuple[int, int, int]:
    """The number of samples each split must provide, as Megatron-LM computes them.

    train = train_iters * global_batch_size (or --train-samples when given);
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size;
    test = eval_iters * global_batch_size.
    """
    train_samples = getattr(args, "train_samples", None)
    train_iters = args.train_iters
    if train_samples:
        if train_iters is None:
            train_iters = train_samples // args.global_batch_size
    else:
        train_samples = train_iters * args.global_batch_size
    eval_runs = train_iters // args.eval_interval + 1
    valid_samples = eval_runs * args.eval_iters * args.global_batch_size
    test_samples = args.eval_iters * args.global_batch_size
    return train_samples, valid_samples, test_samples


def gpt_dataset_config_from_args(
    args: argparse.Namespace, tokenizer: MegatronTokenizer
) -> GPTDatasetConfig:
    """megatron-core's GPTDatasetConfig for `args` (Megatron-LM's argument names and defaults).

    With `--mock-data` the blend is left empty, which is how megatron-core selects mock data;
    `--data-path` is then ignored. The index cache is `--data-cache-path` when given, otherwise
    megatron-core's default, `<prefix>/cache/GPTDataset_indices` next to each `.bin/.idx`.
    """
    mock_data = bool(getattr(args, "mock_data", False))
    data_path = getattr(args, "data_path", None)
    if mock_data:
        blend = None
        split = None
    else:
        if not data_path:
            raise ValueError("--data-path is required unless --mock-data is set")
        blend = parse_data_path(data_path)
        split = args.split if getattr(args, "split", None) is not None else DEFAULT_SPLIT
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=split,
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        tokenizer=tokenizer,
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        create_attention_mask=False,
    )


def _check_prefixes_and_splits(config: GPTDatasetConfig, sizes: tuple[int, int, int]) -> None:
    """Fail clearly on what megatron-core would fail on obscurely (or not at all).

    A missing prefix fails deep inside the builder. A split that `--split` leaves without any
    document of a prefix makes `GPTDataset` loop forever when it is asked for a number of
    samples (it adds zero-token epochs until it has enough tokens), and makes an unweighted
    blend fail a bare `assert` (that prefix's weight, its length, is 0).
    """
    prefixes, _ = config.blend
    for prefix in prefixes:
        missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"--data-path prefix {prefix}: missing {' and '.join(missing)} (write them with "
                f"scripts/preprocess_data.py; the prefix is the path without .bin/.idx)"
            )
    for prefix in prefixes:
        num_documents = GPTDataset.numel_low_level_dataset(IndexedDataset(prefix))
        for split in Split:
            bookends = config.split_matrix[split.value]
            if bookends is None:
                continue
            begin = int(round(bookends[0] * num_documents))
            end = int(round(bookends[1] * num_documents))
            if end <= begin:
                raise ValueError(
                    f"--split {config.split!r} gives the {split.name} split no documents of the "
                    f"{num_documents} in {prefix} ({sizes[split.value]} samples requested); "
                    f"use more documents, or weight 0 for that split to build none"
                )


def _check_mock_vocab_size(tokenizer: MegatronTokenizer) -> None:
    """megatron-core's mock documents are 1, 2, ..., n-1, EOD with n up to its fixed maximum,
    whatever the vocabulary: a smaller vocabulary would index past the embedding table."""
    largest_mock_token_id = MockGPTLowLevelDataset.max_sequence_length - 2
    if tokenizer.vocab_size <= largest_mock_token_id:
        raise ValueError(
            f"--mock-data: megatron-core's MockGPTDataset uses token ids up to "
            f"{largest_mock_token_id}, but the tokenizer's vocabulary has {tokenizer.vocab_size} "
            f"ids; use a vocabulary of at least {largest_mock_token_id + 1} ids (NullTokenizer: "
            f"--vocab-size {largest_mock_token_id} or more)"
        )


class _DatasetBuilder(BlendedMegatronDatasetBuilder):
    """megatron-core's builder, made usable without torch.distributed for blends.

    megatron-core 0.12.1's `BlendedDataset` calls `torch.distributed.get_rank()` on an index
    cache miss even when torch.distributed is not initialized (its `GPTDataset` checks first).
    Without torch.distributed this builder gives `BlendedDataset` a config without a cache
    path, so it builds its (cheap, deterministic) blend index in memory; the `GPTDataset`
    indices are still cached where the config says.
    """

    @staticmethod
    def build_generic_dataset(
        cls: type | Callable, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool,
        *args: object,
    ) -> object:
        if cls is BlendedDataset and not _distributed_is_initialized():
            *dataset_args, config = args
            assert isinstance(config, BlendedMegatronDatasetConfig), type(config)
            args = (*dataset_args, dataclasses.replace(config, path_to_cache=None))
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def _distributed_is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def build_train_valid_test_datasets(
    args: argparse.Namespace,
    tokenizer: MegatronTokenizer,
    is_built_on_rank: Callable[[], bool] | None = None,
    barrier: Callable[[], None] | None = None,
    builds_cache_first: bool | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Build the (train, valid, test) datasets `args` describes; a split may be None.

    is_built_on_rank: whether this rank needs datasets (Megatron-LM passes "first or last
        pipeline stage and tensor-parallel rank 0"); a rank that does not gets Nones. Defaults
        to every rank.

    Only one process may write the shared index cache (`.npy` files) while the others wait:

    - when torch.distributed is initialized, megatron-core's builder does this itself: global
      rank 0 builds (and writes the cache) first, all ranks meet at `torch.distributed.barrier`,
      then the others build from the cache. `barrier` and `builds_cache_first` are not used.
    - otherwise, when `barrier` is given, the process with `builds_cache_first=True` builds,
      then calls `barrier()`; every other process calls `barrier()` first, then builds from the
      cache. Every process calls `barrier()` exactly once (the first builder also when its
      build fails). The first builder must be a rank that builds datasets.
    - with neither, this process simply builds (a single-process job).
    """
    if is_built_on_rank is None:
        is_built_on_rank = _every_rank
    config = gpt_dataset_config_from_args(args, tokenizer)
    sizes = get_train_valid_test_num_samples(args)
    if config.mock:
        _check_mock_vocab_size(tokenizer)
    else:
        _check_prefixes_and_splits(config, sizes)
    dataset_class = MockGPTDataset if config.mock else GPTDataset

    def build() -> tuple[torch.utils.data.Dataset | None, ...]:
        builder = _DatasetBuilder(dataset_class, list(sizes), is_built_on_rank, config)
        return tuple(builder.build())

    no_datasets = (None, None, None)
    if _distributed_is_initialized():
        return build()
    if barrier is None:
        return build() if is_built_on_rank() else no_datasets
    if builds_cache_first is None:
        raise ValueError(
            "build_train_valid_test_datasets: with a barrier, pass builds_cache_first=True on "
            "exactly one process (the one that writes the index cache) and False on the others"
        )
    if builds_cache_first:
        if not is_built_on_rank():
            raise ValueError(
                "build_train_valid_test_datasets: the process that builds the cache first "
                "(builds_cache_first=True) must be one whose is_built_on_rank() is True"
            )
        try:
            return build()
        finally:
            barrier()  # also on failure, so that no other process waits forever
    barrier()
    return build() if is_built_on_rank() else no_datasets


def _every_rank() -> bool:
    return True


class MegatronPretrainingSampler:
    """Megatron-LM's sequential pretraining batch sampler (yields lists of sample indices).

    Indices run from `consumed_samples` to `total_samples`; each block of
    `micro_batch_size * data_parallel_size` consecutive indices is one micro batch for every
    DP rank, of which rank r takes the slice [r * micro_batch_size, (r + 1) * micro_batch_size).
    A last, incomplete block is dropped when `drop_last` (the default); otherwise each rank
    takes what there is of its slice of it.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: total_samples is {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} is outside the dataset's "
                f"{total_samples} samples: nothing is left to consume"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.samples_per_step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        rank_begin = self.data_parallel_rank * self.micro_batch_size
        rank_end = rank_begin + self.micro_batch_size
        block_begin = self.consumed_samples
        while block_begin + self.samples_per_step <= self.total_samples:
            yield list(range(block_begin + rank_begin, block_begin + rank_end))
            block_begin += self.samples_per_step
        if not self.drop_last:
            # As Megatron-LM: this rank's slice of the incomplete last block, as far as it goes.
            last_block = range(block_begin + rank_begin, min(block_begin + rank_end, self.total_samples))
            if len(last_block) > 0:
                yield list(last_block)


def build_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """A DataLoader over `dataset` in MegatronPretrainingSampler order, with `num_workers`
    persistent worker processes (Megatron-LM's loader; 0: none)."""
    if num_workers < 0:
        raise ValueError(f"--num-workers {num_workers}: allowed: 0 (load in the training "
                         "process) or a positive number of worker processes")
    sampler = MegatronPretrainingSampler(
        total_samples=len(cast(Sized, dataset)),  # torch's Dataset type has no __len__
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       persistent_workers=num_workers > 0)


def build_data_iterator(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> Iterator[Batch] | None:
    """Iterate micro batches of `dataset` for one DP rank, starting after `consumed_samples`.

    `consumed_samples` counts samples of all DP ranks together (Megatron-LM's
    `args.consumed_train_samples`). Each item is a dict of CPU tensors: `tokens`, `labels`,
    `position_ids` ([micro_batch_size, seq_length] int64) and `loss_mask` (float32); there is no
    `attention_mask` (the model builds the causal mask). A blended dataset (several
    `--data-path` prefixes) adds megatron-core's `dataset_id` ([micro_batch_size] int64, which prefix each
    sample came from). Returns None when `dataset` is None (a rank that builds no datasets), as
    Megatron-LM does. `num_workers`: Megatron-LM's `--num-workers` (see `build_data_loader`).
    """
    if dataset is None:
        return None
    return iter(
        build_data_loader(
            dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
            num_workers,
        )
    )
