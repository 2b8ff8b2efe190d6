"""ferrovod extensions: gossip, multistep allreduces, local SGD and gossip averaging for
TensorFlow, carried by the core (docs/decentralized.md says when to use which).

- `gossip(tensors)`: each rank averages its tensors with one peer's, the peer chosen by the
  core's agreed schedule; every FERROVOD_GOSSIP_SYNC_EVERY-th round is an exact average.
- `multistep_allreduce(tensors, every)`: communicates on every `every`-th call only; returns
  the results and whether this call communicated.
- `LocalSGD(every, warmup)` and `GossipAveraging()`: call them on a model's variables after each
  local optimizer step.
"""

import tensorflow as tf
from tensorflow.python.framework import ops

from ferrovod import _core
from ferrovod.tensorflow.mpi_ops import MPI_LIB, Average
from horovod.common.process_sets import global_process_set, registered_id

# averaging parameters is not part of a model's function: no gradient flows through it
ops.NotDifferentiable("FerrovodGossip")
ops.NotDifferentiable("FerrovodMultistepAllreduce")

_MODES = {"accumulate": _core.MULTISTEP_ACCUMULATE, "latest": _core.MULTISTEP_LATEST}


def _codec(compression):
    """An fv_compression value from a Compression class, a name ('fp16', 'bf16', 'u8') or None."""
    if compression is None:
        return _core.COMPRESSION_JOB
    if isinstance(compression, str):
        names = {"none": _core.COMPRESSION_NONE, "fp16": _core.COMPRESSION_FP16,
                 "bf16": _core.COMPRESSION_BF16, "mixed": _core.COMPRESSION_MIXED,
                 "u8": _core.COMPRESSION_U8}
        if compression not in names:
            raise ValueError("unknown compression %r (none, fp16, bf16, mixed, u8)" % compression)
        return names[compression]
    core = getattr(compression, "core", None)
    return _core.COMPRESSION_NONE if core is None else core


def gossip(tensors, name, compression=None, process_set=global_process_set):
    """Each rank's `tensors` averaged with one peer's: `(x_self + x_peer) / 2`. With
    `compression` ('fp16', 'bf16', 'u8' or a Compression class; None: the job's
    FERROVOD_COMPRESSION), f32 tensors travel as compressed differences against copies both
    ranks of a pair keep, so rounding is sent again rather than lost. `name` is the rendezvous
    name: the same on every rank, one per set of tensors."""
    tensors = list(tensors)
    return MPI_LIB.ferrovod_gossip(
        tensors, tensor_name=name, compression=_codec(compression),
        process_set_id=registered_id(process_set))


def multistep_allreduce(tensors, every, name, mode="accumulate", warmup=0, op=Average,
                        compression=None, process_set=global_process_set):
    """An allreduce that communicates on every `every`-th call of `tensors` only (and on each of
    the first `warmup` calls). `mode` 'accumulate': the calls' inputs are summed in the core
    and the sum is reduced (gradients); 'latest': only the communicating call's input is
    (parameters). Returns (outputs, communicated); where nothing was communicated the outputs
    are the inputs."""
    if mode not in _MODES:
        raise ValueError("mode must be 'accumulate' or 'latest', not %r" % mode)
    if every < 1 or warmup < 0:
        raise ValueError("every must be at least 1 and warmup at least 0")
    tensors = list(tensors)
    outputs, communicated = MPI_LIB.ferrovod_multistep_allreduce(
        tensors, reduce_op=op, multistep=int(every), multistep_mode=_MODES[mode],
        multistep_warmup=int(warmup), compression=_codec(compression), tensor_name=name,
        process_set_id=registered_id(process_set))
    return list(outputs), communicated


class LocalSGD:
    """Local SGD (model averaging): each rank applies its own gradients every step, and every
    `every`-th call the model's variables are averaged over the ranks (one fused allreduce);
    the first `warmup` calls average every time (post-local SGD). Call after each optimizer
    step: `local_sgd(model.trainable_variables)`. Returns whether this call averaged."""

    def __init__(self, every, warmup=0, name="local_sgd", process_set=global_process_set):
        self.every, self.warmup, self.name, self.process_set = every, warmup, name, process_set

    def __call__(self, variables):
        variables = list(variables)
        values, averaged = multistep_allreduce(
            [tf.convert_to_tensor(v) for v in variables], self.every, self.name, mode="latest",
            warmup=self.warmup, op=Average, process_set=self.process_set)

        def assign():
            with tf.control_dependencies([v.assign(x) for v, x in zip(variables, values)]):
                return tf.constant(True)

        return tf.cond(averaged, assign, lambda: tf.constant(False))


class GossipAveraging:
    """Gossip training: each rank applies its own gradients every step, and its variables are
    then averaged with one peer's (every FERROVOD_GOSSIP_SYNC_EVERY-th round with all ranks).
    Call after each optimizer step: `gossip_averaging(model.trainable_variables)`."""

    def __init__(self, compression=None, name="gossip", process_set=global_process_set):
        self.compression, self.name, self.process_set = compression, name, process_set

    def __call__(self, variables):
        variables = list(variables)
        values = gossip([tf.convert_to_tensor(v) for v in variables], self.name, self.compression,
                        self.process_set)
        return tf.group([v.assign(x) for v, x in zip(variables, values)])
