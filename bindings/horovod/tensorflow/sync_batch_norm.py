"""`horovod.tensorflow.sync_batch_norm`, implemented by ferrovod."""

from ferrovod.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
