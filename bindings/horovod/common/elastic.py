"""Elastic training state (`hvd.elastic`): objects that can be committed, restored after a
failed step, and synchronised from rank 0.

ferrovod runs on the fixed MPI world that `mpirun` started, so the state objects and `run`
work as Horovod documents for recovering a step (restore the last commit, synchronise, go on),
but a job does not grow or shrink: when a collective fails the world cannot be re-formed, and
`run` re-raises the error after restoring the state."""

import copy
import functools

from horovod.common import basics
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt


class State:
    """Base of the elastic states: `commit()` saves, `restore()` returns to the last save,
    `sync()` makes every rank hold rank 0's state."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = None
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        pass

    def commit(self):
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Hosts never change under a fixed MPI world."""

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def reset(self):
        pass


class ObjectState(State):
    """State made of plain Python attributes (`batch=0, epoch=0`), synchronised with
    `broadcast_object`."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _restart():
    basics.shutdown()
    basics.init()


def run_fn(func, reset=_restart):
    """Horovod's elastic loop around `func(state, ...)`: synchronise, run; on a failed
    collective restore the last commit and reset the runtime (shut down and start again); on a
    host update keep the state and reset."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                state.restore()
                raise HorovodInternalError(
                    "%s (the state was restored to its last commit; ferrovod's MPI world is fixed, "
                    "so the job cannot continue on a re-formed set of workers)" % e) from e
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()

    return wrapper
