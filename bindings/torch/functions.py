"""Model and optimizer state across ranks: `broadcast_parameters`,
`broadcast_optimizer_state`, `broadcast_object`, `allgather_object` (all synchronous)."""

import torch

from ferrovod import _core
from ferrovod import objects as _objects
from ferrovod.torch import mpi_ops
from horovod.common.process_sets import global_process_set


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Assigns `root_rank`'s values to `params` in place: a `state_dict()`, or a list of
    parameters or of (name, parameter) pairs (`named_parameters()`). Dicts go in name order."""
    if isinstance(params, dict):
        params = sorted(params.items(), key=lambda kv: kv[0])
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("invalid params of type: %s" % type(params))
    handles = [mpi_ops.broadcast_async_(p, root_rank, name=name, process_set=process_set)
               for name, p in params]
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state (per-parameter state and the param groups' options)
    `root_rank`'s. Ranks whose optimizer has not stepped yet get the state too: its layout
    (keys, shapes, dtypes, scalars) travels as an object first, then the tensors are broadcast
    in place; no optimizer step is taken. As in Horovod, a rank whose state was empty is left
    with zero gradients on the parameters that train. `model` is accepted for Horovod's
    signature."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    mine = optimizer.state_dict()
    if not mine["state"]:
        # as Horovod (which steps a fresh optimizer on zero gradients to create its state):
        # parameters that train have a gradient afterwards
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    is_root = _core.rank() == root_rank
    layout = None
    if is_root:
        layout = {
            "param_groups": mine["param_groups"],
            "state": {pid: {k: (("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v)
                                else ("value", v)) for k, v in st.items()}
                      for pid, st in mine["state"].items()},
        }
    layout = broadcast_object(layout, root_rank, name="optimizer_state.layout",
                              process_set=process_set)
    params = {pid: p for group, lgroup in zip(optimizer.param_groups, mine["param_groups"])
              for pid, p in zip(lgroup["params"], group["params"])}
    state, handles = {}, []
    for pid in sorted(layout["state"]):
        state[pid] = {}
        for key in sorted(layout["state"][pid], key=str):
            kind, *rest = layout["state"][pid][key]
            if kind == "value":
                state[pid][key] = rest[0]
                continue
            shape, dtype = rest
            have = mine["state"].get(pid, {}).get(key)
            if not (torch.is_tensor(have) and tuple(have.shape) == shape and have.dtype == dtype):
                device = params[pid].device if pid in params else "cpu"
                # 0-d step counters live on the CPU, as the optimizers keep them
                have = torch.zeros(shape, dtype=dtype, device=device if shape else "cpu")
            state[pid][key] = have
            handles.append(mpi_ops.broadcast_async_(
                have, root_rank, name="optimizer_state.%s.%s" % (pid, key),
                process_set=process_set))
    for handle in handles:
        mpi_ops.synchronize(handle)
    optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """`root_rank`'s `obj` (pickled) on every rank of the process set."""
    return _objects.broadcast_object(obj, root_rank, name or type(obj).__name__,
                                     process_set.process_set_id)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj` (pickled), in rank order, on every rank of the process set."""
    return _objects.allgather_object(obj, name or type(obj).__name__, process_set.process_set_id)
