"""Run at interpreter start (by ferrovod-takeover.pth in site-packages) only when
FERROVOD_TORCH_TAKEOVER is set: once `torch` has been imported, imports `ferrovod.torch` and
makes torch.distributed's nccl/gloo/mpi backends ferrovod's, so a script that never imports
ferrovod gets it (as AIACC's `import acspeed` does, without the import)."""

import importlib.abc
import importlib.util
import sys
import warnings


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the first import of `torch` it wraps the real loader so that
    the takeover runs once torch's module has been executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                import ferrovod.torch

                ferrovod.torch.takeover()
            except Exception as e:  # never break the script's `import torch`
                warnings.warn("FERROVOD_TORCH_TAKEOVER: ferrovod could not take over "
                              "torch.distributed: %s" % e)

        spec.loader.exec_module = exec_module
        return spec


if "torch" not in sys.modules and not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTorch())
