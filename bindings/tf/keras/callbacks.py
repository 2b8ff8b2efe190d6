"""Horovod's Keras callbacks. They are Keras 3 callbacks that tf_keras (Keras 2) accepts as
well, so one set serves `horovod.tensorflow.keras`, `horovod.keras` and tf_keras models."""

import keras
import numpy as np
import tensorflow as tf


class _Callback(keras.callbacks.Callback):
    """Adds what tf_keras's CallbackList asks of a callback."""

    _supports_tf_logs = False

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False


class BroadcastGlobalVariablesCallback(_Callback):
    """Broadcasts the model's and optimizer's variables from `root_rank` at the end of the first
    batch (when the optimizer's slots exist), so every rank starts from the same state."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = local_variables or []
        self.broadcast_done = False

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        from ferrovod.tensorflow.functions import broadcast_variables, optimizer_variables

        local = {id(v) for v in self.local_variables}
        variables = [v for v in self.model.variables if id(v) not in local]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in optimizer_variables(optimizer) if id(v) not in local]
        with tf.device(self.device):
            broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """Averages the epoch's metrics over the ranks (in sorted order of their names)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        from ferrovod.tensorflow import Average, allreduce

        for metric in sorted(logs):
            value = logs[metric]
            if isinstance(value, (int, float, np.floating, np.integer)) or hasattr(value, "numpy"):
                reduced = allreduce(tf.constant(float(value), tf.float64), op=Average,
                                    name="MetricAverageCallback_%s" % metric.replace("/", "_"))
                logs[metric] = float(reduced.numpy())


def _set_lr(optimizer, lr):
    if isinstance(optimizer.learning_rate, tf.Variable) or hasattr(optimizer.learning_rate, "assign"):
        optimizer.learning_rate.assign(lr)
    else:
        optimizer.learning_rate = lr


def _get_lr(optimizer):
    lr = optimizer.learning_rate
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


class LearningRateScheduleCallback(_Callback):
    """Sets lr = initial_lr × multiplier(epoch) between `start_epoch` and `end_epoch`;
    `staircase=False` uses the fractional epoch (per batch). With momentum_correction, momentum
    is scaled by new_lr / old_lr for the step where lr changes."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and momentum is not None and old_lr > 0 and not callable(momentum):
            self.restore_momentum = momentum
            optimizer.momentum = momentum * new_lr / old_lr

    def _restore(self):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_batch_begin(self, batch, logs=None):
        if self.staircase or not self.steps_per_epoch:
            return
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        if self._in_range(epoch):
            self._adjust(epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size to initial_lr over `warmup_epochs`
    (Goyal et al., "Accurate, Large Minibatch SGD"), per batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0):
        from ferrovod.tensorflow import size

        def multiplier(epoch):
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        from ferrovod.tensorflow import rank

        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1, _get_lr(self.model.optimizer)))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the best model so far, on rank 0 only."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch"):
        filepath = "{epoch}"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        from ferrovod.tensorflow import rank

        if rank() == 0:
            return super()._save_model(*args, **kwargs)
