"""Build hook: ships the C header in the ferrovod package, which the TensorFlow and MXNet
bindings compile their op libraries against on first import (ferrovod/_build.py), and
ferrovod-takeover.pth at the top of site-packages (it does nothing unless
FERROVOD_TORCH_TAKEOVER is set; see ferrovod/_startup.py). Everything else is in pyproject.toml
(setuptools + setuptools-rust)."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithHeader(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(self.build_lib, "ferrovod")
        os.makedirs(target, exist_ok=True)
        shutil.copy(os.path.join(here, "include", "ferrovod.h"), target)
        shutil.copy(os.path.join(here, "bindings", "ferrovod-takeover.pth"), self.build_lib)


setup(cmdclass={"build_py": BuildPyWithHeader})
