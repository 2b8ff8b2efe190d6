"""Synthetic training throughput on GPUs, one process per GPU under mpirun: a torchvision model
(or a BERT-base-sized transformer) trained with

  nocomm    the model and optimizer alone (no communication: the ceiling),
  ddp       torch.nn.parallel.DistributedDataParallel (NCCL, default buckets),
  ddp_hook  the same DDP with ferrovod's communication hook (ferrovod.torch.ddp_comm_hook),
  ddp_ferrovod  the same DDP over torch.distributed's `ferrovod` backend (no hook),
  ferrovod  horovod.torch's DistributedOptimizer on ferrovod (gradient hooks, NCCL),
  ferrovod_pergrad  the same with one allreduce per gradient (FERROVOD_TORCH_BUCKET_BYTES=0),
  ferrovod_powersgd  the same under ferrovod's PowerSGD (Compression.powersgd, rank 4),
  ddp_hook_powersgd  DDP with ferrovod's hook under its PowerSGD (rank 4): each parameter's
            gradient reduced in its shape,
  ddp_hook_topk  DDP with ferrovod's hook under its top-k (1 % of each bucket),
  ddp_powersgd  DDP with PyTorch's own PowerSGD hook (powerSGD_hook, rank 4, error feedback and
            warm start, compressing from its third step: the least it allows with both),
  <mode>_sync  a mode with a host barrier between backward and the step,

in rounds that alternate the modes (so that clock and thermal drift hit each alike), fp32 and
bf16 autocast. Prints images (or sequences) per second summed over the ranks for each, the
ratios, and the Python cost of one GPU allreduce enqueue. Run by scripts/gpu/torch.sh."""

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import horovod.torch as hvd


def build(model_name):
    if model_name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        return BertForMaskedLM(BertConfig())  # BERT-base: 12 layers, hidden 768
    import torchvision

    return getattr(torchvision.models, model_name)()


def batch_for(model_name, batch, device):
    g = torch.Generator(device=device).manual_seed(1234 + hvd.rank())
    if model_name == "bert":
        ids = torch.randint(0, 30522, (batch, 128), device=device, generator=g)
        return ids, ids
    x = torch.randn(batch, 3, 224, 224, device=device, generator=g)
    y = torch.randint(0, 1000, (batch,), device=device, generator=g)
    return x, y


def loss_of(model_name, model, x, y):
    if model_name == "bert":
        return model(input_ids=x, labels=y).loss
    return F.cross_entropy(model(x), y)


_FERROVOD_GROUP = []


def ferrovod_group():
    if not _FERROVOD_GROUP:
        import ferrovod.torch  # noqa: F401 (registers the backend)
        _FERROVOD_GROUP.append(dist.new_group(backend="ferrovod"))
    return _FERROVOD_GROUP[0]


def make(mode, model_name, device, groups=0):
    torch.manual_seed(0)
    model = build(model_name).to(device)
    if mode in ("ddp", "ddp_hook", "ddp_ferrovod", "ddp_powersgd", "ddp_hook_powersgd",
                "ddp_hook_topk"):
        # ddp_ferrovod: the same DDP over torch.distributed's `ferrovod` backend (a group of every
        # rank; made once, in the same order on every rank)
        group = ferrovod_group() if mode == "ddp_ferrovod" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index],
                                                            process_group=group)
        if mode == "ddp_hook":
            wrapped.register_comm_hook(None, hvd.ddp_comm_hook)
        if mode == "ddp_hook_powersgd":
            state = hvd.DDPHookState(compression=hvd.Compression.powersgd(rank=4))
            wrapped.register_comm_hook(state, hvd.ddp_comm_hook)
        if mode == "ddp_hook_topk":
            state = hvd.DDPHookState(compression=hvd.Compression.topk(0.01))
            wrapped.register_comm_hook(state, hvd.ddp_comm_hook)
        if mode == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                       start_powerSGD_iter=2)
            wrapped.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
        return wrapped, opt
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode in ("ferrovod", "ferrovod_pergrad", "ferrovod_powersgd"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # groups > 0: Horovod's `groups`, the gradients enqueued as that many grouped allreduces;
        # ferrovod_pergrad: one allreduce per gradient (no buckets)
        saved = os.environ.get("FERROVOD_TORCH_BUCKET_BYTES")
        if mode == "ferrovod_pergrad":
            os.environ["FERROVOD_TORCH_BUCKET_BYTES"] = "0"
        compression = (hvd.Compression.powersgd(rank=4) if mode == "ferrovod_powersgd"
                       else hvd.Compression.none)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       groups=groups or None, compression=compression)
        if mode == "ferrovod_pergrad":
            if saved is None:
                del os.environ["FERROVOD_TORCH_BUCKET_BYTES"]
            else:
                os.environ["FERROVOD_TORCH_BUCKET_BYTES"] = saved
    return model, opt


