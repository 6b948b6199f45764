"""Training data through megatron-core's dataset stack, and batches that resume at a sample position.

`--data-path` prefixes (optionally weighted) become megatron's `GPTDataset`s, blended and split by
`BlendedMegatronDatasetBuilder`. `StepBatches` hands each step its global batch: samples
`[consumed, consumed + global_batch)` of the training split, this data-parallel rank's share of them as
micro batches, so a job restarted with `consumed_samples` from a checkpoint continues at exactly the next
sample.

megatron caches the datasets' index arrays as `.npy` files (in `--data-cache-path`, else in
`PREFIX/cache/GPTDataset_indices/`); the job loads them with pickle disallowed (`indexcache.py`).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list

from .corpus import default_cache_dir, ensure_default_corpus
from .datapath import DataError, check_data_path
from .indexcache import no_pickle_index_loads


def resolve_data_path(data_path: Optional[Sequence[str]]) -> List[str]:
    """The `--data-path` list, or the generated corpus (written on local rank 0 of each machine first)."""
    if data_path:
        check_data_path(data_path)
        return list(data_path)
    cache = default_cache_dir()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ensure_default_corpus(cache)
    if dist.is_initialized():
        dist.barrier()
    return [ensure_default_corpus(cache)]  # present now: returns the prefix


def build_train_dataset(args, tokenizer) -> GPTDataset:
    """The training split of `--data-path`, sized for `--train-iters` global batches."""
    prefixes = resolve_data_path(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(prefixes),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
        # the index caches load while building, under no_pickle_index_loads (deferred, they would load later)
        defer_npy_index_mmap=False,
    )
    samples = [args.train_iters * args.global_batch_size, 0, 0]
    with no_pickle_index_loads():
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()
    if train is None:
        raise DataError(f"--split={args.split!r} leaves no training data in {prefixes}")
    return train


class StepBatches:
    """The micro batches of one step for this data-parallel rank, from a sample position.

    Megatron's sample order: the global batch is cut into rounds of `micro_batch_size x dp` samples; in each
    round data-parallel rank r takes the r-th slice of `micro_batch_size`.
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.gbs = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp_size)

    def step(self, consumed_samples: int) -> List[Dict[str, torch.Tensor]]:
        """The micro batches (tokens, labels, loss_mask, position_ids) for the step starting at
        `consumed_samples`.

        Raises:
            IndexError: the dataset holds fewer samples than the step needs.
        """
        if consumed_samples + self.gbs > len(self.dataset):
            raise IndexError(f"step at sample {consumed_samples} needs {self.gbs} samples; the training split "
                             f"has {len(self.dataset)}")
        batches = []
        for m in range(self.num_microbatches):
            first = consumed_samples + m * self.mbs * self.dp_size + self.dp_rank * self.mbs
            samples = [self.dataset[i] for i in range(first, first + self.mbs)]
            batches.append({k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask", "position_ids")})
        return batches
