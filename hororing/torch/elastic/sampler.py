"""A sampler that shards a dataset across ranks and re-shards what is left after a resize."""

import math
import random

import torch

from ... import context


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but it remembers how many samples the job has processed
    this epoch, so that after the job resumes at another size the rest of the epoch is shared
    out among the new ranks (no sample seen twice, none skipped).

    Put it in the ``TorchState``, call ``record_batch`` after each batch and ``set_epoch`` at
    the end of each epoch (not the start: a resumed epoch must not start over).

    Args:
        dataset: the dataset (of a fixed length).
        shuffle: shuffle the order each epoch (the same order on every rank).
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` with nothing processed."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self):
        """Share the epoch's unprocessed samples among the ranks of the job as it is now."""
        self.num_replicas = context.size()
        self.rank = context.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        if indices:  # pad by repeating from the start so every rank gets num_samples
            while len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
