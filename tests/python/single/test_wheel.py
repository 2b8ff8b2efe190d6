"""The wheel users install (scripts/wheel.sh): built here, installed with pip into a fresh virtual
environment whose PATH has no Rust toolchain, then used under mpirun from there alone."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

JOB = """
import numpy as np
from ferrovod import _core
from horovod.common.basics import HorovodBasics
hvd = HorovodBasics()
hvd.init()
(x,) = _core.enqueue(_core.ALLREDUCE, [np.arange(4, dtype=np.float32) * (hvd.rank() + 1)], ["x"]).wait()
assert (x == np.arange(4, dtype=np.float32) * sum(range(1, hvd.size() + 1))).all(), x
print("rank %d of %d: %s from %s" % (hvd.rank(), hvd.size(), x.tolist(), _core.library_path()))
hvd.shutdown()
"""


def test_the_wheel_installs_and_runs_without_rust(tmp_path):
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "wheel.sh")], check=True,
                   capture_output=True, text=True)
    (wheel,) = glob.glob(os.path.join(ROOT, "dist", "ferrovod-*.whl"))
    name = os.path.basename(wheel)
    # one wheel for every Python 3, tagged for the oldest glibc it runs on
    assert "-py3-none-manylinux_2_" in name and name.endswith("_x86_64.whl"), name
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    assert any(f.startswith("ferrovod/libferrovod") and f.endswith(".so") for f in files)
    assert "ferrovod/ferrovod.h" in files and "ferrovod-takeover.pth" in files
    # the system's MPI stays outside the wheel
    assert not any("libmpi" in f for f in files)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = "%s:/usr/local/bin:/usr/bin:/bin" % (venv / "bin")
    assert shutil.which("cargo", path=env["PATH"]) is None
    assert shutil.which("rustc", path=env["PATH"]) is None
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", wheel], check=True,
                   env=env, cwd=tmp_path)
    (tmp_path / "job.py").write_text(JOB)
    out = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                          str(venv / "bin" / "python"), "job.py"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[0.0, 3.0, 6.0, 9.0] from %s" % venv) == 2, out.stdout
    check = subprocess.run([str(venv / "bin" / "horovodrun"), "--check-build"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "[X] MPI" in check.stdout, check.stdout + check.stderr
