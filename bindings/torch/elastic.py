"""`hvd.elastic` for PyTorch: the state of a model, an optimizer and samplers (see
horovod.common.elastic for what ferrovod's fixed MPI world means for elastic jobs)."""

import copy
import math

import torch

from ferrovod import _core
from ferrovod.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from horovod.common.elastic import ObjectState, run_fn


def run(func):
    """Decorator for the training function `func(state, ...)`: the state is synchronised from
    rank 0 first, and restored to its last commit if a collective fails."""
    return run_fn(func)


class TorchState(ObjectState):
    """State of a model (`state_dict`), an optimizer, `ElasticSampler`s given as keyword
    arguments, and plain attributes (the other keyword arguments)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for k in self._samplers:
            kwargs.pop(k)
        for k, v in self._samplers.items():
            object.__setattr__(self, k, v)
        self._saved = {}
        super().__init__(bcast_object=broadcast_object, get_rank=_core.rank, **kwargs)
        self._save_objects()

    def _save_objects(self):
        self._saved = {
            "model": copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            "optimizer": (copy.deepcopy(self.optimizer.state_dict())
                          if self.optimizer is not None else None),
            "samplers": {k: s.state_dict() for k, s in self._samplers.items()},
        }

    def save(self):
        self._save_objects()
        super().save()

    def restore(self):
        if self.model is not None:
            self.model.load_state_dict(self._saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved["optimizer"])
        for k, s in self._samplers.items():
            s.load_state_dict(self._saved["samplers"][k])
        super().restore()

    def sync(self):
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k, s in self._samplers.items():
            s.load_state_dict(broadcast_object(s.state_dict(), root_rank=0, name="sampler." + k))
        super().sync()
        self._save_objects()


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a dataset's indices among the ranks (each rank every size-th index of the
    permutation, from its rank) and skips the ones already processed this epoch
    (`record_batch`), so that a restored job resumes where it committed."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Marks the indices of this epoch's batch `batch_idx` (of every rank) as processed."""
        start = batch_idx * batch_size * self.num_replicas
        self.processed_indices.update(self.remaining_indices[start:start + batch_size * self.num_replicas])

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def reset(self):
        self.num_replicas = _core.size() if _core.is_initialized() else 1
        self.rank = _core.rank() if _core.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        if indices:
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
