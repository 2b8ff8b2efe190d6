// ferrovod's MXNet operations: collectives pushed onto MXNet's dependency engine as
// asynchronous functions, so that they run once their inputs are written, overlap other work,
// and `wait_to_read()`, `asnumpy()` and `mx.nd.waitall()` wait for them.
//
// Built by ferrovod/mxnet/build.py against the installed MXNet's headers, with MXNet's own C++
// ABI (its wheels use the pre-C++11 one). Only MXNet's C API is called; the two engine types a
// C caller must see (the completion callback and the error it takes) are declared below as
// MXNet's engine.h and dmlc/logging.h define them, and so is the head of an NDArray (which
// storage it views, and where), which the C API does not tell. The fv_* symbols come from
// libferrovod, which ferrovod/_core.py loads first with RTLD_GLOBAL.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <mxnet/c_api.h>

#include "ferrovod.h"

namespace dmlc {
// as dmlc/logging.h defines it: what MXNet's engine rethrows when the variable is waited for
struct Error : public std::runtime_error {
  explicit Error(const std::string& s) : std::runtime_error(s) {}
};
}  // namespace dmlc

namespace {

// mxnet::engine::CallbackOnComplete's layout: the callback, the engine, its parameter.
struct OnComplete {
  void (*callback)(void* engine, void* param, const dmlc::Error* error);
  void* engine;
  void* param;

