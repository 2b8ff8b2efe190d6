"""`horovod.torch.elastic`, implemented by ferrovod."""

from ferrovod.torch.elastic import *  # noqa: F401,F403
from ferrovod.torch.elastic import ElasticSampler, TorchState, run  # noqa: F401
