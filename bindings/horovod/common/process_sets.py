"""Process sets, as in Horovod: `ProcessSet(ranks)`, `global_process_set`, and collective
`add_process_set` / `remove_process_set`. Registration and ids live in ferrovod's core."""

from ferrovod import _core


class ProcessSet:
    """A subset of ranks that collectives may run on. Build it before `hvd.init(process_sets=...)`
    or register it later with `hvd.add_process_set`."""

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            from mpi4py import MPI

            self.mpi_comm = ranks_or_comm
            world_group = MPI.COMM_WORLD.Get_group()
            group = ranks_or_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
            self.ranks = sorted(ranks)
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """Number of ranks, or None before the set is registered."""
        if self.process_set_id is None:
            return None
        return _core.process_set_size(self.process_set_id)

    def rank(self):
        """This process's rank within the set (-1 if not a member), or None if unregistered."""
        if self.process_set_id is None:
            return None
        return _core.process_set_rank(self.process_set_id)

    def included(self):
        """Whether this process is a member, or None if the set is not registered."""
        if self.process_set_id is None:
            return None
        return _core.process_set_rank(self.process_set_id) >= 0

    def __str__(self):
        return "ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)" % (
            self.process_set_id,
            self.ranks,
            self.mpi_comm,
        )

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered = {0: global_process_set}


def _setup(process_sets):
    """After init: give the ProcessSet objects passed to `hvd.init` their ids (duplicates get None,
    as in Horovod) and refresh the global set's ranks."""
    global_process_set.ranks = _core.process_set_ranks(0)
    seen = set()
    for ps in process_sets or []:
        key = tuple(ps.ranks)
        if key in seen:
            ps.process_set_id = None
            continue
        seen.add(key)
        for set_id in _core.process_set_ids():
            if set_id != 0 and _core.process_set_ranks(set_id) == ps.ranks:
                ps.process_set_id = set_id
                _registered[set_id] = ps


def add_process_set(process_set):
    """Registers a process set on every rank (collective: all ranks must call it). Accepts a
    ProcessSet or a list of ranks; returns the registered ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError("Attempted to add a process set that has already been added: %s" % process_set)
    process_set.process_set_id = _core.add_process_set(process_set.ranks)
    _registered[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Removes a process set on every rank (collective). Returns False for the global set or an
    unregistered set, True when removed."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    _core.remove_process_set(set_id)
    _registered.pop(set_id, None)
    process_set._invalidate()
    return True


def registered_id(process_set):
    """The set's id for an operation: a set that was never registered is refused (as Horovod
    does), never taken for the global set."""
    if process_set.process_set_id is None:
        raise ValueError("Process set %s has not been registered (hvd.add_process_set)." % process_set)
    return process_set.process_set_id
