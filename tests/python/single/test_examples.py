"""The documentation-style example, run the way users run it: `horovodrun -np 2 python ...`."""

import functools
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


@functools.lru_cache(maxsize=None)
def _digits(*extra):
    """Runs the example under `horovodrun -np 2`; its stdout (each set of arguments runs once: the
    plain run serves both tests)."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [horovodrun, "-np", "2", sys.executable, os.path.join(ROOT, "examples", "keras_digits.py"),
         "--epochs", "8", *extra],
        capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _accuracy(stdout):
    return float(re.search(r"final test accuracy: ([0-9.]+)", stdout).group(1))


def test_keras_digits_example_trains_under_horovodrun():
    out = _digits("--compression", "none")
    assert _accuracy(out) > 0.85, out[-2000:]
    assert re.search(r"training throughput: \d+ samples/s", out)
    assert "Epoch 8/8" in out


def test_keras_digits_accuracy_holds_with_every_codec():
    """The same seeds with gradients travelling as fp16, bf16, mixed and u8 (in the core): test
    accuracy at most 1 % below uncompressed, and within 3 % either way (u8's rounding, whose
    blocks follow how the step's tensors were batched, moves it by about 1 % up or down from
    run to run; a codec that changed training more than that is suspect either way)."""
    plain = _accuracy(_digits("--compression", "none"))
    for codec in ("fp16", "bf16", "mixed", "u8"):
        acc = _accuracy(_digits("--compression", codec))
        assert acc >= plain - 0.01, (codec, acc, plain)
        assert abs(acc - plain) <= 0.03, (codec, acc, plain)
