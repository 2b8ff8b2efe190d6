"""The plots of BENCHMARKS.md, drawn from the recorded results in benchmarks/results/*.json (each
file names its machine, date, commit and command) into benchmarks/plots/*.png. Run by
scripts/plots.sh, which provides matplotlib."""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PLOTS = os.path.join(ROOT, "benchmarks", "plots")


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def busbw(nbytes, seconds, n):
    """Bus bandwidth of an allreduce in GB/s (nccl-tests' definition)."""
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def caption(doc):
    return "%s, %s, at %s" % (doc["machine_short"], doc["date"], doc["commit"])


def save(fig, name):
    os.makedirs(PLOTS, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(PLOTS, name), dpi=110)
    plt.close(fig)
    print("wrote benchmarks/plots/%s" % name)


def size_label(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return "%d %s" % (b // div, unit)
    return "%d B" % b


def gpu_busbw():
    doc = load("gpu-allreduce-4xh100.json")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, n in zip(axes, (2, 4)):
        rows = [r for r in doc["rows"] if r["kind"] == "sweep" and r["np"] == n]
        sizes = sorted({r["bytes"] for r in rows})
        for key, label in (("ferrovod_s", "ferrovod"), ("nccl_s", "raw NCCL")):
            # the better of the recorded rounds at each size
            best = [min(r[key] for r in rows if r["bytes"] == b) for b in sizes]
            ax.plot(sizes, [busbw(b, t, n) for b, t in zip(sizes, best)], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes[::2], [size_label(b) for b in sizes[::2]], rotation=45)
        ax.set_title("allreduce, np %d" % n)
        ax.set_xlabel("tensor size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bus bandwidth (GB/s)")
    axes[0].legend()
    fig.suptitle("GPU allreduce of one tensor: ferrovod against NCCL\n" + caption(doc), fontsize=9)
    save(fig, "gpu-busbw.png")


def cpu_busbw():
    doc = load("cpu-allreduce-np2.json")
    rows = doc["rows"]
    sizes = [r["bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["ferrovod_busbw_gbs"] for r in rows], marker="o", label="ferrovod")
    ax.plot(sizes, [r["mpi_busbw_gbs"] for r in rows], marker="o", label="MPI_Allreduce")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(b) for b in sizes], rotation=45)
    ax.set_xlabel("tensor size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("host allreduce of one tensor, np 2\n" + caption(doc), fontsize=9)
    save(fig, "cpu-busbw.png")


def hosts():
    step = load("hosts-2x1-1gbit-resnet50.json")
    tf = load("hosts-2x1-1gbit-tf-horovod.json")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    r = step["rows"][0]
    names = ["link limit", "one MPI_Allreduce\nof the set", "MPI_Allreduce\nper gradient", "ferrovod"]
    values = [r["link_limit_ms"], r["mpi_step_ms"], r["mpi_each_step_ms"], r["ferrovod_step_ms"]]
    axes[0].bar(names, values, color=["grey", "tab:orange", "tab:orange", "tab:blue"])
    axes[0].tick_params(axis="x", labelsize=8)
    for i, v in enumerate(values):
        axes[0].text(i, v, "%.0f" % v, ha="center", va="bottom")
    axes[0].set_ylabel("ms per step")
    axes[0].set_title("ResNet-50 set, C API (ferrovod-bench)\n" + caption(step), fontsize=9)
    labels, fv, hv = [], [], []
    for row in tf["rows"]:
        labels.append("MTU %d\nround %d" % (row["mtu"], row["round"]))
        fv.append(row["ferrovod_s"] * 1e3)
        hv.append(row["horovod_s"] * 1e3)
    x = range(len(labels))
    axes[1].bar([i - 0.2 for i in x], fv, width=0.4, label="ferrovod (drop-in)")
    axes[1].bar([i + 0.2 for i in x], hv, width=0.4, label="Horovod 0.28.1")
    axes[1].axhline(r["link_limit_ms"], color="grey", linestyle="--", label="link limit (MTU 1500)")
    axes[1].set_xticks(list(x), labels)
    axes[1].set_ylabel("ms per step")
    axes[1].set_ylim(700, None)
    axes[1].legend(fontsize=8)
    axes[1].set_title("TensorFlow step, hvd.allreduce per gradient\n" + caption(tf), fontsize=9)
    fig.suptitle("2 emulated hosts x 1 rank at 1 Gbit/s", fontsize=10)
    save(fig, "hosts-2x1.png")


def scale_model():
    doc = load("sim-predict.json")
    models = ("resnet50", "bert-base")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True, sharey=True)
    for row, model in enumerate(models):
        for col, gbit in enumerate((100, 25)):
            ax = axes[row][col]
            rows = [r for r in doc["rows"] if r["model"] == model and r["gbit"] == gbit]
            for mode in dict.fromkeys(r["mode"] for r in rows):
                pts = sorted((r["ranks"], r["efficiency"]) for r in rows if r["mode"] == mode)
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=mode)
            ax.set_xscale("log")
            ax.set_title("%s, %d Gbit/s a node of 8 GPUs" % (model, gbit))
            ax.set_ylabel("scaling efficiency, %")
            ax.set_xlabel("GPUs")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("predicted by the scale model, %s, at %s" % (doc["date"], doc["commit"]))
    save(fig, "sim-scaling.png")


def training():
    doc = load("gpu-train-resnet50-2xh200.json")
    modes = [("nocomm", "model alone"), ("ddp", "DDP (NCCL)"), ("ferrovod", "ferrovod"),
             ("ddp_hook", "DDP + ferrovod hook")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, row in enumerate(doc["rows"]):
        for i, (key, label) in enumerate(modes):
            ax.bar(k * (len(modes) + 1) + i, row["per_s"][key], label=label if k == 0 else None,
                   color="C%d" % i)
    ax.set_xticks([k * (len(modes) + 1) + 1.5 for k in range(len(doc["rows"]))],
                  [row["precision"] for row in doc["rows"]])
    ax.set_ylabel("images/s, 2 GPUs")
    ax.set_ylim(0, 1.25 * max(max(row["per_s"].values()) for row in doc["rows"]))
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    ax.set_title("ResNet-50 training, batch 64 per GPU\n" + caption(doc), fontsize=9)
    save(fig, "gpu-train-resnet50.png")


if __name__ == "__main__":
    gpu_busbw()
    cpu_busbw()
    hosts()
    training()
    scale_model()
