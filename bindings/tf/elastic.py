"""`hvd.elastic` for TensorFlow: states of variables and Keras models (see
horovod.common.elastic for what ferrovod's fixed MPI world means for elastic jobs)."""

import tensorflow as tf

from ferrovod.tensorflow.functions import broadcast_object, broadcast_variables, optimizer_variables
from ferrovod.tensorflow.mpi_ops import rank
from horovod.common.elastic import ObjectState, run_fn


def run(func):
    """Decorator for the training function `func(state, ...)`: the state is synchronised from
    rank 0 first, and restored to its last commit if a collective fails."""
    return run_fn(func)


class TensorFlowState(ObjectState):
    """State of eager TensorFlow variables (and plain attributes given as keyword arguments)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None or not tf.executing_eagerly():
            raise ValueError("ferrovod's elastic TensorFlowState supports eager execution (TF2) only")
        self.variables = list(variables or tf.compat.v1.global_variables())
        self._values = [v.numpy() for v in self.variables]
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for var, value in zip(self.variables, self._values):
            var.assign(value)
        super().restore()

    def sync(self):
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """State of a Keras model and its optimizer (their variables), plus plain attributes."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer or getattr(model, "optimizer", None)
        self.backend = backend
        super().__init__(variables=self._keras_variables(), **kwargs)

    def _keras_variables(self):
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += optimizer_variables(self.optimizer)
        return variables

    def sync(self):
        # the optimizer may have created its slots since the state was made
        self.variables = self._keras_variables()
        super().sync()
