"""A free TCP port chosen on rank 0 and told to every rank, for the tests that start a gloo
process group next to ferrovod (DDP needs one for its construction)."""

import socket

import horovod.torch as hvd


def free_port_from_rank0(name):
    port = None
    if hvd.rank() == 0:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
    return hvd.broadcast_object(port, root_rank=0, name=name)
