"""`horovod.keras.callbacks` — the same callbacks as `horovod.tensorflow.keras.callbacks`."""

from horovod.tensorflow.keras.callbacks import (  # noqa: F401
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
