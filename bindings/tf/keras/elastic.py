"""`hvd.elastic` for Keras: KerasState and the callbacks that keep it current during `fit`."""

from ferrovod.tensorflow.elastic import TensorFlowKerasState, run  # noqa: F401
from ferrovod.tensorflow.keras.callbacks import _Callback as Callback


class KerasState(TensorFlowKerasState):
    """State of a Keras model and optimizer, plus plain attributes such as `batch` and `epoch`."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(Callback):
    """Commits `state` every `batches_per_commit` batches and at the end of each epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(Callback):
    """Keeps `state.batch` at the batch in progress (reset at each epoch's end)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(Callback):
    """Keeps `state.epoch` at the epoch in progress."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