  void operator()(const dmlc::Error* error = nullptr) const { callback(engine, param, error); }
};

// mxnet::Context (device type, device id) and mxnet::FnProperty, as the C API reads them.
struct MxContext {
  int32_t dev_type;
  int32_t dev_id;
};
const MxContext kCpu = {1, 0};
const int32_t kCpuPrioritized = 3;

// MXNet's dtype codes (mshadow) → fv_dtype.
int32_t DtypeCode(int mx) {
  switch (mx) {
    case 0: return FV_DTYPE_F32;
    case 1: return FV_DTYPE_F64;
    case 2: return FV_DTYPE_F16;
    case 3: return FV_DTYPE_U8;
    case 4: return FV_DTYPE_I32;
    case 5: return FV_DTYPE_I8;
    case 6: return FV_DTYPE_I64;
    case 7: return FV_DTYPE_BOOL;
    case 12: return FV_DTYPE_BF16;
    default: return -1;
  }
}

std::string LastError() {
  char buf[4096];
  fv_last_error(buf, sizeof buf, nullptr);
  return buf;
}

std::string HandleError(fv_handle h, int32_t code) {
  size_t needed = 0;
  int32_t rc = fv_handle_error(h, nullptr, 0, &needed);
  std::string msg(needed, '\0');
  if (rc == FV_STATUS_OK && needed > 0) rc = fv_handle_error(h, msg.data(), needed, nullptr);
  if (rc != FV_STATUS_OK) {
    return "ferrovod: the operation failed with status " + std::to_string(code) +
           ", and its message could not be read (status " + std::to_string(rc) + ": " +
           LastError() + ")";
  }
  msg.resize(needed > 0 ? needed - 1 : 0);
  return msg;
}

// One pushed operation, from the push until MXNet's engine frees it (after completion).
struct Param {
  int32_t kind;
  int32_t reduce_op;
  double prescale;
  double postscale;
  int32_t root_rank;
  int32_t process_set;
  int32_t compression;
  std::vector<int32_t> splits;  // alltoall: rows sent to each rank
  std::vector<std::string> names;
  // this library's views of the NDArrays (outputs[i] == inputs[i] in place)
  std::vector<NDArrayHandle> inputs;
  std::vector<NDArrayHandle> outputs;
  OnComplete on_complete;
  // set when the engine runs the operation inside the push: its failure goes here, for the
  // push to return (NaiveEngine drops the error given to the completion callback)
  std::string* inline_error = nullptr;
  // what fv_enqueue reads, kept until completion
  std::vector<std::vector<int64_t>> shapes;
  std::vector<fv_tensor> tensors;
  std::vector<void*> out_data;
  std::vector<size_t> out_bytes;
};

void Fail(Param* p, const std::string& msg) {
  if (p->inline_error != nullptr) *p->inline_error = msg;
  dmlc::Error error(msg);
  p->on_complete(&error);
}

// The push under way on this thread, so that Run can tell that the engine runs it inside the
// push (NaiveEngine) and must find it finished when Run returns.
struct Pushing {
  const Param* param;
  std::string error;
};
thread_local Pushing* pushing = nullptr;

// ferrovod's completion callback (on a ferrovod thread): tells MXNet's engine.
void OnDone(void* user, fv_handle h, int32_t code) {
  auto* p = static_cast<Param*>(user);
  if (code != FV_STATUS_OK) {
    // as Horovod's MXNet ops: MXNetError with the reason, raised where the output is waited for
    std::string msg = HandleError(h, code);
    fv_release(h);
    Fail(p, msg);
    return;
  }
  fv_release(h);
  p->on_complete();
}

// Allgather/reducescatter: the output NDArray, sized by the caller from agreed shapes; a size
// that differs from what ferrovod needs fails the operation rather than overrun it.
void* Alloc(void* user, int32_t index, int32_t, const int64_t*, uint64_t bytes) {
  auto* p = static_cast<Param*>(user);
  if (index < 0 || static_cast<size_t>(index) >= p->out_data.size() ||
      p->out_bytes[index] != bytes) {
    return nullptr;
  }
  return p->out_data[index];
}

size_t DtypeSize(int32_t fv) {
  switch (fv) {
    case FV_DTYPE_F64: case FV_DTYPE_I64: return 8;
    case FV_DTYPE_F32: case FV_DTYPE_I32: return 4;
    case FV_DTYPE_F16: case FV_DTYPE_BF16: return 2;
    default: return 1;
  }
}

// The engine runs this once the inputs are written and nothing else reads or writes the outputs.
void Run(void* /*run_ctx*/, void* on_complete, void* param) {
  auto* p = static_cast<Param*>(param);
  std::memcpy(&p->on_complete, on_complete, sizeof(OnComplete));
  if (pushing != nullptr && pushing->param == p) p->inline_error = &pushing->error;
  const bool wait = p->inline_error != nullptr;
  const size_t n = p->inputs.size();
  const bool allocated = p->kind == FV_OP_KIND_ALLGATHER || p->kind == FV_OP_KIND_REDUCESCATTER ||
                         p->kind == FV_OP_KIND_ALLTOALL;
  p->shapes.resize(n);
  p->tensors.resize(n);
  p->out_data.resize(n);
  p->out_bytes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    void* in = nullptr;
    void* out = nullptr;
    int ndim = 0, out_ndim = 0;
    const int* dims = nullptr;
    const int* out_dims = nullptr;
    int mx_dtype = 0;
    if (MXNDArrayGetData(p->inputs[i], &in) != 0 || MXNDArrayGetData(p->outputs[i], &out) != 0 ||
        MXNDArrayGetShapeEx(p->inputs[i], &ndim, &dims) != 0 ||
        MXNDArrayGetDType(p->inputs[i], &mx_dtype) != 0) {
      Fail(p, std::string("ferrovod: reading the NDArray failed: ") + MXGetLastError());
      return;
    }
    int32_t dtype = DtypeCode(mx_dtype);
    if (dtype < 0) {
      Fail(p, "ferrovod does not support MXNet dtype code " + std::to_string(mx_dtype));
      return;
    }
    p->shapes[i].assign(dims, dims + (ndim > 0 ? ndim : 0));
    size_t out_elems = 1;
    if (MXNDArrayGetShapeEx(p->outputs[i], &out_ndim, &out_dims) != 0) {
      Fail(p, std::string("ferrovod: reading the NDArray failed: ") + MXGetLastError());
      return;
    }
    for (int d = 0; d < out_ndim; ++d) out_elems *= static_cast<size_t>(out_dims[d]);
    p->out_data[i] = out;
    p->out_bytes[i] = out_elems * DtypeSize(dtype);
    fv_tensor& t = p->tensors[i];
    std::memset(&t, 0, sizeof t);
    t.name = p->names[i].c_str();
    t.dtype = dtype;
    t.ndim = static_cast<int32_t>(p->shapes[i].size());
    t.shape = p->shapes[i].data();
    t.input = in;
    t.output = allocated ? nullptr : out;
    if (i == 0 && !p->splits.empty()) {
      t.splits = p->splits.data();
      t.nsplits = static_cast<int32_t>(p->splits.size());
    }
  }
  fv_op op;
  std::memset(&op, 0, sizeof op);
  op.kind = p->kind;
  op.reduce_op = p->reduce_op;
  op.prescale = p->prescale;
  op.postscale = p->postscale;
  op.root_rank = p->root_rank;
  op.process_set = p->process_set;
  op.device = -1;
  op.tensors = p->tensors.data();
  op.num_tensors = static_cast<int32_t>(n);
  op.done = wait ? nullptr : OnDone;
  op.done_user_data = p;
  if (allocated) {
    op.alloc = Alloc;
    op.alloc_user_data = p;
  }
  op.compression = p->compression;
  // MXNet ops always communicate: they cannot report a skipped multistep call
  op.multistep = 1;
  fv_handle h = 0;
  int32_t rc = fv_enqueue(&op, &h);
  if (rc != FV_STATUS_OK) {
    Fail(p, LastError());
    return;
  }
  if (wait) {
    int32_t code = fv_wait(h, -1.0);
    std::string msg = code == FV_STATUS_OK ? std::string() : HandleError(h, code);
    fv_release(h);
    if (code == FV_STATUS_OK) {
      p->on_complete();
    } else {
      Fail(p, msg);
    }
  }
}

