#!/usr/bin/env python3
"""One launch of the combination matrix, run on every rank under mpirun:

    mpirun -np N python tests/matrix/cell.py --framework capi|tf|torch|mxnet --memory host|cuda
        --codec none|fp16|bf16|mixed|u8|topk|powersgd --mode online|offline|multistep|gossip
        --naming named,unnamed

The job settings of the codec and mode (plan.job_env) are set here before ferrovod starts. Each
naming is one cell, run in turn in this process; every rank prints one line per cell:

    MATRIX {"cell": "<framework>/<memory>/np<N>/<codec>/<mode>/<naming>", "rank": r,
            "result": "PASS" | "FAIL" | "ERROR" | "ERROR-AS-EXPECTED", "detail": "...",
            "rss_mib": [at op 200, at the end, growth], "gpu_mib": [...] or null, ...}

A cell issues at least 1,000 operations. Every result is checked against a float64 NumPy
reference computed from the inputs every rank can compute (rank q's input is a deterministic
function of q, the step and the tensor), with a tolerance derived from the codec's documented
error (README "Compression", src/compress/): none exact or 1e-6 relative; fp16/bf16 one rounding
per value and per partial sum; mixed per tensor by its size; u8 half a block step per
contribution and of the sum, twice with error feedback. The u8 codec's feedback is checked over
steps too: the running sum of a named allreduce's errors must stay within one step's bound.
Resident memory (VmRSS) must not grow by more than 32 MiB between op 200 and the last op.
"""

import argparse
import collections
import json
import os
import re
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan as P  # noqa: E402
from adapters import ADAPTERS  # noqa: E402

OPS, RSS_FROM_OP, GROWTH_BOUND_MIB = P.OPS, P.RSS_FROM_OP, P.GROWTH_BOUND_MIB

# Tensor sizes (elements). L and L2 exceed mixed's 32 KiB (they travel as fp16 there), S and S2
# stay f32; L is large enough that a per-name leak of its size shows in RSS within the cell.
L, L2, S, S2, B, I = 65536, 40000, 1000, 3000, 5000, 1000
GATHER_COLS = 16  # allgather: rank r sends r + 1 rows (first dimensions differ)
MIXED_MIN_BYTES = 32768  # FERROVOD_COMPRESSION_MIN_BYTES' default
SYNC_EVERY = 10  # FERROVOD_GOSSIP_SYNC_EVERY, as plan.job_env sets it

_basis = {}


def _sin_cos(n):
    if n not in _basis:
        i = 0.013 * np.arange(n, dtype=np.float64)
        _basis[n] = (np.sin(i), np.cos(i))
    return _basis[n]


def values(q, step, salt, n):
    """Rank q's f32 input of tensor `salt` at `step`: 2 sin(phase + 0.013 i), in [-2, 2], no
    two alike, not exact in 16 bits (so that the 16-bit codecs do round)."""
    s, c = _sin_cos(n)
    phase = 0.37 * q + 1.31 * step + 0.7 * salt
    return (2.0 * np.cos(phase) * s + 2.0 * np.sin(phase) * c).astype(np.float32)


def ints(q, step, salt, n):
    return ((q * 7 + step * 13 + salt * 5 + 31 * np.arange(n)) % 101 - 50).astype(np.int32)


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def gossip_peer(rank, size, round_):
    """src/collective/gossip.rs `peer` for powers of two (the matrix runs np 2 and 4)."""
    dims = size.bit_length() - 1
    return rank ^ (1 << (round_ % dims))


def metrics():
    from ferrovod import _core
    return _core.metrics()


class Expected(Exception):
    """An operation refused by design, as plan.EXPECTED_ERRORS says."""


