"""The same few collectives over each binding, with NumPy in and NumPy out, so that one cell
body (cell.py) checks every framework alike.

An adapter's ops take `name=None` for an unnamed op: the binding then names it as it does for
its users (Horovod's numbered `.noname.<n>` names, or TensorFlow's kernel name). The C API has
no unnamed ops (a tensor name is required), so its adapter stands in for what the bindings do:
a fresh name per call.

`memory` is "host" or "cuda" (torch and the C API only: the C API's device memory is allocated
with torch, the one CUDA library the GPU machines have).
"""

import itertools
import os

import numpy as np


class Adapter:
    name = "?"
    # Horovod-API ops communicate on every call whatever the job's FERROVOD_MULTISTEP says; C API
    # allreduces that leave fv_op.multistep at 0 follow it (README, FERROVOD_MULTISTEP)
    follows_job_multistep = False
    has_gossip = False

    def __init__(self, memory):
        self.memory = memory

    def init(self):
        raise NotImplementedError

    def shutdown(self):
        pass

    def barrier(self):
        self.hvd.barrier()

    # op: "sum" or "avg". Each returns (outputs, communicated) for allreduces (communicated: None
    # where the API cannot tell), the output array otherwise.
    def allreduce(self, x, op, name):
        raise NotImplementedError

    def grouped_allreduce(self, xs, op, name):
        raise NotImplementedError

    def allgather(self, x, name):
        raise NotImplementedError

    def broadcast(self, x, root, name):
        raise NotImplementedError

    def gossip(self, xs, name, compression=None):
        raise NotImplementedError

    def device_used_bytes(self):
        """GPU memory in use on this rank's device (None on host): ferrovod's own device
        allocations (u8 residuals, fusion buffers) are invisible to VmRSS."""
        if self.memory != "cuda":
            return None
        import torch
        free, total = torch.cuda.mem_get_info()
        return total - free


class CApi(Adapter):
    """The C API through ctypes (ferrovod._core: fv_enqueue with fv_op filled in directly;
    fv_op.multistep and fv_op.compression at 0: the job's)."""

    name = "capi"
    follows_job_multistep = True
    has_gossip = True

    def init(self):
        from ferrovod import _core
        self.c = _core
        self._fresh = itertools.count(1)
        if self.memory == "cuda":
            import torch
            self.torch = torch
            # one GPU per process, as ferrovod and NCCL need
            local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
            self.device = local % torch.cuda.device_count()
            torch.cuda.set_device(self.device)
        _core.init()
        self.rank, self.size = _core.rank(), _core.size()

    def shutdown(self):
        self.c.shutdown()

    def barrier(self):
        self.c.enqueue(self.c.BARRIER, [], []).wait()

    def _names(self, kind, name, n):
        if name is None:
            name = "capi.%s.noname.%d" % (kind, next(self._fresh))
        return [name if n == 1 else "%s_%dof%d" % (name, i + 1, n) for i in range(n)]

    def _run(self, kind, arrays, names, **kw):
        if self.memory == "cuda":
            return self._run_cuda(kind, arrays, names, **kw)
        h = self.c.enqueue(kind, arrays, names, **kw)
        outs = h.wait()
        return outs, h.communicated

    def _run_cuda(self, kind, arrays, names, **kw):
        torch, c = self.torch, self.c
        dev = torch.device("cuda", self.device)
        ins = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in arrays]
        made = {}
        alloc = None
        if kind == c.ALLGATHER:
            outs = [None] * len(ins)
            dtype = ins[0].dtype

            def allocate(_user, index, ndim, shape, _nbytes):
                dims = tuple(shape[i] for i in range(ndim))
                numel = int(np.prod(dims)) if dims else 1
                buf = torch.empty(max(numel, 1), dtype=dtype, device=dev)
                made[index] = buf[:numel].view(dims)
                return buf.data_ptr()

            alloc = c.ALLOC_FN(allocate)
        else:
            # a multistep call that does not communicate leaves the output as it was: the input
            outs = [t.clone() for t in ins]
        specs = [c.Spec(n, c.dtype_code(a.dtype), a.shape, t.data_ptr(),
                        None if o is None else o.data_ptr())
                 for n, a, t, o in zip(names, arrays, ins, outs)]
        stream = torch.cuda.current_stream(dev).cuda_stream
        h = c.submit(kind, specs, ins + [o for o in outs if o is not None], outs, device=self.device,
                     stream=stream, alloc=alloc, **kw)
        h.wait()
        # the handle completes once ferrovod's GPU work is done (no asynchronous completion
        # asked for); synchronising the device as well costs nothing here and rules it out
        torch.cuda.synchronize(dev)
        if kind == c.ALLGATHER:
            outs = [made[i] for i in range(len(ins))]
        return [o.cpu().numpy() for o in outs], h.communicated

    # fv_op.multistep = 0: as the job's FERROVOD_MULTISTEP says (what the matrix checks)
    def allreduce(self, x, op, name):
        outs, comm = self._run(self.c.ALLREDUCE, [x], self._names("allreduce", name, 1),
                               reduce_op=self.c.SUM if op == "sum" else self.c.AVERAGE,
                               multistep=0)
        return outs[0], comm

    def grouped_allreduce(self, xs, op, name):
        return self._run(self.c.ALLREDUCE, xs, self._names("grouped_allreduce", name, len(xs)),
                         reduce_op=self.c.SUM if op == "sum" else self.c.AVERAGE, multistep=0)

    def allgather(self, x, name):
        return self._run(self.c.ALLGATHER, [x], self._names("allgather", name, 1))[0][0]

    def broadcast(self, x, root, name):
        return self._run(self.c.BROADCAST, [x], self._names("broadcast", name, 1),
                         root_rank=root)[0][0]

    def gossip(self, xs, name, compression=None):
        codes = {None: self.c.COMPRESSION_JOB, "none": self.c.COMPRESSION_NONE,
                 "fp16": self.c.COMPRESSION_FP16, "bf16": self.c.COMPRESSION_BF16,
                 "mixed": self.c.COMPRESSION_MIXED, "u8": self.c.COMPRESSION_U8}
        return self._run(self.c.GOSSIP, xs, self._names("gossip", name, len(xs)),
                         compression=codes[compression])[0]


