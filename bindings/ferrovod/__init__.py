"""ferrovod: Horovod-compatible data-parallel training communication on a Rust core.

`ferrovod.tensorflow` is Horovod's TensorFlow API under ferrovod's own name; the `horovod`
package installed alongside maps `import horovod.tensorflow as hvd` onto the same code.
"""

__version__ = "0.1.0"