class Cell:
    def __init__(self, ad, args, naming):
        self.ad, self.args = ad, args
        self.n, self.rank = ad.size, ad.rank
        self.codec, self.mode, self.memory = args.codec, args.mode, args.memory
        self.naming, self.named = naming, naming == "named"
        self.id = P.cell_id(ad.name, self.memory, self.n, self.codec, self.mode, naming)
        self.calls = collections.Counter()
        self.pending = {}  # multistep: the inputs of every rank at a label's skipped call
        self.failures = []
        self.expected = {}  # op kind -> error text seen
        self.checks = 0
        self.ops = 0
        self.rss0 = self.gpu0 = None
        self.a_run = 0.0  # largest |value| any compressed contribution had (u8's bound)
        self.compressed_ops = 0  # operations whose f32 values the codec was to compress
        self.cum = None  # u8: running sum of ar_sum_L's errors
        self.topk_left = {}  # top-k, named: (label, tensor) -> every rank's residual (f32)
        self.notes = []
        self.unique = 0

    # --- helpers ---------------------------------------------------------------------------

    def name(self, label):
        if self.naming == "unique":
            # a caller's own per-call names, outside the bindings' `.noname.` convention
            self.unique += 1
            return "%s.call%d" % (label, self.unique)
        return label if self.named else None

    def fail(self, msg):
        self.failures.append(msg)

    def call(self, kind, fn):
        """Runs one operation; counts it; an error that plan.EXPECTED_ERRORS names for it raises
        Expected, any other propagates (the cell then ends in ERROR)."""
        want_error = P.expected_error(self.ad.name, self.memory, self.mode, self.naming, kind)
        try:
            out = fn()
        except Exception as e:  # the bindings raise their frameworks' own types
            if want_error and re.search(want_error, str(e)):
                self.expected.setdefault(kind, str(e).strip().splitlines()[0][:200])
                raise Expected() from None
            raise
        finally:
            self.ops += 1
            if self.ops == RSS_FROM_OP:
                self.rss0, self.gpu0 = rss_mib(), self.ad.device_used_bytes()
        if want_error:
            self.fail("%s: expected an error matching %r, but it succeeded" % (kind, want_error))
            raise Expected()
        return out

    def check(self, what, got, want, tol, step):
        self.checks += 1
        got = np.asarray(got)
        if got.shape != want.shape:
            self.fail("%s step %d: shape %s, expected %s" % (what, step, got.shape, want.shape))
            return
        err = np.abs(got.astype(np.float64) - want)
        bad = ~(err <= tol)  # NaN counts as bad
        if bad.any():
            i = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1)))
            self.fail("%s step %d: %d of %d values off, worst at %d: got %r want %r "
                      "(|err| %.3g > tol %.3g)"
                      % (what, step, int(bad.sum()), bad.size, i, got.flat[i].item(),
                         want.flat[i].item(), err.flat[i], tol))

    def codec_of(self, dtype, nbytes, gossip=False):
        """The codec a tensor travels with (README, Compression): only f32 sums, averages and
        gossip compress; mixed compresses tensors of 32 KiB or more; GPU gossip never does;
        top-k and PowerSGD take host allreduces only, PowerSGD matrices only (every tensor here
        is a vector, so it travels as it is)."""
        if dtype != np.float32:
            return "exact"
        if gossip and self.memory == "cuda":
            return "none"
        if self.codec == "powersgd" or (self.codec == "topk" and (gossip or self.memory == "cuda")):
            return "none"
        if self.codec == "mixed":
            return "fp16" if nbytes >= MIXED_MIN_BYTES else "none"
        return self.codec

    def tol_allreduce(self, codec, op, a):
        n = self.n
        if codec == "exact":
            return 0.0
        if codec == "none":
            t = 1e-6 * n * a  # f32 sums in any order
        elif codec in ("fp16", "bf16"):
            # each rank's value rounded once, each of the n - 1 partial sums once (|sum| <= n a)
            eps = 2.0 ** -11 if codec == "fp16" else 2.0 ** -8
            t = n * n * a * eps + 1e-6 * n * a + 2.0 ** -24 * n
        elif codec == "u8":
            # what one step loses, plus last step's loss that feedback returns now (README:
            # "twice that once feedback returns the previous loss")
            t = 2 * self.u8_loss(a) + 1e-5 * n * a
        elif codec == "topk":
            # the reference's selection summed in f32 (`a`: here the largest |sum|, since the
            # residuals that come back can outgrow any one input)
            t = 1e-6 * n * a
        else:
            raise ValueError(codec)
        # averages are divided by n (before a 16-bit cast; after u8's sum)
        return t / n if op == "avg" else t

    def u8_loss(self, a):
        """What one u8 allreduce step may lose per value, summed over ranks: half a block step
        (range / 255 / 2) of each of the n contributions and of the owner's re-encoded sum. A
        contribution carries the last step's residual R (error feedback), so its range is at
        most 2 (a + R) and the sum's 2 n (a + R); R is itself within a contribution's and the
        sum's half steps."""
        n = self.n
        a = max(a, self.a_run)
        r = (n + 1) * a / (255.0 - (n + 1))
        return 1.05 * 2 * n * (a + r) / 255.0

    def tol_gossip(self, codec, a):
        if codec in ("none", "exact"):
            return 1e-6 * a + 1e-30
        # the average moves by half the difference of the pair's public copies, each off by the
        # rounding of one difference (|x - copy| <= 2 a): half a 16-bit ulp, or half an 8-bit
        # block step (block range <= 4 a)
        if codec == "fp16":
            e = 2 * a * 2.0 ** -11 + 2.0 ** -24
        elif codec == "bf16":
            e = 2 * a * 2.0 ** -8
        else:
            e = 2 * a / 255.0
        return 1.05 * e + 1e-6 * a

    # --- operations ------------------------------------------------------------------------

    def allreduce(self, label, op, tensors, step):
        """An allreduce (grouped when `tensors` holds several) of `tensors` = [[rank q's input
        for q in ranks] per tensor]; checked against the job's multistep where the adapter
        follows it."""
        r, n = self.rank, self.n
        mine = [t[r] for t in tensors]
        grouped = len(tensors) > 1
        self.calls[label] += 1
        job_ms = self.ad.follows_job_multistep and self.mode == "multistep"
        # the k-th call of a name communicates; an unnamed op's fresh name is always at its first
        call_no = self.calls[label] if self.named else 1
        skip = job_ms and call_no % P.MULTISTEP != 0
        if grouped:
            fn = lambda: self.ad.grouped_allreduce(mine, op, self.name(label))  # noqa: E731
        else:
            fn = lambda: self.ad.allreduce(mine[0], op, self.name(label))  # noqa: E731
        try:
            outs, communicated = self.call("allreduce", fn)
        except Expected:
            return
        if not grouped:
            outs = [outs]
        if skip:
            # documented: a call that does not communicate completes at once, reports 0, and
            # leaves the output as it was (the C API binding's output starts as the input)
            if communicated is not None and communicated:
                self.fail("%s step %d: call %d of multistep %d communicated"
                          % (label, step, call_no, P.MULTISTEP))
            for j, (o, x) in enumerate(zip(outs, mine)):
                self.check("%s[%d] skipped call" % (label, j), o, x.astype(np.float64), 0.0, step)
            if self.named:
                self.pending[label] = tensors
            return
        if communicated is not None and not communicated:
            self.fail("%s step %d: did not communicate (call %d)" % (label, step, call_no))
        if job_ms:
            prev = self.pending.pop(label)
            # the skipped calls' inputs summed in the tensor's dtype (f32 for f32)
            contribs = [[(p + c).astype(np.float64) for p, c in zip(pt, ct)]
                        for pt, ct in zip(prev, tensors)]
        else:
            contribs = [[c.astype(np.float64) for c in t] for t in tensors]
        codecs = [self.codec_of(t[0].dtype, t[0].nbytes) for t in tensors]
        amax = [max(float(np.max(np.abs(q))) for q in t) for t in contribs]
        if any(k not in ("none", "exact") for k in codecs):
            self.compressed_ops += 1
            # u8 blocks span the batch: its largest value bounds every member's step
            self.a_run = max([self.a_run] + [a for a, k in zip(amax, codecs) if k != "exact"])
        for j, (o, t, k, a) in enumerate(zip(outs, contribs, codecs, amax)):
            want = np.sum(t, axis=0)
            if k == "topk":
                want = self.topk_sum(label, j, t)
                a = max(a, float(np.max(np.abs(want))))
            if op == "avg":
                want = want / n
            self.check("%s[%d] %s/%s" % (label, j, op, k), o, want,
                       self.tol_allreduce(k, op, a), step)
            if label == "ar_sum_L" and k == "u8" and self.named:
                err = np.asarray(o, dtype=np.float64) - want
                self.cum = err if self.cum is None else self.cum + err

    def topk_sum(self, label, j, contribs):
        """Top-k's sum of every rank's contribution (f32 values): each rank adds its residual
        (named tensors keep it from call to call; unnamed ones start at zero), sends its k
        largest magnitudes (1 %, rounded up; ties to the lower index) and keeps the rest."""
        n, length = self.n, len(contribs[0])
        k = min(max(int(np.ceil(length * 0.01)), 1), length)
        left = self.topk_left.get((label, j)) if self.named else None
        if left is None:
            left = [np.zeros(length, np.float32) for _ in range(n)]
        total = np.zeros(length)
        for q in range(n):
            acc = contribs[q].astype(np.float32) + left[q]
            sent = np.lexsort((np.arange(length), -np.abs(acc)))[:k]
            total[sent] += acc[sent]
            acc[sent] = 0.0
            left[q] = acc
        if self.named:
            self.topk_left[(label, j)] = left
        return total

    def collectives_step(self, step):
        n, r = self.n, self.rank
        def rows(q):
            return values(q, step, 4, (q + 1) * GATHER_COLS).reshape(q + 1, GATHER_COLS)

        self.allreduce("ar_sum_L", "sum", [[values(q, step, 1, L) for q in range(n)]], step)
        self.allreduce("ar_avg_S", "avg", [[values(q, step, 2, S) for q in range(n)]], step)
        self.allreduce("grouped_avg", "avg", [[values(q, step, 3, S2) for q in range(n)],
                                               [values(q, step, 5, L2) for q in range(n)]], step)
        try:
            got = self.call("allgather", lambda: self.ad.allgather(rows(r), self.name("gather")))
            want = np.concatenate([rows(q) for q in range(n)]).astype(np.float64)
            self.check("allgather", got, want, 0.0, step)
        except Expected:
            pass
        root = step % n
        try:
            got = self.call("broadcast", lambda: self.ad.broadcast(values(r, step, 6, B), root,
                                                                   self.name("bcast")))
            want = values(root, step, 6, B).astype(np.float64)
            self.check("broadcast root %d" % root, got, want, 0.0, step)
        except Expected:
            pass
        # codecs leave other dtypes alone: exact
        self.allreduce("ar_sum_int", "sum", [[ints(q, step, 7, I) for q in range(n)]], step)

    def gossip(self, label, tensors, step):
        r, n = self.rank, self.n
        # a named tensor's round is its number of earlier gossips; a fresh name is at round 0
        round_ = self.calls[label] if self.named else 0
        self.calls[label] += 1
        outs = self.call("gossip", lambda: self.ad.gossip([t[r] for t in tensors], self.name(label)))
        # GPU gossip inside one node (the matrix's one machine) runs as exact averages unless
        # FERROVOD_GOSSIP_EXACT_INSIDE_NODE=0
        exact_inside = self.memory == "cuda" and \
            os.environ.get("FERROVOD_GOSSIP_EXACT_INSIDE_NODE", "1") != "0"
        syncs = exact_inside or (round_ + 1) % SYNC_EVERY == 0
        peer = gossip_peer(r, n, round_)
        for j, (o, t) in enumerate(zip(outs, tensors)):
            t64 = [x.astype(np.float64) for x in t]
            a = max(float(np.max(np.abs(x))) for x in t64)
            if syncs:
                want, k = np.mean(t64, axis=0), "exact average"
                tol = self.tol_gossip("none", a)
            else:
                k = self.codec_of(t[0].dtype, t[0].nbytes, gossip=True)
                want = (t64[r] + t64[peer]) / 2
                tol = self.tol_gossip(k, a)
                if k not in ("none", "exact"):
                    self.compressed_ops += 1
            self.check("%s[%d] round %d %s" % (label, j, round_, k), o, want, tol, step)
        return outs

    def gossip_step(self, step):
        n = self.n
        self.gossip("g_L", [[values(q, step, 11, L) for q in range(n)]], step)
        self.gossip("g_SM", [[values(q, step, 12, S) for q in range(n)],
                             [values(q, step, 13, L2) for q in range(n)]], step)

    def gossip_conservation(self, step):
        """Gossip keeps the sum over ranks (an exchange the pair's, compressed or not; an exact
        average everyone's): gather one round's outputs and compare with the inputs' sum."""
        n = self.n
        tensors = [[values(q, step, 11, L) for q in range(n)]]
        out = self.gossip("g_L", tensors, step)[0]
        got = self.call("allgather", lambda: self.ad.allgather(out.reshape(1, -1), self.name("g_check")))
        want = np.sum([x.astype(np.float64) for x in tensors[0]], axis=0)
        self.check("gossip sum over ranks", np.sum(np.asarray(got, np.float64), axis=0), want,
                   1e-5 * n * 2.0, step)

    def gpu_gossip_codec_refused(self):
        """A GPU gossip op asking for a codec itself is refused at the call (README)."""
        x = values(self.rank, 0, 14, S)
        try:
            self.ad.gossip([x], self.name("g_codec"), compression=self.codec)
        except Exception as e:
            if re.search(P.GPU_GOSSIP_CODEC_ERROR, str(e)):
                self.notes.append("op-level %s refused as documented" % self.codec)
                return
            self.fail("GPU gossip with op codec %s: unexpected error %s" % (self.codec, str(e)[:200]))
            return
        self.fail("GPU gossip with op codec %s was not refused" % self.codec)

    # --- the cell --------------------------------------------------------------------------

    def run(self):
        t0 = time.time()
        m0 = metrics()
        step = 0
        error = None
        try:
            if self.mode == "gossip":
                if self.memory == "cuda" and self.codec != "none" and self.ad.name == "capi":
                    self.gpu_gossip_codec_refused()
                while self.ops < OPS:
                    self.gossip_step(step)
                    step += 1
                self.gossip_conservation(step)
            else:
                while self.ops < OPS:
                    self.collectives_step(step)
                    step += 1
        except Exception as e:
            error = "%s at step %d (op %d): %s" % (type(e).__name__, step, self.ops,
                                                   " ".join(str(e).split())[:400])
            traceback.print_exc(file=sys.stderr)
        rss1, gpu1 = rss_mib(), self.ad.device_used_bytes()
        m1 = metrics() if error is None else m0
        if error is None:
            self.final_checks(m0, m1, rss1, gpu1)
        return self.result(error, time.time() - t0, rss1, gpu1, m0, m1, step)

    def final_checks(self, m0, m1, rss1, gpu1):
        if self.rss0 is not None:
            growth = rss1 - self.rss0
            if growth > GROWTH_BOUND_MIB:
                self.fail("RSS grew %.1f MiB between op %d and op %d (%.1f -> %.1f MiB; bound %.0f)"
                          % (growth, RSS_FROM_OP, self.ops, self.rss0, rss1, GROWTH_BOUND_MIB))
        if self.gpu0 is not None and gpu1 is not None:
            growth = (gpu1 - self.gpu0) / 2.0 ** 20
            if growth > GROWTH_BOUND_MIB:
                self.fail("GPU memory in use grew %.1f MiB between op %d and op %d (bound %.0f)"
                          % (growth, RSS_FROM_OP, self.ops, GROWTH_BOUND_MIB))
        if self.cum is not None:
            # feedback telescopes: the errors' running sum is minus the last residuals, so it
            # stays within one step's bound however many steps ran
            bound = self.u8_loss(self.a_run) + 1e-4 * self.n * self.a_run
            worst = float(np.max(np.abs(self.cum)))
            self.notes.append("u8 running error sum %.3g (one-step bound %.3g)" % (worst, bound))
            if not worst <= bound:
                self.fail("u8 error feedback: the running sum of ar_sum_L's errors reached %.3g, "
                          "beyond one step's bound %.3g" % (worst, bound))
        wire = {k: m1[k] - m0[k]
                for k in ("wire_fp16", "wire_bf16", "wire_u8", "wire_topk", "wire_powersgd")}
        counter = {"fp16": "wire_fp16", "mixed": "wire_fp16", "bf16": "wire_bf16", "u8": "wire_u8",
                   "topk": "wire_topk"}
        if self.compressed_ops and self.codec in counter and wire[counter[self.codec]] == 0:
            self.fail("codec %s was not used: %s stayed 0 (metrics %s)"
                      % (self.codec, counter[self.codec], wire))
        if not self.compressed_ops and any(wire.values()):
            self.fail("no operation was to be compressed, yet the metrics count %s" % wire)

    def result(self, error, secs, rss1, gpu1, m0, m1, steps):
        if error:
            result, detail = "ERROR", error
        elif self.failures:
            result = "FAIL"
            detail = "; ".join(self.failures[:3])
            if len(self.failures) > 3:
                detail += "; ... %d failures in all" % len(self.failures)
        elif self.expected:
            result = "ERROR-AS-EXPECTED"
            detail = "; ".join("%s: %s" % kv for kv in sorted(self.expected.items()))
        else:
            result, detail = "PASS", "%d checks" % self.checks
        if self.notes and result != "ERROR":
            detail += " [" + "; ".join(self.notes) + "]"
        rss0 = self.rss0 if self.rss0 is not None else float("nan")
        out = {
            "cell": self.id, "rank": self.rank, "np": self.n, "result": result,
            "detail": detail[:1500], "ops": self.ops, "steps": steps, "checks": self.checks,
            "rss_mib": [round(rss0, 1), round(rss1, 1), round(rss1 - rss0, 1)],
            "gpu_mib": None, "secs": round(secs, 2),
            "metrics": {k: m1[k] - m0[k] for k in (
                "control_collectives", "data_collectives", "wire_uncompressed", "wire_fp16",
                "wire_bf16", "wire_u8", "wire_topk", "wire_powersgd")},
        }
        if self.gpu0 is not None and gpu1 is not None:
            out["gpu_mib"] = [round(self.gpu0 / 2.0 ** 20, 1), round(gpu1 / 2.0 ** 20, 1),
                              round((gpu1 - self.gpu0) / 2.0 ** 20, 1)]
        return out


