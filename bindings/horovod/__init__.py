"""Horovod's public package, implemented by ferrovod. Scripts keep `import horovod.tensorflow as
hvd` (and friends) and run on ferrovod's engine."""

# Horovod's API level this package implements, with ferrovod's version as the local label.
__version__ = "0.28.1+ferrovod.0.1.0"
