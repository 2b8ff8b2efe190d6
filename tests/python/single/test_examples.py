"""The documentation-style example, run the way users run it: `horovodrun -np 2 python ...`."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_keras_digits_example_trains_under_horovodrun():
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [horovodrun, "-np", "2", sys.executable, os.path.join(ROOT, "examples", "keras_digits.py"),
         "--epochs", "8"],
        capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    acc = float(re.search(r"final test accuracy: ([0-9.]+)", out.stdout).group(1))
    assert acc > 0.85, out.stdout[-2000:]
    assert re.search(r"training throughput: \d+ samples/s", out.stdout)
    assert "Epoch 8/8" in out.stdout