def emit(obj):
    sys.stdout.write("MATRIX " + json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", required=True, choices=P.FRAMEWORKS)
    p.add_argument("--memory", default="host", choices=("host", "cuda"))
    p.add_argument("--codec", required=True, choices=P.CODECS)
    p.add_argument("--mode", required=True, choices=P.MODES)
    p.add_argument("--naming", default="named,unnamed",
                   help="comma-separated: named, unnamed, or (a probe outside the matrix) unique")
    args = p.parse_args()
    namings = args.naming.split(",")
    # the job's settings, before ferrovod reads them at init
    os.environ.update(P.job_env(args.codec, args.mode))
    os.environ.pop("HOROVOD_ENABLE_ASYNC_COMPLETION", None)
    ad = ADAPTERS[args.framework](args.memory)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    try:
        ad.init()
    except Exception as e:
        # no cell of the matrix fails at init by design: every naming's cell is an ERROR
        traceback.print_exc(file=sys.stderr)
        for naming in namings:
            emit({"cell": P.cell_id(args.framework, args.memory, size, args.codec, args.mode, naming),
                  "rank": rank, "np": size, "result": "ERROR",
                  "detail": "init: %s: %s" % (type(e).__name__, " ".join(str(e).split())[:400])})
        return 1
    rc = 0
    for naming in namings:
        res = Cell(ad, args, naming).run()
        emit(res)
        rc |= res["result"] not in ("PASS", "ERROR-AS-EXPECTED")
    try:
        # a rank that shuts down while another still runs its last ops (those refused at the
        # call need no peer) would turn the other's refusals into shut-down errors
        ad.barrier()
        ad.shutdown()
    except Exception as e:
        print("shutdown: %s" % e, file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
