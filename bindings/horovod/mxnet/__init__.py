"""`import horovod.mxnet as hvd` — Horovod's MXNet API, implemented by ferrovod."""

from ferrovod.mxnet import *  # noqa: F401,F403
