"""Checks the target lines scripts/gpu/targets.sh collected against the project's goals: each
line with its goal and whether it meets it; lines at np 1 show only the host's part (no
traffic), so they are listed without a verdict. Exits 1 when a goal is missed.
Usage: python3 scripts/gpu/targets.py FILE"""
import re
import sys

# (pattern of the line's name, at least or at most, the goal); the first that matches rules
GOALS = [
    (r"resnet50 ferrovod/one-allreduce", "<=", 1.05),
    (r"256MiB busbw ferrovod/torch", ">=", 0.97),
    (r"256MiB single-tensor busbw ferrovod/torch", ">=", 0.97),
    (r"(resnet50|bert-base)-train ferrovod/no-comm", ">=", 0.98),
    (r"(resnet50|bert-base)-train ferrovod/ddp", ">=", 1.0),
    (r"resnet50-train ddp-ferrovod/ddp-nccl", ">=", 1.0),
    (r"fsdp-train ferrovod/nccl", ">=", 0.98),
    # gossip inside one node runs the allreduce's exact averages: about the allreduce's step
    (r"resnet50 gossip/allreduce", "<=", 1.05),
]

LINE = re.compile(r"^(gpu|cpu) np=(\d+) (.*?) = ([0-9.]+|nan|inf)(.*)$")


def goal(name):
    for pattern, how, value in GOALS:
        if re.fullmatch(pattern, name):
            return how, value
    return None


def check(lines):
    """(line, verdict) for each target line: 'met', 'MISSED', or why none is given."""
    out = []
    for line in lines:
        m = LINE.match(line.strip())
        if not m:
            continue
        np, name, value, rest = int(m[2]), m[3], float(m[4]), m[5]
        g = goal(name)
        if g is None:
            verdict = "(no goal)"
        elif np == 1:
            verdict = "(np 1: the host's part only)"
        else:
            how, target = g
            # a missing figure (nan) meets no goal
            ok = value <= target if how == "<=" else value >= target
            verdict = "%s (goal %s %s)" % ("met" if ok else "MISSED", how, target)
        out.append(("%s np=%d %s = %.3f%s" % (m[1], np, name, value, rest), verdict))
    return out


if __name__ == "__main__":
    rows = check(open(sys.argv[1]))
    width = max((len(r[0]) for r in rows), default=0)
    for text, verdict in rows:
        print("%-*s  %s" % (width, text, verdict))
    missed = sum(v.startswith("MISSED") for _, v in rows)
    print("# %d lines, %d missed" % (len(rows), missed))
    sys.exit(1 if missed else 0)
