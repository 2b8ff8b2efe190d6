"""Compiles the TensorFlow op library (mpi_ops.cc) against the TensorFlow that is imported, on
first use, into a cache keyed by the TensorFlow version, the compile flags and the sources.
Upgrading TensorFlow therefore leads to a rebuild, never to an ABI crash."""

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _header_dir():
    if os.path.exists(os.path.join(HERE, "ferrovod.h")):
        return HERE  # installed package: the header was copied beside the source
    repo_include = os.path.join(HERE, "..", "..", "include")
    if os.path.exists(os.path.join(repo_include, "ferrovod.h")):
        return repo_include  # running from a source checkout
    raise ImportError("ferrovod.h not found beside %s; reinstall ferrovod" % HERE)


def _cache_root():
    root = os.environ.get("FERROVOD_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ferrovod")
    return root


def op_library_path():
    """Path of the op library for the imported TensorFlow, building it if needed."""
    import tensorflow as tf

    source = os.path.join(HERE, "mpi_ops.cc")
    header = os.path.join(_header_dir(), "ferrovod.h")
    cflags = tf.sysconfig.get_compile_flags()
    lflags = tf.sysconfig.get_link_flags()
    digest = hashlib.sha256()
    for path in (source, header):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(cflags + lflags + [tf.__version__, sys.version]).encode())
    out_dir = os.path.join(_cache_root(), "tf-%s-%s" % (tf.__version__, digest.hexdigest()[:16]))
    lib = os.path.join(out_dir, "ferrovod_tf_ops.so")
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
               "-I", os.path.dirname(header)] + cflags + lflags
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise ImportError(
                "building ferrovod's TensorFlow ops for TensorFlow %s failed:\n%s\n%s"
                % (tf.__version__, " ".join(cmd), result.stderr[-4000:])
            )
        os.replace(tmp, lib)
    return lib
