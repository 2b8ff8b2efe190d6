"""`horovodrun` / `ferrovodrun`: Horovod's launcher flags, turned into the HOROVOD_* environment
and an `mpirun` command line (ferrovod runs on MPI; Gloo mode is not available)."""

import argparse
import os
import shlex
import shutil
import sys

# Environment variables Horovod never forwards to workers.
_NO_EXPORT = ("BASH_FUNC_", "OLDPWD", "HOROVOD_SECRET_KEY")


def _bool_pair(parser, name, dest, help_text):
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--" + name, dest=dest, action="store_true", default=None, help=help_text)
    group.add_argument("--no-" + name, dest=dest, action="store_false", help=argparse.SUPPRESS)


def make_parser():
    p = argparse.ArgumentParser(
        prog="horovodrun",
        description="Launch a Horovod-API training script on ferrovod (through mpirun).",
    )
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="total number of processes")
    p.add_argument("-cb", "--check-build", action="store_true", help="print what was built and exit")
    p.add_argument("-p", "--ssh-port", type=int)
    p.add_argument("-i", "--ssh-identity-file")
    p.add_argument("--disable-cache", action="store_true", help="accepted for compatibility")
    p.add_argument("--start-timeout", type=int, help="accepted for compatibility")
    p.add_argument("--network-interfaces", "--network-interface", dest="nics",
                   help="comma-separated NICs for MPI's TCP traffic")
    p.add_argument("--output-filename", help="directory for per-rank output (mpirun --output-filename)")
    p.add_argument("--verbose", action="store_true", help="print the mpirun command")
    p.add_argument("--config-file", help="accepted for compatibility (not read)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")

    t = p.add_argument_group("tuning")
    t.add_argument("--fusion-threshold-mb", type=float)
    t.add_argument("--cycle-time-ms", type=float)
    t.add_argument("--cache-capacity", type=int)
    _bool_pair(t, "hierarchical-allreduce", "hierarchical_allreduce", "hierarchical allreduce")
    _bool_pair(t, "hierarchical-allgather", "hierarchical_allgather", "hierarchical allgather")
    _bool_pair(t, "torus-allreduce", "torus_allreduce", "torus allreduce")
    _bool_pair(t, "autotune", "autotune", "autotune fusion and cycle time")
    t.add_argument("--autotune-log-file")
    t.add_argument("--autotune-warmup-samples", type=int)
    t.add_argument("--autotune-steps-per-sample", type=int)
    t.add_argument("--autotune-bayes-opt-max-samples", type=int)
    t.add_argument("--autotune-gaussian-process-noise", type=float)
    t.add_argument("--num-nccl-streams", type=int)
    t.add_argument("--thread-affinity", type=int)

    tl = p.add_argument_group("timeline")
    tl.add_argument("--timeline-filename")
    _bool_pair(tl, "timeline-mark-cycles", "timeline_mark_cycles", "mark cycles in the timeline")

    st = p.add_argument_group("stall check")
    st.add_argument("--no-stall-check", action="store_true")
    st.add_argument("--stall-check-warning-time-seconds", type=int)
    st.add_argument("--stall-check-shutdown-time-seconds", type=int)

    lib = p.add_argument_group("library")
    _bool_pair(lib, "mpi-threads-disable", "mpi_threads_disable", "request MPI_THREAD_SINGLE")
    lib.add_argument("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"])
    lib.add_argument("--log-with-timestamp", dest="log_hide_time", action="store_false", default=None)
    lib.add_argument("--log-without-timestamp", dest="log_hide_time", action="store_true")
    lib.add_argument("-prefix-timestamp", "--prefix-timestamp", action="store_true")

    ctl = p.add_argument_group("controller")
    mode = ctl.add_mutually_exclusive_group()
    mode.add_argument("--gloo", action="store_true", help="not available: ferrovod runs on MPI")
    mode.add_argument("--mpi", action="store_true", help="run with MPI (the default)")
    mode.add_argument("--jsrun", action="store_true", help="not available")
    ctl.add_argument("--mpi-args", help="extra arguments for mpirun")
    ctl.add_argument("--tcp", action="store_true", help="use TCP only (no shared memory/IB)")
    ctl.add_argument("--binding-args", help="mpirun binding arguments (default: -bind-to none -map-by slot)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def tuning_env(args):
    """The HOROVOD_* variables the flags stand for."""
    env = {}

    def put(key, value):
        if value is not None:
            env[key] = str(value)

    def flag(key, value):
        if value is not None:
            env[key] = "1" if value else "0"

    if args.fusion_threshold_mb is not None:
        put("HOROVOD_FUSION_THRESHOLD", int(args.fusion_threshold_mb * 1024 * 1024))
    put("HOROVOD_CYCLE_TIME", args.cycle_time_ms)
    put("HOROVOD_CACHE_CAPACITY", args.cache_capacity)
    flag("HOROVOD_HIERARCHICAL_ALLREDUCE", args.hierarchical_allreduce)
    flag("HOROVOD_HIERARCHICAL_ALLGATHER", args.hierarchical_allgather)
    flag("HOROVOD_TORUS_ALLREDUCE", args.torus_allreduce)
    flag("HOROVOD_AUTOTUNE", args.autotune)
    put("HOROVOD_AUTOTUNE_LOG", args.autotune_log_file)
    put("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", args.autotune_warmup_samples)
    put("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", args.autotune_steps_per_sample)
    put("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", args.autotune_bayes_opt_max_samples)
    put("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", args.autotune_gaussian_process_noise)
    put("HOROVOD_NUM_NCCL_STREAMS", args.num_nccl_streams)
    put("HOROVOD_THREAD_AFFINITY", args.thread_affinity)
    put("HOROVOD_TIMELINE", args.timeline_filename)
    flag("HOROVOD_TIMELINE_MARK_CYCLES", args.timeline_mark_cycles)
    if args.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    put("HOROVOD_STALL_CHECK_TIME_SECONDS", args.stall_check_warning_time_seconds)
    put("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", args.stall_check_shutdown_time_seconds)
    flag("HOROVOD_MPI_THREADS_DISABLE", args.mpi_threads_disable)
    if args.log_level is not None:
        env["HOROVOD_LOG_LEVEL"] = args.log_level.lower()
    flag("HOROVOD_LOG_HIDE_TIME", args.log_hide_time)
    return env


def parse_hosts(args):
    """'host:slots,...' from -H or a hostfile ('host slots=N' per line); None for local runs."""
    if args.hosts:
        return args.hosts
    if args.hostfile:
        hosts = []
        with open(args.hostfile) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                slots = 1
                for part in parts[1:]:
                    if part.startswith("slots="):
                        slots = int(part.split("=", 1)[1])
                hosts.append("%s:%d" % (parts[0], slots))
        return ",".join(hosts)
    return None


def mpirun_command(args, env, mpirun="mpirun"):
    """The mpirun command line for `args` (environment `env` is exported to every rank)."""
    np_ = args.np or 1
    hosts = parse_hosts(args) or "localhost:%d" % np_
    cmd = [mpirun, "--allow-run-as-root", "--tag-output", "-np", str(np_), "-H", hosts]
    cmd += shlex.split(args.binding_args) if args.binding_args else ["-bind-to", "none", "-map-by", "slot"]
    cmd += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if args.tcp:
        cmd += ["-mca", "btl", "tcp,self"]
    if args.nics:
        cmd += ["-mca", "btl_tcp_if_include", args.nics, "-mca", "oob_tcp_if_include", args.nics]
    if args.ssh_port:
        cmd += ["-mca", "plm_rsh_args", "-p %d" % args.ssh_port]
    if args.output_filename:
        cmd += ["--output-filename", args.output_filename]
    for key in sorted(env):
        if key.startswith(_NO_EXPORT) or key.endswith("CUDA_VISIBLE_DEVICES") or not key.replace("_", "").isalnum():
            continue
        cmd += ["-x", key]
    if args.mpi_args:
        cmd += shlex.split(args.mpi_args)
    return cmd + list(args.command)


def check_build():
    from horovod import __version__
    from horovod.common.util import extension_available

    def box(ok):
        return "[X]" if ok else "[ ]"

    return "\n".join(
        [
            "Horovod v%s:" % __version__,
            "",
            "Available Frameworks:",
            "    %s TensorFlow" % box(extension_available("tensorflow")),
            "    %s PyTorch" % box(extension_available("torch")),
            "    %s MXNet" % box(extension_available("mxnet")),
            "",
            "Available Controllers:",
            "    [X] MPI",
            "    [ ] Gloo",
            "",
            "Available Tensor Operations:",
            "    [ ] NCCL",
            "    [ ] DDL",
            "    [ ] CCL",
            "    [X] MPI",
            "    [ ] Gloo",
        ]
    )


def run_commandline(argv=None):
    args = make_parser().parse_args(argv)
    if args.version:
        from horovod import __version__

        print(__version__)
        return 0
    if args.check_build:
        print(check_build())
        return 0
    if args.gloo or args.jsrun:
        sys.exit("horovodrun: ferrovod runs on MPI only; drop --gloo/--jsrun")
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        sys.exit("horovodrun: no command given (e.g. horovodrun -np 2 python train.py)")
    if args.np is None:
        sys.exit("horovodrun: -np is required")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("horovodrun: mpirun not found; install Open MPI (apt-get install openmpi-bin)")
    env = dict(os.environ)
    env.update(tuning_env(args))
    # NCCL connects peers when a communicator is created, not lazily inside a collective
    # (where a failed peer would block ferrovod's background thread); a user's value is kept
    env.setdefault("NCCL_RUNTIME_CONNECT", "0")
    cmd = mpirun_command(args, env, mpirun)
    if args.verbose:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    os.execve(mpirun, cmd, env)


if __name__ == "__main__":
    sys.exit(run_commandline())
