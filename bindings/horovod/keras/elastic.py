"""Keras elastic state and callbacks, implemented by ferrovod."""

from ferrovod.tensorflow.keras.elastic import *  # noqa: F401,F403
