"""PyTorch's own distributed test suite (torch.testing._internal.distributed.distributed_test,
shipped inside the torch package: the collective, subgroup and DDP tests that take a backend
name) on the `ferrovod` backend, one MPI rank per test process, as PyTorch runs it for its `mpi`
backend. Run by scripts/torch-tests.sh, which merges every rank's results.

Each test runs as PyTorch's own harness runs it (TestDistBackend._run): init_process_group with a
file store, a barrier, the test, a barrier, destroy_process_group. PyTorch decides which tests a
backend takes part in from sets of backend names; "ferrovod" is added to the sets of what it
implements (DDP, subgroups, a plugin backend; GPU and CUDA where CUDA is there) before the suite
is imported, as a third-party backend would be. A test that outlives --timeout ends the job
(the script then goes on from the next one).

With TORCH_TESTS_AS=gloo (the script's --as), the suite runs as it does for that backend (its
tests for that backend by name included), with ferrovod's takeover on: every group the suite
asks for by that name is ferrovod's, as in a user's unchanged script under
FERROVOD_TORCH_TAKEOVER=1, and each test checks that it got ferrovod's."""

import argparse
import json
import os
import sys
import threading
import time
import traceback
import unittest
from datetime import timedelta

RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])
SIZE = int(os.environ["OMPI_COMM_WORLD_SIZE"])
TMP = os.environ["TEMP_DIR"]  # shared by the ranks (the suite's file barrier lives there)
AS = os.environ.get("TORCH_TESTS_AS", "ferrovod")
os.environ["BACKEND"] = AS
if AS != "ferrovod":
    os.environ["FERROVOD_TORCH_TAKEOVER"] = "1"
os.environ["WORLD_SIZE"] = str(SIZE)
os.environ.setdefault("INIT_METHOD", "file://" + os.path.join(TMP, "init_dir", "shared_init_file"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal import common_distributed as common  # noqa: E402
from torch.testing._internal import common_utils  # noqa: E402

features = ["ddp", "subgroup", "plugin"] + (["gpu", "cuda"] if torch.cuda.is_available() else [])
for feature in features:
    common.DistTestCases.backend_feature[feature].add("ferrovod")

import ferrovod.torch  # noqa: E402,F401 (registers the backend)
from ferrovod import _core  # noqa: E402
from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402


class Suite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    pass


SKIP_CODES = {s.exit_code: s.message for s in common.TEST_SKIPS.values()}


def sync(tag, timeout=300):
    """A barrier of the runner's own, through files: it must hold whatever state a failed test
    left the process group (or ferrovod) in."""
    folder = os.path.join(TMP, "runner")
    with open(os.path.join(folder, "%s.%d" % (tag, RANK)), "w"):
        pass
    deadline = time.time() + timeout
    while sum(os.path.exists(os.path.join(folder, "%s.%d" % (tag, r))) for r in range(SIZE)) < SIZE:
        if time.time() > deadline:
            raise RuntimeError("the runner's barrier %s timed out" % tag)
        time.sleep(0.05)


def running():
    """Whether ferrovod still runs on every rank: a stall or a failure in the last test shuts it
    down (its enqueue then refuses at once; a rank whose peer stopped finds out at the stall
    limit)."""
    if not _core.is_initialized():
        return False
    try:
        _core.enqueue(_core.BARRIER, [], []).wait()
        return True
    except Exception:  # noqa: BLE001 (any failure means the next test cannot run here)
        return False


def run_one(index, name):
    # the suite's file barrier counts up per call on each rank: a test that failed on one rank
    # before a barrier the others passed leaves the counts apart for good. Every rank starts
    # each test from the same count, above any an earlier test wrote.
    suite.Barrier.barrier_id = (index + 1) * 1000
    self = Suite(name)
    self.rank = RANK
    self.file_name = os.path.join(TMP, "init_dir", "store.%d" % index)
    start = time.time()
    try:
        dist.init_process_group(init_method="file://" + self.file_name, backend=AS,
                                world_size=SIZE, rank=RANK, timeout=timedelta(seconds=120))
        if dist.get_backend() != "ferrovod":
            raise RuntimeError("the suite's group is %r, not ferrovod's" % dist.get_backend())
        self._barrier()
        common_utils.set_rng_seed()  # as the suite's run_test: every rank draws the same data
        method = getattr(self, name)
        # unittest's own skip decorators (skipIf, the suite's backend conditions) act only
        # through unittest's runner: honour them here
        if getattr(method, "__unittest_skip__", False):
            raise unittest.SkipTest(getattr(method, "__unittest_skip_why__", ""))
        method()
        self._barrier()
        outcome, why = "passed", ""
    except unittest.SkipTest as e:
        outcome, why = "skipped", str(e)
    except SystemExit as e:  # the suite's skip decorators exit with a code
        code = e.code if isinstance(e.code, int) else 1
        if code == 0:
            outcome, why = "passed", ""
        elif code in SKIP_CODES:
            outcome, why = "skipped", SKIP_CODES[code]
        else:
            outcome, why = "failed", "exit code %s" % code
    except BaseException as e:  # noqa: BLE001 (every failure is a result)
        lines = traceback.format_exception_only(type(e), e)
        outcome, why = "failed", " ".join(line.strip() for line in lines)[:600]
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return {"test": name, "rank": RANK, "outcome": outcome, "why": why,
            "seconds": round(time.time() - start, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", action="append", default=[], help="run tests whose name holds this")
    ap.add_argument("--done", default=None, help="results file: tests in it are not run again")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--job", default="0", help="this job's number in the script's loop")
    a = ap.parse_args()
    names = sorted(n for n in dir(Suite) if n.startswith("test_"))
    if a.k:
        names = [n for n in names if any(k in n for k in a.k)]
    if a.list:
        if RANK == 0:
            print("\n".join(names))
        return
    done = set()
    if a.done and os.path.exists(a.done):
        with open(a.done) as f:
            done = {json.loads(line)["test"] for line in f if line.strip()}
    # the suite's file barrier counts one file per process: those of an earlier job's
    # processes would never let it pass
    if RANK == 0:
        suite.Barrier.init()
    sync("start.%s" % a.job)
    out = open(os.path.join(TMP, "results.%d.jsonl" % RANK), "a")
    for index, name in enumerate(names):
        if name in done:
            continue
        # a test that never returns ends the job, with its name on record
        with open(os.path.join(TMP, "current.%d" % RANK), "w") as f:
            f.write(name)
        guard = threading.Timer(a.timeout, lambda n=name: (
            out.write(json.dumps({"test": n, "rank": RANK, "outcome": "failed",
                                  "why": "did not finish within %.0f s" % a.timeout,
                                  "seconds": a.timeout}) + "\n"), out.flush(), os._exit(3)))
        guard.daemon = True
        guard.start()
        result = run_one(index, name)
        guard.cancel()
        out.write(json.dumps(result) + "\n")
        out.flush()
        if RANK == 0:
            print("%-70s %s %s" % (name, result["outcome"], result["why"][:100]), flush=True)
        sync("after.%d" % index)
        if not running():
            # the test shut ferrovod down (an error on every rank); MPI cannot start again in
            # this process, so the job ends and the script starts the next one after this test
            out.close()
            os._exit(4)
    out.close()
    _core.shutdown()  # finalizes MPI: the job ends as mpirun expects


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # the suite's leftovers (threads, stores) must not hold the job
