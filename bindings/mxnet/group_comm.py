"""GroupComm: collectives within groups of ranks, as MXNet engine operations (AIACC's group
communication), for data + model parallel training.

Every operation of `ferrovod.mxnet` also takes `process_set=`; a GroupComm is a process set
with the operations as methods, so that a script holding several groups (say a model-parallel
and a data-parallel one) writes `model.allgather(x)` and `data.allreduce(g)` instead of
threading `process_set=` through every call. Creating groups is collective over all ranks of
the job, in the same order everywhere (each group is a process set); a rank outside a group
must not call its operations.
"""

from horovod.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


class GroupComm:
    """The ranks `ranks` (global ranks, sorted) as one communicator. `rank()`/`size()` are this
    rank's place in it; the methods are `ferrovod.mxnet`'s with `process_set` filled in."""

    # every group alive, in creation order (the same on every rank): `free_all` frees them
    _made = []

    def __init__(self, ranks):
        ranks = sorted(ranks)
        if ranks == list(global_process_set.ranks):
            self.process_set = global_process_set  # every rank: the job's own set
        else:
            self.process_set = add_process_set(ProcessSet(ranks))
        self.ranks = ranks
        GroupComm._made.append(self)

    def rank(self):
        return self.process_set.rank()

    def size(self):
        return self.process_set.size()

    def included(self):
        return self.process_set.included()

    def free(self):
        """Unregisters the group (collective, as creating it was)."""
        if self.process_set is not global_process_set:
            remove_process_set(self.process_set)
        if self in GroupComm._made:
            GroupComm._made.remove(self)

    @staticmethod
    def free_all():
        """Frees every group still alive, in creation order (collective)."""
        for group in list(GroupComm._made):
            group.free()

    def _op(self, name):
        import ferrovod.mxnet as fv

        fn = getattr(fv, name)
        return lambda *args, **kwargs: fn(*args, process_set=self.process_set, **kwargs)

    def __getattr__(self, name):
        if name in ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
                    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
                    "reducescatter", "grouped_reducescatter", "barrier", "broadcast_object",
                    "allgather_object"):
            return self._op(name)
        raise AttributeError(name)

    @staticmethod
    def grid(model_size):
        """Splits the job into model-parallel groups of `model_size` consecutive ranks and
        data-parallel groups of the ranks at the same place in each (rank r is in model group
        r // model_size and data group r % model_size). Creates every group on every rank;
        returns this rank's (model, data) pair."""
        from ferrovod.mxnet import rank, size

        n = size()
        if model_size < 1 or n % model_size:
            raise ValueError("model_size %d does not divide %d ranks" % (model_size, n))
        models = [GroupComm(range(g * model_size, (g + 1) * model_size))
                  for g in range(n // model_size)]
        datas = [GroupComm(range(k, n, model_size)) for k in range(model_size)]
        me = rank()
        return models[me // model_size], datas[me % model_size]