class TensorFlow(Adapter):
    """horovod.tensorflow in eager mode; gossip from ferrovod.tensorflow."""

    name = "tf"
    has_gossip = True

    def init(self):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf
        import horovod.tensorflow as hvd
        from ferrovod.tensorflow import gossip
        self.tf, self.hvd, self._gossip = tf, hvd, gossip
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def shutdown(self):
        self.hvd.shutdown()

    def _op(self, op):
        return self.hvd.Sum if op == "sum" else self.hvd.Average

    def allreduce(self, x, op, name):
        return self.hvd.allreduce(self.tf.constant(x), op=self._op(op), name=name).numpy(), None

    def grouped_allreduce(self, xs, op, name):
        outs = self.hvd.grouped_allreduce([self.tf.constant(x) for x in xs], op=self._op(op),
                                          name=name)
        return [o.numpy() for o in outs], None

    def allgather(self, x, name):
        return self.hvd.allgather(self.tf.constant(x), name=name).numpy()

    def broadcast(self, x, root, name):
        return self.hvd.broadcast(self.tf.constant(x), root_rank=root, name=name).numpy()

    def gossip(self, xs, name, compression=None):
        outs = self._gossip([self.tf.constant(x) for x in xs], name, compression=compression)
        return [o.numpy() for o in outs]


class Torch(Adapter):
    """horovod.torch, on CPU tensors or (memory "cuda") on this rank's GPU."""

    name = "torch"

    def init(self):
        import torch
        import horovod.torch as hvd
        self.torch, self.hvd = torch, hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.dev = torch.device("cpu")
        if self.memory == "cuda":
            self.dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
            torch.cuda.set_device(self.dev)

    def shutdown(self):
        self.hvd.shutdown()

    def _t(self, x):
        return self.torch.from_numpy(np.ascontiguousarray(x)).to(self.dev)

    def _np(self, t):
        return t.detach().cpu().numpy()

    def _op(self, op):
        return self.hvd.Sum if op == "sum" else self.hvd.Average

    def allreduce(self, x, op, name):
        return self._np(self.hvd.allreduce(self._t(x), op=self._op(op), name=name)), None

    def grouped_allreduce(self, xs, op, name):
        outs = self.hvd.grouped_allreduce([self._t(x) for x in xs], op=self._op(op), name=name)
        return [self._np(o) for o in outs], None

    def allgather(self, x, name):
        return self._np(self.hvd.allgather(self._t(x), name=name))

    def broadcast(self, x, root, name):
        return self._np(self.hvd.broadcast(self._t(x), root_rank=root, name=name))


class MXNet(Adapter):
    """horovod.mxnet on CPU NDArrays (asnumpy() waits for the engine operation)."""

    name = "mxnet"

    def init(self):
        import mxnet as mx
        import horovod.mxnet as hvd
        self.mx, self.hvd = mx, hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def shutdown(self):
        self.mx.nd.waitall()
        self.hvd.shutdown()

    def _t(self, x):
        return self.mx.nd.array(x, dtype=x.dtype)

    def _op(self, op):
        return self.hvd.Sum if op == "sum" else self.hvd.Average

    def allreduce(self, x, op, name):
        return self.hvd.allreduce(self._t(x), op=self._op(op), name=name).asnumpy(), None

    def grouped_allreduce(self, xs, op, name):
        outs = self.hvd.grouped_allreduce([self._t(x) for x in xs], op=self._op(op), name=name)
        return [o.asnumpy() for o in outs], None

    def allgather(self, x, name):
        return self.hvd.allgather(self._t(x), name=name).asnumpy()

    def broadcast(self, x, root, name):
        return self.hvd.broadcast(self._t(x), root_rank=root, name=name).asnumpy()


ADAPTERS = {a.name: a for a in (CApi, TensorFlow, Torch, MXNet)}
