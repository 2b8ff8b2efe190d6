"""horovodrun without running MPI jobs: flags → HOROVOD_* environment and the mpirun command;
plus one real `horovodrun -np 2` run of a small script."""

import os
import subprocess
import sys

import pytest

from horovod.runner import launch


def parse(*argv):
    return launch.make_parser().parse_args(list(argv))


def test_tuning_flags_become_environment():
    args = parse("-np", "4", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                 "--cache-capacity", "0", "--timeline-filename", "/tmp/t.json", "--timeline-mark-cycles",
                 "--no-hierarchical-allreduce", "--autotune", "--autotune-log-file", "/tmp/a.csv",
                 "--no-stall-check", "--stall-check-shutdown-time-seconds", "30",
                 "--mpi-threads-disable", "--log-level", "DEBUG", "python", "train.py")
    env = launch.tuning_env(args)
    assert env == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_TIMELINE": "/tmp/t.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "/tmp/a.csv",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_LOG_LEVEL": "debug",
    }
    assert args.command == ["python", "train.py"]


def test_mpirun_command(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2 slots=2\n")
    args = parse("-np", "6", "--hostfile", str(hostfile), "--mpi-args", "--mca foo bar",
                 "--network-interfaces", "eth0", "python", "train.py", "--lr", "0.1")
    cmd = launch.mpirun_command(args, {"HOROVOD_CYCLE_TIME": "2", "PATH": "/bin", "BASH_FUNC_x%%": "f"})
    assert cmd[:7] == ["mpirun", "--allow-run-as-root", "--tag-output", "-np", "6", "-H", "node1:4,node2:2"]
    assert "-x" in cmd and "HOROVOD_CYCLE_TIME" in cmd and "PATH" in cmd
    assert not any(c.startswith("BASH_FUNC") for c in cmd)
    assert cmd[-4:] == ["python", "train.py", "--lr", "0.1"]
    assert cmd[cmd.index("--mca"):cmd.index("--mca") + 3] == ["--mca", "foo", "bar"]
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "eth0"
    local = launch.mpirun_command(parse("-np", "3", "python", "x.py"), {})
    assert local[local.index("-H") + 1] == "localhost:3"


def test_check_build_lists_mpi():
    out = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "--check-build"],
                         capture_output=True, text=True, check=True).stdout
    assert "[X] MPI" in out and "Available Frameworks:" in out
    # this environment has TensorFlow and PyTorch (both with ferrovod bindings), not MXNet
    assert "[X] TensorFlow" in out and "[X] PyTorch" in out and "[ ] MXNet" in out


def test_extension_available_needs_a_binding():
    from horovod.common.util import extension_available

    assert extension_available("tensorflow")
    assert extension_available("torch")
    assert not extension_available("mxnet")  # a binding, but MXNet is not in this environment
    assert not extension_available("json")  # importable, but ferrovod has no binding for it
    assert not extension_available("no_such_framework")


def test_gloo_is_refused():
    with pytest.raises(SystemExit):
        launch.run_commandline(["--gloo", "-np", "2", "python", "x.py"])


def test_horovodrun_runs_a_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        # before anything of ferrovod is imported: what the launcher exported
        "import os\n"
        "print('nccl connect %s' % os.environ.get('NCCL_RUNTIME_CONNECT'))\n"
        "import numpy as np\n"
        "from horovod.common.basics import HorovodBasics\n"
        "from ferrovod import _core\n"
        "hvd = HorovodBasics()\n"
        "hvd.init()\n"
        "(x,) = _core.enqueue(_core.ALLREDUCE, [np.ones(4, np.float32) * (hvd.rank() + 1)], ['x']).wait()\n"
        "print('rank %d of %d sum %s cycle %s' % (hvd.rank(), hvd.size(), x.tolist(), os.environ['HOROVOD_CYCLE_TIME']))\n"
    )
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "NCCL_RUNTIME_CONNECT"}
    out = subprocess.run([os.path.join(bindir, "horovodrun"), "-np", "2", "--cycle-time-ms", "3",
                          sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert "rank %d of 2 sum [3.0, 3.0, 3.0, 3.0] cycle 3" % r in out.stdout, out.stdout
    # NCCL connects peers when communicators are created (set by the launcher, not by the
    # library at run time)
    assert out.stdout.count("nccl connect 0") == 2, out.stdout
