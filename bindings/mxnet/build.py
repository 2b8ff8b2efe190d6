"""The MXNet op library (mpi_ops.cc), compiled against the imported MXNet on first use
(ferrovod/_build.py) with MXNet's own C++ ABI: its wheels use the pre-C++11 one."""

import os

from ferrovod._build import op_library

HERE = os.path.dirname(os.path.abspath(__file__))


def op_library_path():
    """Path of the op library for the imported MXNet, building it if needed."""
    import mxnet as mx

    root = os.path.dirname(os.path.abspath(mx.__file__))
    if not os.path.exists(os.path.join(root, "libmxnet.so")):
        raise ImportError("libmxnet.so not found beside %s" % mx.__file__)
    flags = ["-D_GLIBCXX_USE_CXX11_ABI=0", "-I", os.path.join(root, "include"), "-L", root,
             "-Wl,-rpath," + root, "-l:libmxnet.so"]
    return op_library("mxnet", mx.__version__, os.path.join(HERE, "mpi_ops.cc"), flags,
                      "ferrovod_mxnet_ops.so")
