#!/usr/bin/env python3
"""Runs the combination matrix (entry point: scripts/matrix.sh) and prints one table.

One mpirun per (framework, np, codec, mode): the codec and mode are job settings, read once at
init; the namings run one after the other inside it (each cell measures its own memory growth).
Every rank prints one MATRIX line per cell (cell.py); a cell's result is its ranks' together:
ERROR-AS-EXPECTED only where every rank raised the expected error, CRASH/TIMEOUT where ranks
printed nothing (the log's tail is kept). Exits 1 on any FAIL, ERROR, CRASH or TIMEOUT.

Standard library only: the orchestrator runs before any framework is imported."""

import argparse
import collections
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import plan as P  # noqa: E402

MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
# passed to every rank (a stalled cell ends in an error within a minute, not 10)
PASS_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
    "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
}
GPU_ENV = ("NCCL_NVLS_ENABLE", "NCCL_RUNTIME_CONNECT", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
           "NVSHMEM_DISABLE_NVLS", "PYTHONPATH")
GOOD = ("PASS", "ERROR-AS-EXPECTED", "N/A")
SHORT = {"PASS": "PASS", "FAIL": "FAIL", "ERROR": "ERROR", "ERROR-AS-EXPECTED": "ERR-EXP",
         "N/A": "n/a", "CRASH": "CRASH", "TIMEOUT": "TIMEOUT"}


def python_for(framework, gpu):
    if gpu:
        return os.environ.get("FERROVOD_MATRIX_PYTHON", "python3")
    venv = ".venv-mxnet" if framework == "mxnet" else ".venv"
    return os.path.join(venv, "bin", "python")


def command(launch, gpu, timeout):
    env = dict(PASS_ENV)
    keep = [k for k in GPU_ENV if gpu and k in os.environ]
    args = ["timeout", str(timeout)] + MPIRUN[:1] + ["-np", str(launch.np)] + MPIRUN[1:]
    for k in sorted(env) + keep:
        args += ["-x", k]
    args += [python_for(launch.framework, gpu), "tests/matrix/cell.py"] + launch.argv()
    return env, args


def repro(env, args):
    """The command line that reruns one launch from the repository root."""
    return " ".join("%s=%s" % kv for kv in sorted(env.items()) if kv[0] != "PYTHONUNBUFFERED") + \
        " " + " ".join(shlex.quote(a) for a in args)


def libraries():
    """The ferrovod libraries the ranks may map, with their modification times."""
    found = glob.glob(os.path.join(ROOT, ".venv*", "lib", "python*", "site-packages", "ferrovod",
                                   "libferrovod*.so"))
    for d in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        found += glob.glob(os.path.join(d, "ferrovod", "libferrovod*.so"))
    return {f: os.stat(f).st_mtime for f in found}


