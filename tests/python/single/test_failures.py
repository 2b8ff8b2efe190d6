"""A rank that hangs (stopped, not dead) under `horovodrun`, as a user meets it: the job must end
with the stall named on the surviving rank within the stall shutdown time plus a few seconds,
through TensorFlow ops (the error reaches the script as an exception)."""

import os
import re
import subprocess
import sys
import time

import pytest


def horovodrun(*args, stall=None, env=None):
    """`horovodrun -np 2` of this Python on `args` (the script first), with the stall check's
    warning and shutdown times `stall` (seconds) where given: its exit status and output."""
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2"]
    if stall is not None:
        command += ["--stall-check-warning-time-seconds", str(stall[0]),
                    "--stall-check-shutdown-time-seconds", str(stall[1])]
    out = subprocess.run(command + [sys.executable] + [str(a) for a in args],
                         capture_output=True, text=True, timeout=180, env=env)
    return out.returncode, out.stdout + out.stderr


def test_stopped_rank_ends_the_job_with_the_missing_rank_named(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "import tensorflow as tf\n"
        "import horovod.tensorflow as hvd\n"
        "hvd.init()\n"
        "for step in range(5):\n"
        "    s = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum, name='g')\n"
        "    assert s.numpy().tolist() == [2.0, 4.0], s\n"
        "def note(name, text):\n"
        "    # a file, not stdout: mpirun's forwarded output of a rank that stops can arrive cut\n"
        "    with open(os.path.join(sys.argv[1], name), 'w') as f:\n"
        "        f.write(text)\n"
        "if hvd.rank() == 1:\n"
        "    note('stopping', repr(time.time()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "try:\n"
        "    hvd.allreduce(tf.constant([1.0]), name='after')\n"
        "except Exception as e:\n"
        "    # per rank: mpirun resumes the stopped rank (SIGCONT) when it ends the job, and that\n"
        "    # rank then fails too\n"
        "    note('error.%d' % hvd.rank(), repr(time.time()) + ' ' + type(e).__name__ + ' ' + str(e))\n"
        "    raise\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.time()
    returncode, text = horovodrun(script, tmp_path, stall=(2, 6), env=env)
    assert returncode != 0, text
    stop_file, err_file = tmp_path / "stopping", tmp_path / "error.0"
    assert stop_file.exists() and err_file.exists(), text
    stopped_at = float(stop_file.read_text())
    failed_at, err = err_file.read_text().split(" ", 1)
    failed_at = float(failed_at)
    assert "Missing ranks: 1." in err, err
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=6" in err, err
    # the shutdown time (6 s), the presence probe (3 s), a margin for a loaded machine
    assert 6 <= failed_at - stopped_at < 16, (stopped_at, failed_at)
    # and the whole job ended (mpirun killed the stopped rank) soon after
    assert time.time() - failed_at < 30, text


@pytest.mark.parametrize("last", ["torch.ones(1)", "torch.ones(3).to_sparse()"])
def test_stopped_rank_ends_a_torch_distributed_job_with_dist_backend_error(tmp_path, last):
    """The same through torch.distributed's `ferrovod` backend: the surviving rank's
    `all_reduce` (dense, or sparse: two gathers) raises DistBackendError naming the missing
    rank."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "import ferrovod.torch\n"
        "dist.init_process_group('ferrovod')\n"
        "for step in range(5):\n"
        "    x = torch.tensor([1.0, 2.0])\n"
        "    dist.all_reduce(x)\n"
        "    assert x.tolist() == [2.0, 4.0], x\n"
        "def note(name, text):\n"
        "    with open(os.path.join(sys.argv[1], name), 'w') as f:\n"
        "        f.write(text)\n"
        "if dist.get_rank() == 1:\n"
        "    note('stopping', repr(time.time()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "try:\n"
        "    dist.all_reduce(%s)\n" % last +
        "except Exception as e:\n"
        "    note('error.%d' % dist.get_rank(), repr(time.time()) + ' ' + type(e).__name__ + ' ' + str(e))\n"
        "    raise\n"
    )
    start = time.time()
    returncode, text = horovodrun(script, tmp_path, stall=(2, 6))
    assert returncode != 0, text
    stop_file, err_file = tmp_path / "stopping", tmp_path / "error.0"
    assert stop_file.exists() and err_file.exists(), text
    stopped_at = float(stop_file.read_text())
    failed_at, err = err_file.read_text().split(" ", 1)
    failed_at = float(failed_at)
    assert err.startswith("DistBackendError "), err
    assert "Missing ranks: 1." in err, err
    assert 6 <= failed_at - stopped_at < 16, (stopped_at, failed_at)
    assert time.time() - start < 120, text


@pytest.mark.parametrize("where", ["world", "new_group", "monitored_barrier"])
def test_a_groups_timeout_ends_a_call_the_other_ranks_never_make(tmp_path, where):
    """A group's `timeout` (init_process_group's, or new_group's) bounds how long a collective
    waits for the group's other ranks, as gloo's and NCCL's do, though ferrovod's stall limit is
    a minute: rank 0 calls `barrier` alone and gets DistBackendError saying "Timed out" once the
    2 s have passed; rank 1, which went on without it, gets the same error at its next call.
    Calls whose ranks arrive half a second apart, within the timeout, are not ended by it.
    `monitored_barrier`: the same with the call's own timeout of 2 s, the group's being long,
    rank 0's error saying first in gloo's words which rank failed to pass it."""
    script = tmp_path / "job.py"
    script.write_text(
        "import datetime, os, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "import ferrovod.torch\n"
        "short, long = datetime.timedelta(seconds=2), datetime.timedelta(seconds=120)\n"
        "where = sys.argv[2]\n"
        "dist.init_process_group('ferrovod', timeout=short if where == 'world' else long)\n"
        "dist.monitored_barrier(timeout=short)\n"
        "group = dist.new_group([0, 1], timeout=short) if where == 'new_group' else None\n"
        "for step in range(3):\n"
        "    time.sleep(0.5 * dist.get_rank())\n"
        "    x = torch.tensor([1.0, 2.0])\n"
        "    dist.all_reduce(x, group=group)\n"
        "    assert x.tolist() == [2.0, 4.0], x\n"
        "dist.barrier()\n"
        "def note(name, text):\n"
        "    with open(os.path.join(sys.argv[1], name), 'w') as f:\n"
        "        f.write(text)\n"
        "start = time.time()\n"
        "try:\n"
        "    if dist.get_rank() == 0:\n"
        "        if where == 'monitored_barrier':\n"
        "            dist.monitored_barrier(timeout=short)\n"
        "        else:\n"
        "            dist.barrier(group=group)\n"
        "    else:\n"
        "        time.sleep(5)\n"
        "        dist.all_reduce(torch.ones(1), group=group)\n"
        "except Exception as e:\n"
        "    note('error.%d' % dist.get_rank(), repr(time.time() - start) + ' ' + type(e).__name__ + ' ' + str(e))\n"
        "    # rank 0 stays until rank 1 has failed too (its exit would end the job)\n"
        "    while not os.path.exists(os.path.join(sys.argv[1], 'error.1')) and time.time() - start < 20:\n"
        "        time.sleep(0.1)\n"
        "    raise\n"
    )
    start = time.time()
    returncode, text = horovodrun(script, tmp_path, where, stall=(30, 60))
    assert returncode != 0, text
    for rank in (0, 1):
        err_file = tmp_path / ("error.%d" % rank)
        assert err_file.exists(), text
        after, err = err_file.read_text().split(" ", 1)
        if where == "monitored_barrier" and rank == 0:
            # in gloo's words, then the core's
            assert err.startswith("DistBackendError ferrovod: [Rank 0]: Rank 1 failed to pass "
                                  "monitoredBarrier in 2000 ms (ferrovod: Timed out waiting for "
                                  "ranks"), err
        else:
            assert err.startswith("DistBackendError ferrovod: Timed out waiting for ranks"), err
        # the words PyTorch's own timeout tests look for
        assert re.search(" (Timed out|closed|timeout) ", err), err
        assert "timeout of 2.0 s" in err and "rank(s) [1]" in err, err
        if rank == 0:
            assert 2.0 <= float(after) < 8.0, after
    assert time.time() - start < 60, text


def test_takeover_by_environment_needs_no_import_of_ferrovod(tmp_path):
    """FERROVOD_TORCH_TAKEOVER=1: a script that never imports ferrovod and asks for `gloo` runs
    on ferrovod's backend, said once by rank 0; unset or `false`, torch's own gloo rendezvous
    runs (and fails for want of RANK, which MPI does not set)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "x = torch.ones(3)\n"
        "dist.all_reduce(x)\n"
        "assert x.tolist() == [2.0, 2.0, 2.0], x\n"
        "print('rank %d backend %s' % (dist.get_rank(), dist.get_backend()), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    returncode, text = horovodrun(script, env=dict(os.environ, FERROVOD_TORCH_TAKEOVER="1"))
    assert returncode == 0, text
    assert "rank 0 backend ferrovod" in text and "rank 1 backend ferrovod" in text, text
    assert text.count("runs on ferrovod") == 1, text
    env = {k: v for k, v in os.environ.items() if k != "FERROVOD_TORCH_TAKEOVER"}
    # unset, or off in any of the words the core's switches take for off
    for off in (None, "false"):
        if off is not None:
            env["FERROVOD_TORCH_TAKEOVER"] = off
        returncode, text = horovodrun(script, env=env)
        assert returncode != 0 and "RANK expected" in text, (off, text)
