"""The matrix's dimensions, which cells exist, which are not applicable by design (and why), which
fail by design with a clear error, and which cells the sample and GPU runs take. Standard library
only: scripts/matrix.sh reads it before any framework is imported."""

FRAMEWORKS = ("capi", "tf", "torch", "mxnet")
# TensorFlow ops run on host memory only, and the GPU machines have no MXNet (README)
GPU_FRAMEWORKS = ("capi", "torch")
CODECS = ("none", "fp16", "bf16", "mixed", "u8", "topk", "powersgd")
MODES = ("online", "offline", "multistep", "gossip")
NAMINGS = ("named", "unnamed")
# not in the matrix, a probe for cell.py --naming: a fresh name per call that is not the
# bindings' `.noname.` convention (a C API caller's own per-call names)
PROBE_NAMINGS = ("unique",)
NPS = (2, 4)

# every cell issues at least OPS operations; resident memory may grow by at most
# GROWTH_BOUND_MIB between operation RSS_FROM_OP (after warm-up) and the last
OPS = 1000
RSS_FROM_OP = 200
GROWTH_BOUND_MIB = 32.0

# the job's multistep in the multistep cells, and offline mode's warm-up
MULTISTEP = 2
PLAN_WARMUP_STEPS = 2

# Cells that cannot exist, by design (printed as N/A with this reason).
GOSSIP_NA = ("no gossip op in this binding: ferrovod's gossip (FV_OP_KIND_GOSSIP) is exposed by "
             "the C API and ferrovod.tensorflow.gossip only (docs/decentralized.md)")
TF_GOSSIP_UNNAMED_NA = ("ferrovod.tensorflow.gossip(tensors, name) requires its rendezvous name: "
                        "there is no unnamed gossip in TensorFlow")

# Operations that fail by design, at the call, on every rank: (framework, memory, mode, naming,
# op kind; None matches any) -> the error text they must raise.
EXPECTED_ERRORS = (
    # GPU tensors take no multistep steps (README, "Gossip and multistep"): a C API allreduce
    # that leaves fv_op.multistep at 0 follows the job's FERROVOD_MULTISTEP=2 and is refused
    (("capi", "cuda", "multistep", None, "allreduce"),
     r"multistep is not supported on GPU tensors"),
    # an unnamed operation's name never repeats, so its calls could never be summed
    # (src/compress/multistep.rs): refused rather than never communicating
    (("capi", "host", "multistep", "unnamed", "allreduce"),
     r"is unnamed, and an unnamed operation's name never repeats"),
)
# A GPU gossip op that asks for a codec itself is refused (the job's codec does not apply to GPU
# gossip, which travels uncompressed): checked once per GPU gossip cell with a codec.
GPU_GOSSIP_CODEC_ERROR = r"compressed gossip of GPU tensors is not supported"


def not_applicable(framework, memory, mode, naming):
    if mode == "gossip" and framework in ("torch", "mxnet"):
        return GOSSIP_NA
    if mode == "gossip" and framework == "tf" and naming == "unnamed":
        return TF_GOSSIP_UNNAMED_NA
    return None


def expected_error(framework, memory, mode, naming, kind):
    for key, pattern in EXPECTED_ERRORS:
        if all(k is None or k == v for k, v in zip(key, (framework, memory, mode, naming, kind))):
            return pattern
    return None


def cell_id(framework, memory, np_, codec, mode, naming):
    return "%s/%s/np%d/%s/%s/%s" % (framework, memory, np_, codec, mode, naming)


def job_env(codec, mode):
    """The job settings of a cell (read by ferrovod at init, rank 0's win)."""
    env = {
        "FERROVOD_COMPRESSION": codec,
        "FERROVOD_NEGOTIATION": "offline" if mode == "offline" else "online",
        "FERROVOD_MULTISTEP": str(MULTISTEP if mode == "multistep" else 1),
        "FERROVOD_GOSSIP_SYNC_EVERY": "10",
    }
    if mode == "offline":
        env["FERROVOD_PLAN_WARMUP_STEPS"] = str(PLAN_WARMUP_STEPS)
    return env


class Launch:
    """One mpirun: a framework, memory, np, codec and mode (job settings are per process), with
    the namings to run one after the other in it."""

    def __init__(self, framework, memory, np_, codec, mode, namings):
        self.framework, self.memory, self.np, self.codec, self.mode = (
            framework, memory, np_, codec, mode)
        self.namings = list(namings)

    def cells(self):
        return [cell_id(self.framework, self.memory, self.np, self.codec, self.mode, n)
                for n in self.namings]

    def argv(self):
        return ["--framework", self.framework, "--memory", self.memory, "--codec", self.codec,
                "--mode", self.mode, "--naming", ",".join(self.namings)]


# A representative sample for CI, (framework, np, codec, mode, namings): every framework at np 2
# and 4, every codec, mode and naming at least once, the known weak spots included (u8 with named
# TensorFlow ops, whose eager names once all read "HorovodAllreduce" and so shared one residual;
# u8 unnamed, the job's multistep under torch, the refused unnamed multistep).
BOTH = ("named", "unnamed")
SAMPLE = (
    ("capi", 2, "u8", "gossip", BOTH),
    ("capi", 4, "fp16", "multistep", BOTH),
    ("tf", 2, "u8", "online", BOTH),
    ("tf", 4, "mixed", "gossip", ("named",)),
    ("torch", 2, "bf16", "multistep", BOTH),
    ("torch", 4, "u8", "offline", BOTH),
    ("torch", 2, "topk", "online", BOTH),
    ("capi", 4, "topk", "multistep", BOTH),
    ("tf", 4, "powersgd", "offline", BOTH),
    ("mxnet", 2, "none", "offline", BOTH),
    ("mxnet", 4, "mixed", "online", BOTH),
)
GPU_SAMPLE = (
    ("capi", 2, "u8", "online", BOTH),
    ("capi", 2, "none", "multistep", BOTH),
    ("capi", 2, "fp16", "gossip", BOTH),
    ("torch", 2, "bf16", "multistep", BOTH),
    ("torch", 2, "mixed", "offline", BOTH),
    ("capi", 4, "bf16", "offline", BOTH),
    ("torch", 4, "u8", "online", BOTH),
    ("capi", 4, "mixed", "gossip", BOTH),
)


def plan(kind, sample=False, max_np=None):
    """(launches, not-applicable cells as (cell id, reason)) for kind "host" or "gpu"."""
    memory = "cuda" if kind == "gpu" else "host"
    frameworks = GPU_FRAMEWORKS if kind == "gpu" else FRAMEWORKS
    launches, na = [], []
    for fw in frameworks:
        for np_ in NPS:
            for codec in CODECS:
                for mode in MODES:
                    namings = []
                    for naming in NAMINGS:
                        reason = not_applicable(fw, memory, mode, naming)
                        if reason:
                            na.append((cell_id(fw, memory, np_, codec, mode, naming), reason))
                        else:
                            namings.append(naming)
                    if namings:
                        launches.append(Launch(fw, memory, np_, codec, mode, namings))
    if sample:
        chosen = {s[:4]: s[4] for s in (GPU_SAMPLE if kind == "gpu" else SAMPLE)}
        launches = [l for l in launches if (l.framework, l.np, l.codec, l.mode) in chosen]
        for l in launches:
            l.namings = [n for n in l.namings if n in chosen[(l.framework, l.np, l.codec, l.mode)]]
        na = []
    if max_np is not None:
        launches = [l for l in launches if l.np <= max_np]
    return launches, na
