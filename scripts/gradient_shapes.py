"""The gradient shape sets of ../shared/data (one `name<TAB>AxBxC` line per tensor, `#`
comments), for the benchmark scripts: `load(path)` gives (name, shape) pairs in the order
backward produces the gradients (the reverse of the file's registration order)."""


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            name, dims = line.rstrip("\n").split("\t")
            out.append((name, tuple(int(d) for d in dims.strip().split("x"))))
    return out[::-1]