// The engine frees the operation after it completed: our views of the NDArrays with it.
void Delete(void* param) {
  auto* p = static_cast<Param*>(param);
  for (size_t i = 0; i < p->inputs.size(); ++i) {
    if (p->outputs[i] != p->inputs[i]) MXNDArrayFree(p->outputs[i]);
    MXNDArrayFree(p->inputs[i]);
  }
  delete p;
}

// A view of `h` (the same storage and engine variable) that this library owns, so that the
// caller may drop its NDArray before the operation runs.
int View(NDArrayHandle h, NDArrayHandle* out) {
  int ndim = 0;
  const int* dims = nullptr;
  if (MXNDArrayGetShapeEx(h, &ndim, &dims) != 0) return -1;
  std::vector<dim_t> d(dims, dims + (ndim > 0 ? ndim : 0));
  return MXNDArrayReshape64(h, ndim, d.data(), false, out);
}

// mxnet::NDArray's leading members as MXNet 1.x's ndarray.h lays them out: the chunk (storage
// and engine variable, shared by every view of one array), the shape, and where the view
// starts in the chunk. MXNet's C API tells neither; HeadMatches() checks the layout first.
struct NDArrayHead {
  const void* chunk;  // std::shared_ptr<Chunk>: the pointer, then its control block
  const void* chunk_count;
  int32_t ndim;
  int32_t heap_dims;
  int64_t dims[4];
  const int64_t* heap;
  size_t byte_offset;
};

const NDArrayHead& Head(NDArrayHandle h) { return *static_cast<const NDArrayHead*>(h); }

