"""`horovod.tensorflow.elastic`, implemented by ferrovod."""

from ferrovod.tensorflow.elastic import *  # noqa: F401,F403