def run_steps(model_name, model, opt, x, y, steps, bf16, events=None, waits=None, sync=False):
    """`waits`: a list that gets the host seconds each step spent in ferrovod's synchronize
    (DistributedOptimizer only); `sync`: a host barrier between backward and the step (the
    model alone, to see what a per-step agreement of the hosts costs)."""
    for _ in range(steps):
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model_name, model, x, y)
        loss.backward()
        if sync:
            hvd.barrier()
        if waits is not None and hasattr(opt, "skip_synchronize"):
            t = time.perf_counter()
            opt.synchronize()
            waits.append(time.perf_counter() - t)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


def host_launch_ms(model_name, model, opt, x, y, bf16, sync, tries=5):
    """The host's own time for one step, measured from an idle device (nothing queued, so no
    launch blocks): how far ahead of the GPU the host can run."""
    got = []
    for _ in range(tries):
        torch.cuda.synchronize()
        hvd.barrier()
        t = time.perf_counter()
        run_steps(model_name, model, opt, x, y, 1, bf16, sync=sync)
        got.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e3 * sorted(got)[len(got) // 2]


def enqueue_cost(device, calls=2000):
    """Seconds of Python per GPU allreduce (allreduce_async_ of a 1-element tensor, 100 names
    cycled): per enqueue; per synchronize of a completed operation, one by one and all at once
    (DistributedOptimizer's step); and per enqueue + synchronize, the communication included."""
    from ferrovod.torch import mpi_ops

    tensors = [torch.ones(1, device=device) for _ in range(100)]
    for i, t in enumerate(tensors):  # warm the names
        hvd.synchronize(hvd.allreduce_async_(t, name="cost.%d" % i))
    torch.cuda.synchronize()
    enq, one, many = 0.0, 0.0, 0.0
    rounds = calls // 100
    for k in range(rounds):
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(t, name="cost.%d" % i) for i, t in enumerate(tensors)]
        enq += time.perf_counter() - t0
        while not all(hvd.poll(h) for h in hs):
            time.sleep(0.0002)
        t0 = time.perf_counter()
        if k % 2:
            mpi_ops._synchronize_all(hs)
            many += time.perf_counter() - t0
        else:
            for h in hs:
                hvd.synchronize(h)
            one += time.perf_counter() - t0
    torch.cuda.synchronize()
    per = rounds // 2 * 100
    t0 = time.perf_counter()
    for k in range(rounds):
        hs = [hvd.allreduce_async_(t, name="cost.%d" % i) for i, t in enumerate(tensors)]
        mpi_ops._synchronize_all(hs)
    torch.cuda.synchronize()
    return enq / calls, one / per, many / per, (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--modes", default="nocomm,ddp,ferrovod,ddp_hook")
    ap.add_argument("--gc", choices=["on", "freeze", "off"], default="on",
                    help="Python's garbage collector while timing: as is, with everything built "
                         "so far frozen out of its scans (gc.freeze), or disabled")
    ap.add_argument("--groups", type=int, default=0,
                    help="ferrovod mode: DistributedOptimizer's groups (0: one allreduce per "
                         "gradient, Horovod's default)")
    ap.add_argument("--host-stats", action="store_true",
                    help="print each mode's host time per step from an idle device, and the "
                    "host time ferrovod's synchronize blocks per step")
    ap.add_argument("--step-stats", action="store_true",
                    help="print each mode's step times (GPU events on the current stream)")
    args = ap.parse_args()

    hvd.init()
    local = hvd.local_rank()
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=hvd.rank(), world_size=hvd.size(), device_id=device)
    torch.backends.cudnn.benchmark = True
    n = hvd.size()
    x, y = batch_for(args.model, args.batch, device)
    modes = args.modes.split(",")
    models = {m: make(m.replace("_sync", ""), args.model, device, args.groups) for m in modes}
    synced = {m: m.endswith("_sync") for m in modes}
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    results = {}
    for precision in args.precisions.split(","):
        bf16 = precision == "bf16"
        for m in modes:
            run_steps(args.model, *models[m], x, y, args.warmup, bf16, sync=synced[m])
        torch.cuda.synchronize()
        waits = {m: [] for m in modes}
        times = {m: [] for m in modes}
        steps_ms = {m: [] for m in modes}
        counters = {m: {} for m in modes}
        for _ in range(args.rounds):
            for m in modes:
                hvd.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                events = []
                before = hvd.metrics()
                run_steps(args.model, *models[m], x, y, args.steps, bf16, events,
                          waits[m] if args.host_stats else None, synced[m])
                torch.cuda.synchronize()
                times[m].append(time.perf_counter() - t0)
                after = hvd.metrics()
                for k in ("control_collectives", "data_collectives", "fused_batches",
                          "graph_launches", "tensors"):
                    counters[m][k] = counters[m].get(k, 0) + after[k] - before[k]
                steps_ms[m] += [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        if args.host_stats:
            launch = {m: host_launch_ms(args.model, *models[m], x, y, bf16, synced[m])
                      for m in modes}
            if hvd.rank() == 0:
                for m in modes:
                    w = sorted(waits[m])
                    print("%s %s host ms per step from an idle device: %.1f%s" % (
                        precision, m, launch[m], "" if not w else
                        "; blocked in synchronize: median %.2f p90 %.2f" % (
                            1e3 * w[len(w) // 2], 1e3 * w[int(len(w) * 0.9)])))
        if args.step_stats and hvd.rank() == 0:
            for m in modes:
                v = sorted(steps_ms[m])
                print("%s %s step ms: min %.1f median %.1f p90 %.1f max %.1f" % (
                    precision, m, v[0], v[len(v) // 2], v[int(len(v) * 0.9)], v[-1]))
                if m != "nocomm":
                    per = args.steps * args.rounds
                    print("%s %s ferrovod per step: %s" % (precision, m, ", ".join(
                        "%s %.1f" % (k, v / per) for k, v in counters[m].items())))
        for m in modes:
            # the slowest rank's best round: the job moves at its slowest rank
            best = max(hvd.allgather_object(min(times[m]), name="t.%s.%s" % (precision, m)))
            results[(precision, m)] = args.steps * args.batch * n / best
    cost, sync_one, sync_all, roundtrip = enqueue_cost(device)
    if hvd.rank() == 0:
        unit = "sequences" if args.model == "bert" else "images"
        name = "bert-base" if args.model == "bert" else args.model
        print("# %s, batch %d per GPU, %d GPUs (%s), %d rounds x %d steps after %d warm-up"
              % (name, args.batch, n, torch.cuda.get_device_name(device), args.rounds,
                 args.steps, args.warmup))
        for precision in args.precisions.split(","):
            row = {m: results[(precision, m)] for m in modes}
            print("%s %s/s: %s" % (precision, unit,
                                   ", ".join("%s=%.1f" % (m, v) for m, v in row.items())))
            for other, label in (("ddp", "ddp"), ("nocomm", "no-comm")):
                if "ferrovod" in row and other in row:
                    line = "gpu np=%d %s-train ferrovod/%s = %.3f" % (
                        n, name, label, row["ferrovod"] / row[other])
                    print(line + ("" if precision == "fp32" else " (%s)" % precision))
            if "ferrovod_pergrad" in row and "ferrovod" in row:
                print("gpu np=%d %s-train ferrovod/ferrovod-per-gradient = %.3f%s" % (
                    n, name, row["ferrovod"] / row["ferrovod_pergrad"],
                    "" if precision == "fp32" else " (%s)" % precision))
            if "ddp_hook" in row and "ddp" in row:
                print("gpu np=%d %s-train ddp+ferrovod-hook/ddp = %.3f%s" % (
                    n, name, row["ddp_hook"] / row["ddp"],
                    "" if precision == "fp32" else " (%s)" % precision))
            if "ferrovod_powersgd" in row and "ddp_powersgd" in row:
                print("gpu np=%d %s-train powersgd ferrovod/torch-hook = %.3f%s" % (
                    n, name, row["ferrovod_powersgd"] / row["ddp_powersgd"],
                    "" if precision == "fp32" else " (%s)" % precision))
            if "ddp_hook_powersgd" in row and "ddp_powersgd" in row:
                print("gpu np=%d %s-train powersgd ferrovod-hook/torch-hook = %.3f%s" % (
                    n, name, row["ddp_hook_powersgd"] / row["ddp_powersgd"],
                    "" if precision == "fp32" else " (%s)" % precision))
            if "ddp_ferrovod" in row and "ddp" in row:
                print("gpu np=%d %s-train ddp-ferrovod/ddp-nccl = %.3f%s" % (
                    n, name, row["ddp_ferrovod"] / row["ddp"],
                    "" if precision == "fp32" else " (%s)" % precision))
            print("JSON " + json.dumps({"model": name, "precision": precision, "np": n,
                                        "per_s": row}))
        print("python cost of one GPU allreduce_async_ enqueue: %.1f us; synchronize of a "
              "completed one: %.1f us one by one, %.1f us all at once; enqueue + synchronize of "
              "100 in flight, communication included: %.1f us per tensor"
              % (cost * 1e6, sync_one * 1e6, sync_all * 1e6, roundtrip * 1e6))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
