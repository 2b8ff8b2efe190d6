"""Builds a framework's op library on first use, against the framework that is imported, into
a cache keyed by the framework's version, the flags and the sources: upgrading the framework
leads to a rebuild, never to an ABI crash. Shared by the TensorFlow and MXNet bindings."""

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def header_dir():
    """Where ferrovod.h is: beside this file once installed, include/ in a source checkout."""
    if os.path.exists(os.path.join(HERE, "ferrovod.h")):
        return HERE
    repo_include = os.path.join(HERE, "..", "..", "include")
    if os.path.exists(os.path.join(repo_include, "ferrovod.h")):
        return repo_include
    raise ImportError("ferrovod.h not found beside %s; reinstall ferrovod" % HERE)


def cache_root():
    root = os.environ.get("FERROVOD_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ferrovod")
    return root


def op_library(framework, version, source, flags, name):
    """The path of `name` compiled from the C++ `source` with `flags` (after the source and
    ferrovod.h's directory) for `framework` `version`, building it if needed."""
    header = os.path.join(header_dir(), "ferrovod.h")
    digest = hashlib.sha256()
    for path in (source, header):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(flags + [version, sys.version]).encode())
    out_dir = os.path.join(cache_root(), "%s-%s-%s" % (framework, version, digest.hexdigest()[:16]))
    lib = os.path.join(out_dir, name)
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    # every rank of a job may get here at once: one compiles, the others wait for it
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(lib):
            return lib
        cxx = os.environ.get("CXX", "g++")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, "-std=c++17", "-shared", "-fPIC", "-O2", source, "-o", tmp,
               "-I", os.path.dirname(header)] + flags
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise ImportError("building ferrovod's %s ops for %s %s failed:\n%s\n%s"
                              % (framework, framework, version, " ".join(cmd),
                                 result.stderr[-4000:]))
        os.replace(tmp, lib)
    return lib