def run_launch(launch, gpu, timeout, logdir):
    env, args = command(launch, gpu, timeout)
    for attempt in range(2):
        before = libraries()
        t0 = time.time()
        p = subprocess.run(args, cwd=ROOT, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        secs = time.time() - t0
        # a library file rewritten under running ranks kills them with SIGBUS: not the
        # library's fault, so such a launch runs once more
        if libraries() == before:
            break
        print("(ferrovod's library changed during the launch: running it again)", flush=True)
    log = os.path.join(logdir, "%s.log" % "_".join(
        [launch.framework, launch.memory, "np%d" % launch.np, launch.codec, launch.mode]))
    with open(log, "w") as f:
        f.write("$ %s\n%s" % (repro(env, args), p.stdout))
    lines = [json.loads(l[len("MATRIX "):]) for l in p.stdout.splitlines()
             if l.startswith("MATRIX {")]
    by_cell = collections.defaultdict(list)
    for l in lines:
        by_cell[l["cell"]].append(l)
    tail = " | ".join(l.strip() for l in p.stdout.splitlines()[-6:] if l.strip())[-600:]
    cells = []
    for cid in launch.cells():
        cells.append(combine(cid, launch.np, by_cell.get(cid, []), p.returncode, tail, log,
                             repro(env, args)))
    return cells, secs


def combine(cid, np_, ranks, rc, tail, log, cmd):
    """One cell's result from its ranks' lines."""
    out = {"cell": cid, "log": log, "repro": cmd, "ranks": len(ranks)}
    growth = [r["rss_mib"][2] for r in ranks if r.get("rss_mib")]
    out["rss_growth_mib"] = max((g for g in growth if g == g), default=None)
    out["rss_mib"] = {r["rank"]: r.get("rss_mib") for r in ranks}
    gpu = [r["gpu_mib"][2] for r in ranks if r.get("gpu_mib")]
    out["gpu_growth_mib"] = max(gpu, default=None)
    out["secs"] = max((r.get("secs", 0) for r in ranks), default=None)
    results = collections.Counter(r["result"] for r in ranks)
    if len(ranks) < np_:
        missing = sorted(set(range(np_)) - {r["rank"] for r in ranks})
        out["result"] = "TIMEOUT" if rc in (124, 137) else "CRASH"
        out["detail"] = "no result from rank(s) %s (mpirun rc %d): %s" % (missing, rc, tail)
        return out
    bad = [r for r in ranks if r["result"] not in GOOD]
    if bad:
        worst = min(bad, key=lambda r: (r["result"] != "ERROR", r["rank"]))
        out["result"] = worst["result"]
        other = {r["rank"]: r["result"] for r in ranks if r["result"] != worst["result"]}
        out["detail"] = "rank %d: %s%s" % (worst["rank"], worst["detail"],
                                          " (other ranks: %s)" % other if other else "")
        return out
    if len(results) > 1:
        # a refusal by design must happen on every rank
        out["result"] = "FAIL"
        out["detail"] = "ranks disagree: %s" % {r["rank"]: r["result"] for r in ranks}
        return out
    out["result"] = ranks[0]["result"]
    out["detail"] = ranks[0]["detail"]
    return out


def table(results, na, launches, gpu):
    """The matrix as rows (framework, memory, np, mode, naming) x codec columns, then every
    cell that did not pass with its detail and the command that reruns it."""
    got = {r["cell"]: r for r in results}
    for cid, reason in na:
        got[cid] = {"cell": cid, "result": "N/A", "detail": reason}
    rows = []
    frameworks = P.GPU_FRAMEWORKS if gpu else P.FRAMEWORKS
    memory = "cuda" if gpu else "host"
    width = 9
    head = "%-34s" % "framework/memory/np/mode/naming" + "".join("%-*s" % (width, c) for c in P.CODECS)
    rows.append(head)
    rows.append("-" * len(head))
    for fw in frameworks:
        for np_ in P.NPS:
            for mode in P.MODES:
                for naming in P.NAMINGS:
                    ids = [P.cell_id(fw, memory, np_, c, mode, naming) for c in P.CODECS]
                    if not any(i in got for i in ids):
                        continue
                    line = "%-34s" % ("%s/%s/np%d/%s/%s" % (fw, memory, np_, mode, naming))
                    for i in ids:
                        r = got.get(i)
                        text = "" if r is None else SHORT[r["result"]]
                        if r and r["result"] == "FAIL" and "RSS grew" in r.get("detail", ""):
                            text = "FAIL:rss" if "off, worst" not in r["detail"] else "FAIL:v+rss"
                        elif r and r["result"] == "FAIL" and "off, worst" in r.get("detail", ""):
                            text = "FAIL:val"
                        line += "%-*s" % (width, text or ".")
                    rows.append(line)
    counts = collections.Counter(r["result"] for r in got.values())
    rows.append("")
    rows.append("cells: " + ", ".join("%s %d" % (k, v) for k, v in sorted(counts.items())))
    growth = [(r["rss_growth_mib"], r["cell"]) for r in results
              if r.get("rss_growth_mib") is not None]
    if growth:
        lo, hi = min(growth), max(growth)
        rows.append("RSS growth op %d -> last op, worst rank per cell: min %.1f MiB (%s), "
                    "max %.1f MiB (%s); bound %.0f MiB"
                    % (P.RSS_FROM_OP, lo[0], lo[1], hi[0], hi[1], P.GROWTH_BOUND_MIB))
    by_group = collections.defaultdict(list)
    for r in results:
        if r.get("rss_growth_mib") is not None:
            by_group[tuple(r["cell"].split("/")[:3])].append(r["rss_growth_mib"])
    if by_group:
        rows.append("RSS growth by framework/memory/np (max over its cells): " + ", ".join(
            "%s %.1f" % ("/".join(k), max(v)) for k, v in sorted(by_group.items())) + " MiB")
    gpu_growth = [(r["gpu_growth_mib"], r["cell"]) for r in results
                  if r.get("gpu_growth_mib") is not None]
    if gpu_growth:
        hi = max(gpu_growth)
        rows.append("GPU memory growth: max %.1f MiB (%s)" % hi)
    bad = [r for r in results if r["result"] not in GOOD]
    if bad:
        rows.append("")
        rows.append("Not passing (detail from the first failing rank; rerun with the command shown):")
        for r in sorted(bad, key=lambda r: r["cell"]):
            rows.append("  %s  %s  (RSS growth %s MiB)\n      %s\n      repro: %s\n      log: %s"
                        % (r["cell"], r["result"], r.get("rss_growth_mib"), r["detail"],
                           r["repro"], r["log"]))
    expected = [r for r in results if r["result"] == "ERROR-AS-EXPECTED"]
    if expected:
        rows.append("")
        rows.append("Refused by design, on every rank (ERR-EXP):")
        for text in sorted({r["detail"][:220] for r in expected}):
            rows.append("  " + text)
    if na:
        rows.append("")
        rows.append("Not applicable by design (n/a):")
        for reason in sorted({reason for _, reason in na}):
            rows.append("  " + reason)
    return "\n".join(rows)


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True).stdout
    except OSError:
        return 0
    return sum(1 for l in out.splitlines() if l.startswith("GPU "))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sample", action="store_true", help="a representative sample (CI)")
    p.add_argument("--gpu", action="store_true", help="CUDA memory: torch and the C API")
    p.add_argument("--filter", help="only cells whose id matches this regular expression")
    p.add_argument("--logdir", default=None)
    p.add_argument("--timeout", type=int, default=None, help="seconds per mpirun")
    p.add_argument("--list", action="store_true", help="print the launches and exit")
    p.add_argument("--table", nargs="+", metavar="RESULTS_JSONL",
                   help="print the table of earlier runs' results.jsonl (later files win) and exit")
    args = p.parse_args()
    if args.table:
        got = {}
        for path in args.table:
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    got[r["cell"]] = r
        results = list(got.values())
        _, na = P.plan("gpu" if args.gpu else "host")
        print(table(results, na, None, args.gpu))
        return 1 if any(r["result"] not in GOOD for r in results) else 0
    max_np = None
    if args.gpu:
        max_np = gpu_count()
        if max_np == 0:
            print("matrix --gpu: no GPU here, skipped")
            return 0
    launches, na = P.plan("gpu" if args.gpu else "host", sample=args.sample, max_np=max_np)
    if args.filter:
        rx = re.compile(args.filter)
        for l in launches:
            l.namings = [n for n, c in zip(l.namings, l.cells()) if rx.search(c)]
        launches = [l for l in launches if l.namings]
        na = [(c, r) for c, r in na if rx.search(c)]
    if args.list:
        for l in launches:
            print(" ".join(l.cells()))
        return 0
    logdir = args.logdir or "/tmp/ferrovod-matrix"
    os.makedirs(logdir, exist_ok=True)
    results = []
    t0 = time.time()
    with open(os.path.join(logdir, "results.jsonl"), "w") as jl:
        for i, l in enumerate(launches):
            timeout = args.timeout or (240 if l.np <= 2 else 480)
            cells, secs = run_launch(l, args.gpu, timeout, logdir)
            for c in cells:
                jl.write(json.dumps(c) + "\n")
                jl.flush()
                print("[%d/%d %4.0fs] %-48s %-17s %s" % (
                    i + 1, len(launches), secs, c["cell"], c["result"],
                    "" if c.get("rss_growth_mib") is None else "rss +%.1f MiB" % c["rss_growth_mib"]),
                    flush=True)
            results.extend(cells)
    print()
    print(table(results, na, launches, args.gpu))
    print("\n%d launches, %d cells run, %.0f s; logs and results.jsonl in %s"
          % (len(launches), len(results), time.time() - t0, logdir))
    return 1 if any(r["result"] not in GOOD for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
