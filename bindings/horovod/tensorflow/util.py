"""`horovod.tensorflow.util` — implemented by ferrovod."""

from ferrovod.tensorflow.util import (  # noqa: F401
    _cache,
    _executing_eagerly,
    _make_subgraph,
    refs_to_vars,
    vars_to_refs,
)