// Whether NDArrayHead is this MXNet's layout: a slice of rows 1..2 of a 4 x 3 float32 array
// must share its chunk, start 12 bytes in and read as 2 x 3; another array has its own chunk.
bool HeadMatches() {
  static const bool matches = [] {
    const uint32_t shape[2] = {4, 3};
    NDArrayHandle a = nullptr, b = nullptr, s = nullptr;
    bool ok = MXNDArrayCreateEx(shape, 2, kCpu.dev_type, 0, 1, 0, &a) == 0 &&
              MXNDArrayCreateEx(shape, 2, kCpu.dev_type, 0, 1, 0, &b) == 0 &&
              MXNDArraySlice(a, 1, 3, &s) == 0;
    if (ok) {
      const NDArrayHead &ha = Head(a), &hb = Head(b), &hs = Head(s);
      ok = ha.chunk != nullptr && hs.chunk == ha.chunk && hb.chunk != ha.chunk &&
           ha.byte_offset == 0 && hs.byte_offset == 12 && ha.ndim == 2 && ha.dims[0] == 4 &&
           ha.dims[1] == 3 && hs.ndim == 2 && hs.dims[0] == 2 && hs.dims[1] == 3;
    }
    for (NDArrayHandle h : {s, b, a}) {
      if (h != nullptr) MXNDArrayFree(h);
    }
    return ok;
  }();
  return matches;
}

// The bytes of one tensor's input or output within its chunk.
struct Span {
  const void* chunk;
  size_t start;
  size_t end;
  size_t tensor;
  bool written;
  NDArrayHandle handle;
};

bool SpanOf(NDArrayHandle h, size_t tensor, bool written, Span* out) {
  int ndim = 0, mx_dtype = 0;
  const int* dims = nullptr;
  if (MXNDArrayGetShapeEx(h, &ndim, &dims) != 0 || MXNDArrayGetDType(h, &mx_dtype) != 0) {
    return false;
  }
  size_t bytes = DtypeSize(DtypeCode(mx_dtype));
  for (int d = 0; d < ndim; ++d) bytes *= static_cast<size_t>(dims[d] > 0 ? dims[d] : 0);
  const NDArrayHead& head = Head(h);
  *out = {head.chunk, head.byte_offset, head.byte_offset + bytes, tensor, written, h};
  return true;
}

// The engine variables of one operation: one NDArray per chunk, since views of one array share
// its variable and the engine waits forever on an operation that lists a variable twice.
// Returns why the tensors cannot be one operation (one's result would overwrite another's input
// or result), or "".
std::string Dependencies(const Param& p, std::vector<NDArrayHandle>* reads,
                         std::vector<NDArrayHandle>* writes) {
  const size_t n = p.inputs.size();
  if (!HeadMatches()) {
    if (n > 1) {
      return "ferrovod.mxnet cannot tell which NDArrays share memory in this MXNet (its "
             "NDArray layout is not MXNet 1.x's), so it runs no operation over several tensors";
    }
    if (p.outputs[0] != p.inputs[0]) reads->push_back(p.inputs[0]);
    writes->push_back(p.outputs[0]);
    return "";
  }
  std::vector<Span> spans;
  for (size_t i = 0; i < n; ++i) {
    const bool in_place = p.outputs[i] == p.inputs[i];
    Span in, out;
    if (!SpanOf(p.inputs[i], i, in_place, &in) ||
        (!in_place && !SpanOf(p.outputs[i], i, true, &out))) {
      return std::string("ferrovod: reading the NDArray failed: ") + MXGetLastError();
    }
    spans.push_back(in);
    if (!in_place) spans.push_back(out);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.chunk != b.chunk ? std::less<const void*>()(a.chunk, b.chunk) : a.start < b.start;
  });
  for (size_t k = 0; k < spans.size(); ++k) {
    const Span& a = spans[k];
    for (size_t j = k + 1; j < spans.size() && spans[j].chunk == a.chunk &&
                           spans[j].start < a.end; ++j) {
      const Span& b = spans[j];
      if ((a.written || b.written) && a.start < a.end && b.start < b.end) {
        const std::string& x = p.names[std::min(a.tensor, b.tensor)];
        const std::string& y = p.names[std::max(a.tensor, b.tensor)];
        if (a.tensor == b.tensor) {
          return "ferrovod.mxnet: the output of tensor '" + x + "' overlaps its input";
        }
        return "ferrovod.mxnet: tensors '" + x + "' and '" + y + "' of one grouped operation " +
               "overlap in memory that it writes (the same NDArray twice, or overlapping views " +
               "of one): the outputs of one operation must not overlap";
      }
    }
  }
  for (size_t k = 0; k < spans.size();) {
    size_t j = k;
    bool written = false;
    for (; j < spans.size() && spans[j].chunk == spans[k].chunk; ++j) written |= spans[j].written;
    (written ? writes : reads)->push_back(spans[k].handle);
    k = j;
  }
  return "";
}

}  // namespace

