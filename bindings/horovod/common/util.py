"""Helpers that Horovod's framework modules, tests and user code import from
`horovod.common.util`."""

import functools
import importlib.util
import os
import warnings

from horovod.common.exceptions import HorovodVersionMismatchError  # noqa: F401

_FRAMEWORKS = {"tensorflow": "tensorflow", "torch": "torch", "mxnet": "mxnet"}


def check_extension(ext_name, ext_env_var, pkg_path, *args):
    """Horovod checks for a compiled per-framework extension here; ferrovod has one shared
    library, loaded by ferrovod._core, so there is nothing to check."""


def extension_available(ext_base_name, verbose=False):
    """Whether `horovod.<framework>` can be used: ferrovod must have a binding for it and the
    framework itself must import."""
    module = _FRAMEWORKS.get(ext_base_name, ext_base_name)
    binding = "ferrovod.%s" % module
    if importlib.util.find_spec(binding) is None:
        if verbose:
            warnings.warn("ferrovod has no %s binding yet" % module)
        return False
    try:
        __import__(module)
        return True
    except ImportError:
        if verbose:
            warnings.warn("%s is not installed" % module)
        return False


def gpu_available(ext_base_name, verbose=False):
    """Whether `horovod.<framework>` runs collectives on GPU tensors: PyTorch's CUDA tensors
    do (through NCCL) where CUDA is available; the TensorFlow and MXNet ops run on host memory."""
    if ext_base_name == "torch" and extension_available("torch"):
        import torch

        return torch.cuda.is_available()
    if verbose:
        warnings.warn("ferrovod's %s ops run on host memory only" % ext_base_name)
    return False


def mpi_built(verbose=False):
    return True


def gloo_built(verbose=False):
    return False


def nccl_built(verbose=False):
    return 0


def ddl_built(verbose=False):
    return False


def ccl_built(verbose=False):
    return False


def cuda_built(verbose=False):
    return False


def rocm_built(verbose=False):
    return False


def is_version_greater_equal_than(ver, target):
    from packaging import version

    return version.parse(str(ver)) >= version.parse(str(target))


def get_average_backwards_compatibility_fun(reduce_ops):
    """Horovod's handling of the deprecated `average=` argument next to `op=`."""

    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            warnings.warn(
                "Parameter `average` has been replaced with `op` and will be removed in v1.0",
                DeprecationWarning,
            )
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


def num_rank_is_power_2(num_rank):
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items, num_parts):
    """`items` in `num_parts` consecutive, nearly equal parts."""
    d, r = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + d + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def _cache(f):
    """Memoises `f` on its (hashable) arguments, as Horovod's `util._cache`."""
    cache = {}

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = f(*args, **kwargs)
        return cache[key]

    return wrapper


def env(**kwargs):
    """Context manager setting environment variables, restoring them afterwards."""
    import contextlib

    @contextlib.contextmanager
    def _env():
        saved = {k: os.environ.get(k) for k in kwargs}
        os.environ.update({k: str(v) for k, v in kwargs.items()})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return _env()