extern "C" {

// Pushes one collective over `n` tensors, `inputs[i]` into `outputs[i]` (the same NDArray for
// in place), as one engine operation and one ferrovod operation (negotiated and completed
// together). Allgather/reducescatter/alltoall outputs must have the agreed result's size;
// `compression` is an fv_compression value (allreduce); `splits` (`nsplits` values, or none)
// the rows alltoall sends to each rank. Tensors may be views of one NDArray unless one's output
// overlaps another's input or output. Returns 0, or -1 with the reason in `err`: nothing was
// pushed, or an engine that runs operations inside the push (NaiveEngine) ran it and it failed.
int fvmx_push(int32_t kind, int32_t reduce_op, double prescale, double postscale,
              int32_t root_rank, int32_t process_set, int32_t compression,
              const int32_t* splits, int32_t nsplits, int32_t n, const char** names,
              NDArrayHandle* inputs, NDArrayHandle* outputs, int32_t priority, char* err,
              size_t err_len) {
  auto p = std::make_unique<Param>();
  p->kind = kind;
  p->reduce_op = reduce_op;
  p->prescale = prescale;
  p->postscale = postscale;
  p->root_rank = root_rank;
  p->process_set = process_set;
  p->compression = compression;
  if (splits != nullptr && nsplits > 0) p->splits.assign(splits, splits + nsplits);
  for (int32_t i = 0; i < n; ++i) {
    NDArrayHandle in = nullptr, out = nullptr;
    if (View(inputs[i], &in) != 0) {
      std::snprintf(err, err_len, "ferrovod: viewing an input NDArray failed: %s", MXGetLastError());
      Delete(p.release());
      return -1;
    }
    out = in;
    if (outputs[i] != inputs[i] && View(outputs[i], &out) != 0) {
      MXNDArrayFree(in);
      std::snprintf(err, err_len, "ferrovod: viewing an output NDArray failed: %s", MXGetLastError());
      Delete(p.release());
      return -1;
    }
    p->names.emplace_back(names[i]);
    p->inputs.push_back(in);
    p->outputs.push_back(out);
  }
  std::vector<NDArrayHandle> reads, writes;
  const std::string refused = n > 0 ? Dependencies(*p, &reads, &writes) : std::string();
  if (!refused.empty()) {
    std::snprintf(err, err_len, "%s", refused.c_str());
    Delete(p.release());
    return -1;
  }
  const std::string opr = "Ferrovod_" + (n > 0 ? p->names[0] : std::string("op"));
  Pushing now{p.get(), std::string()};
  Pushing* outer = pushing;
  pushing = &now;
  // from here MXNet owns the parameter: it calls Delete, also when the push fails
  int rc = MXEnginePushAsyncND(Run, p.release(), Delete, &kCpu, reads.data(),
                               static_cast<int>(reads.size()), writes.data(),
                               static_cast<int>(writes.size()), &kCpuPrioritized, priority,
                               opr.c_str(), false);
  pushing = outer;
  if (rc != 0) {
    std::snprintf(err, err_len, "MXEnginePushAsyncND failed: %s", MXGetLastError());
    return -1;
  }
  if (!now.error.empty()) {
    std::snprintf(err, err_len, "%s", now.error.c_str());
    return -1;
  }
  return 0;
}

}  // extern "C"
