// TensorFlow ops over ferrovod's C API (include/ferrovod.h). Op names and attributes are
// Horovod's, so graphs and code that look for them keep working. Every collective is an
// AsyncOpKernel: it enqueues and returns; ferrovod's completion callback (on its background
// thread) sets the status and calls `done`, so no TensorFlow thread blocks.
//
// Built by ferrovod/tensorflow/build.py against the installed TensorFlow's headers. The fv_*
// symbols are resolved at load time from libferrovod, which ferrovod._core loads RTLD_GLOBAL.

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ferrovod.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace ferrovod_tf {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
using ::tensorflow::shape_inference::InferenceContext;

int32_t DtypeCode(DataType t) {
  switch (t) {
    case ::tensorflow::DT_UINT8: return FV_DTYPE_U8;
    case ::tensorflow::DT_INT8: return FV_DTYPE_I8;
    case ::tensorflow::DT_UINT16: return FV_DTYPE_U16;
    case ::tensorflow::DT_INT16: return FV_DTYPE_I16;
    case ::tensorflow::DT_INT32: return FV_DTYPE_I32;
    case ::tensorflow::DT_INT64: return FV_DTYPE_I64;
    case ::tensorflow::DT_HALF: return FV_DTYPE_F16;
    case ::tensorflow::DT_BFLOAT16: return FV_DTYPE_BF16;
    case ::tensorflow::DT_FLOAT: return FV_DTYPE_F32;
    case ::tensorflow::DT_DOUBLE: return FV_DTYPE_F64;
    case ::tensorflow::DT_BOOL: return FV_DTYPE_BOOL;
    default: return -1;
  }
}

// ferrovod status → TensorFlow status: the library's one mapping to canonical codes
// (Horovod's for the codes Horovod has).
absl::Status ToStatus(int32_t code, const std::string& msg) {
  if (code == FV_STATUS_OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(fv_status_code(code)), msg);
}

std::string LastError() {
  char buf[4096];
  fv_last_error(buf, sizeof buf, nullptr);
  return buf;
}

// The node name (optionally without its name scope) is the rendezvous name, as in Horovod.
std::string TensorName(const OpKernel& k, bool ignore_name_scope) {
  std::string n = k.name();
  if (ignore_name_scope) {
    auto pos = n.rfind('/');
    if (pos != std::string::npos) n = n.substr(pos + 1);
  }
  return n;
}

// Everything one enqueued op needs until completion; freed by the completion callback.
struct Pending {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  std::vector<Tensor> keep;                // inputs (refcounted buffers stay alive)
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int32_t> splits;
  std::vector<fv_tensor> tensors;
  bool splits_output = false;              // alltoall: second output = received splits
  bool join_output = false;                // join: output = last joined rank
  int communicated_output = -1;            // multistep allreduce: this output says whether it communicated
};

// The message of a failed operation; if even that cannot be read, says so with both codes.
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

// Every query of the handle is checked: a failed query fails the op with its reason instead
// of completing it with made-up outputs.
void OnDone(void* user, fv_handle h, int32_t code) {
  std::unique_ptr<Pending> p(static_cast<Pending*>(user));
  if (code != FV_STATUS_OK) {
    p->ctx->SetStatus(ToStatus(code, HandleError(h, code)));
  } else if (p->splits_output) {
    // as many received splits as there are ranks in the set: ask for the count first
    int32_t n = 0;
    int32_t rc = fv_handle_received_splits(h, 0, nullptr, 0, &n);
    std::vector<int32_t> got(std::max<int32_t>(n, 0));
    if (rc == FV_STATUS_OK && n > 0) {
      int32_t again = 0;
      rc = fv_handle_received_splits(h, 0, got.data(), n, &again);
      if (rc == FV_STATUS_OK && again != n) rc = FV_STATUS_UNKNOWN;
    }
    if (rc != FV_STATUS_OK) {
      p->ctx->SetStatus(ToStatus(rc, "ferrovod: reading alltoall's received splits failed: " + LastError()));
    } else {
      Tensor* out = nullptr;
      auto s = p->ctx->allocate_output(1, TensorShape({n}), &out);
      if (s.ok() && n > 0) std::memcpy(out->flat<int32_t>().data(), got.data(), sizeof(int32_t) * n);
      p->ctx->SetStatus(s);
    }
  } else if (p->communicated_output >= 0) {
    int32_t sent = 0;
    int32_t rc = fv_handle_value(h, &sent);
    if (rc != FV_STATUS_OK) {
      p->ctx->SetStatus(ToStatus(rc, "ferrovod: reading whether a multistep allreduce communicated failed: " + LastError()));
    } else {
      Tensor* out = nullptr;
      auto s = p->ctx->allocate_output(p->communicated_output, TensorShape({}), &out);
      if (s.ok()) out->scalar<bool>()() = sent != 0;
      p->ctx->SetStatus(s);
    }
  } else if (p->join_output) {
    int32_t last = -1;
    int32_t rc = fv_handle_value(h, &last);
    if (rc != FV_STATUS_OK) {
      p->ctx->SetStatus(ToStatus(rc, "ferrovod: reading join's last rank failed: " + LastError()));
    } else {
      Tensor* out = nullptr;
      auto s = p->ctx->allocate_output(0, TensorShape({}), &out);
      if (s.ok()) out->scalar<int32_t>()() = last;
      p->ctx->SetStatus(s);
    }
  }
  p->done();
}

// Output `index` of the op allocated once ferrovod knows its shape (allgather, alltoall,
// reducescatter), on ferrovod's background thread.
void* AllocOutput(void* user, int32_t index, int32_t ndim, const int64_t* shape, uint64_t bytes) {
  auto* p = static_cast<Pending*>(user);
  TensorShape ts;
  for (int i = 0; i < ndim; ++i) ts.AddDim(shape[i]);
  Tensor* out = nullptr;
  if (!p->ctx->allocate_output(index, ts, &out).ok()) return nullptr;
  (void)bytes;
  return const_cast<char*>(out->tensor_data().data());
}

class CollectiveOp : public AsyncOpKernel {
 public:
  CollectiveOp(OpKernelConstruction* c, int32_t kind) : AsyncOpKernel(c), kind_(kind) {
    if (c->HasAttr("reduce_op")) OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    if (c->HasAttr("prescale_factor")) OP_REQUIRES_OK(c, c->GetAttr("prescale_factor", &prescale_));
    if (c->HasAttr("postscale_factor")) OP_REQUIRES_OK(c, c->GetAttr("postscale_factor", &postscale_));
    if (c->HasAttr("root_rank")) OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
    if (c->HasAttr("ignore_name_scope")) OP_REQUIRES_OK(c, c->GetAttr("ignore_name_scope", &ignore_name_scope_));
    if (c->HasAttr("process_set_id")) OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
    if (c->HasAttr("num_tensors")) OP_REQUIRES_OK(c, c->GetAttr("num_tensors", &num_tensors_));
    if (c->HasAttr("compression")) OP_REQUIRES_OK(c, c->GetAttr("compression", &compression_));
    if (c->HasAttr("tensor_name")) OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
    multistep_op_ = c->HasAttr("multistep");
    if (multistep_op_) {
      OP_REQUIRES_OK(c, c->GetAttr("multistep", &multistep_));
      OP_REQUIRES_OK(c, c->GetAttr("multistep_mode", &multistep_mode_));
      OP_REQUIRES_OK(c, c->GetAttr("multistep_warmup", &multistep_warmup_));
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    // Shape inference and grappler's constant folding run kernels outside any step to
    // precompute values from constant inputs. A collective must run in every step, on every
    // rank alike, so it refuses there: TensorFlow then leaves the node to run time.
    OP_REQUIRES_ASYNC(ctx, ctx->step_container() != nullptr,
                      errors::Unavailable("ferrovod collectives are not evaluated while a graph is "
                                          "being optimised"),
                      done);
    auto p = std::make_unique<Pending>();
    p->ctx = ctx;
    p->done = done;
    const bool later = kind_ == FV_OP_KIND_ALLGATHER || kind_ == FV_OP_KIND_ALLTOALL ||
                       kind_ == FV_OP_KIND_REDUCESCATTER;
    const bool no_tensors = kind_ == FV_OP_KIND_JOIN || kind_ == FV_OP_KIND_BARRIER;
    const int n = no_tensors ? 0 : num_tensors_;
    std::string base = tensor_name_.empty() ? TensorName(*this, ignore_name_scope_) : tensor_name_;
    p->names.reserve(n);
    p->shapes.reserve(n);
    p->tensors.resize(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      int32_t dt = DtypeCode(in.dtype());
      OP_REQUIRES_ASYNC(ctx, dt >= 0,
                        errors::InvalidArgument("ferrovod does not support dtype ",
                                                ::tensorflow::DataTypeString(in.dtype())),
                        done);
      p->keep.push_back(in);
      p->names.push_back(n > 1 ? base + "_" + std::to_string(i + 1) + "of" + std::to_string(n) : base);
      std::vector<int64_t> dims;
      for (int d = 0; d < in.dims(); ++d) dims.push_back(in.dim_size(d));
      p->shapes.push_back(dims);
      fv_tensor& t = p->tensors[i];
      std::memset(&t, 0, sizeof t);
      t.dtype = dt;
      t.ndim = static_cast<int32_t>(dims.size());
      t.input = in.tensor_data().data();
      if (!later) {
        Tensor* out = nullptr;
        OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(i, in.shape(), &out), done);
        t.output = const_cast<char*>(out->tensor_data().data());
        // a multistep call that does not communicate leaves the output as it is: the input
        if (multistep_op_ && in.TotalBytes() > 0) std::memcpy(t.output, t.input, in.TotalBytes());
      }
    }
    if (kind_ == FV_OP_KIND_ALLTOALL) {
      const Tensor& s = ctx->input(1);
      auto flat = s.flat<int32_t>();
      p->splits.assign(flat.data(), flat.data() + flat.size());
      p->splits_output = true;
      if (!p->splits.empty()) {
        p->tensors[0].splits = p->splits.data();
        p->tensors[0].nsplits = static_cast<int32_t>(p->splits.size());
      }
    }
    p->join_output = kind_ == FV_OP_KIND_JOIN;
    for (int i = 0; i < n; ++i) {  // pointers into vectors that no longer grow
      p->tensors[i].name = p->names[i].c_str();
      p->tensors[i].shape = p->shapes[i].data();
    }
    fv_op op;
    std::memset(&op, 0, sizeof op);
    op.kind = kind_;
    op.reduce_op = reduce_op_;
    op.prescale = prescale_;
    op.postscale = postscale_;
    op.compression = compression_;
    // Horovod's ops cannot say that a call did not communicate: they communicate every call,
    // whatever FERROVOD_MULTISTEP says
    op.multistep = 1;
    if (multistep_op_) {
      op.multistep = multistep_;
      op.multistep_mode = multistep_mode_;
      op.multistep_warmup = multistep_warmup_;
      p->communicated_output = n;
    }
    op.root_rank = root_rank_;
    op.process_set = process_set_;
    op.device = FV_CPU_DEVICE;
    op.tensors = p->tensors.data();
    op.num_tensors = n;
    op.done = OnDone;
    op.done_user_data = p.get();
    if (later) {
      op.alloc = AllocOutput;
      op.alloc_user_data = p.get();
    }
    Pending* raw = p.release();
    int32_t code = fv_enqueue(&op, nullptr);
    if (code != FV_STATUS_OK) {
      std::unique_ptr<Pending> back(raw);
      ctx->SetStatus(ToStatus(code, LastError()));
      done();
    }
  }

 private:
  int32_t kind_;
  int reduce_op_ = FV_REDUCE_OP_SUM;
  float prescale_ = 1.0f;
  float postscale_ = 1.0f;
  int root_rank_ = 0;
  bool ignore_name_scope_ = false;
  int process_set_ = 0;
  int num_tensors_ = 1;
  int compression_ = FV_COMPRESSION_DEFAULT;
  std::string tensor_name_;  // the rendezvous name when given (eager kernels ignore node names)
  bool multistep_op_ = false;
  int multistep_ = 0;
  int multistep_mode_ = FV_MULTISTEP_MODE_ACCUMULATE;
  int multistep_warmup_ = 0;
};

template <int32_t Kind>
class KindOp : public CollectiveOp {
 public:
  explicit KindOp(OpKernelConstruction* c) : CollectiveOp(c, Kind) {}
};

// Size/rank queries as ops (scalar int32, computed when the op runs).
template <fv_status (*Fn)(int32_t*)>
class QueryOp : public OpKernel {
 public:
  explicit QueryOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    int32_t v = -1;
    int32_t code = Fn(&v);
    OP_REQUIRES(ctx, code == FV_STATUS_OK, ToStatus(code, LastError()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32_t>()() = v;
  }
};

class ProcessSetQueryOp : public OpKernel {
 public:
  ProcessSetQueryOp(OpKernelConstruction* c, bool included) : OpKernel(c), included_(included) {
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_));
  }
  void Compute(OpKernelContext* ctx) override {
    int32_t v = -1;
    int32_t code = included_ ? fv_process_set_rank(process_set_, &v) : fv_process_set_size(process_set_, &v);
    OP_REQUIRES(ctx, code == FV_STATUS_OK, ToStatus(code, LastError()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int32_t>()() = included_ ? (v >= 0 ? 1 : 0) : v;
  }

 private:
  bool included_;
  int process_set_ = 0;
};

class SizeOp : public ProcessSetQueryOp {
 public:
  explicit SizeOp(OpKernelConstruction* c) : ProcessSetQueryOp(c, false) {}
};

class IncludedOp : public ProcessSetQueryOp {
 public:
  explicit IncludedOp(OpKernelConstruction* c) : ProcessSetQueryOp(c, true) {}
};

absl::Status SameShapes(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

// Output `out` has input `in`'s shape with an unknown first dimension.
absl::Status RowsUnknown(InferenceContext* c, int in, int out) {
  ::tensorflow::shape_inference::ShapeHandle shape;
  if (c->RankKnown(c->input(in)) && c->Rank(c->input(in)) > 0) {
    TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(in), 0, c->UnknownDim(), &shape));
  } else {
    shape = c->UnknownShape();
  }
  c->set_output(out, shape);
  return absl::OkStatus();
}

absl::Status FirstDimUnknown(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) TF_RETURN_IF_ERROR(RowsUnknown(c, i, i));
  return absl::OkStatus();
}

absl::Status Scalar(InferenceContext* c) {
  c->set_output(0, c->Scalar());
  return absl::OkStatus();
}

}  // namespace ferrovod_tf

using namespace ferrovod_tf;  // NOLINT: registration macros below

#define FV_REDUCE_TYPES "T: {uint8, int8, int32, int64, float16, bfloat16, float32, float64}"
#define FV_ALL_TYPES "T: {uint8, int8, uint16, int16, int32, int64, float16, bfloat16, float32, float64, bool}"

REGISTER_OP("HorovodAllreduce")
    .Attr(FV_REDUCE_TYPES)
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Attr("tensor_name: string = ''")
    .Input("tensor: T")
    .Output("sum: T")
    .SetShapeFn(SameShapes);
REGISTER_KERNEL_BUILDER(Name("HorovodAllreduce").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLREDUCE>);

REGISTER_OP("HorovodGroupedAllreduce")
    .Attr(FV_REDUCE_TYPES)
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float")
    .Attr("postscale_factor: float")
    .Attr("compression: int = 0")
    .Attr("num_tensors: int")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Attr("tensor_name: string = ''")
    .Input("tensors: num_tensors*T")
    .Output("sum: num_tensors*T")
    .SetShapeFn(SameShapes);
REGISTER_KERNEL_BUILDER(Name("HorovodGroupedAllreduce").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLREDUCE>);

// ferrovod's own: a multistep allreduce (communicates on every `multistep`-th call of its
// tensors; `communicated` says whether this one did) and gossip (neighbour average).
REGISTER_OP("FerrovodMultistepAllreduce")
    .Attr("T: {float16, bfloat16, float32, float64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("compression: int = 0")
    .Attr("multistep: int")
    .Attr("multistep_mode: int = 0")
    .Attr("multistep_warmup: int = 0")
    .Attr("tensor_name: string")
    .Attr("num_tensors: int")
    .Attr("process_set_id: int = 0")
    .Input("tensors: num_tensors*T")
    .Output("sum: num_tensors*T")
    .Output("communicated: bool")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      c->set_output(c->num_inputs(), c->Scalar());
      return absl::OkStatus();
    });
REGISTER_KERNEL_BUILDER(Name("FerrovodMultistepAllreduce").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLREDUCE>);

REGISTER_OP("FerrovodGossip")
    .Attr("T: {float16, bfloat16, float32, float64}")
    .Attr("compression: int = 0")
    .Attr("tensor_name: string")
    .Attr("num_tensors: int")
    .Attr("process_set_id: int = 0")
    .Input("tensors: num_tensors*T")
    .Output("average: num_tensors*T")
    .SetIsStateful()
    .SetShapeFn(SameShapes);
REGISTER_KERNEL_BUILDER(Name("FerrovodGossip").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_GOSSIP>);

REGISTER_OP("HorovodAllgather")
    .Attr(FV_ALL_TYPES)
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("output: T")
    .SetShapeFn(FirstDimUnknown);
REGISTER_KERNEL_BUILDER(Name("HorovodAllgather").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLGATHER>);

REGISTER_OP("HorovodGroupedAllgather")
    .Attr(FV_ALL_TYPES)
    .Attr("num_tensors: int")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensors: num_tensors*T")
    .Output("output: num_tensors*T")
    .SetShapeFn(FirstDimUnknown);
REGISTER_KERNEL_BUILDER(Name("HorovodGroupedAllgather").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLGATHER>);

REGISTER_OP("HorovodBroadcast")
    .Attr(FV_ALL_TYPES)
    .Attr("root_rank: int")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("output: T")
    .SetShapeFn(SameShapes);
REGISTER_KERNEL_BUILDER(Name("HorovodBroadcast").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_BROADCAST>);

REGISTER_OP("HorovodAlltoall")
    .Attr(FV_ALL_TYPES)
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("output: T")
    .Output("received_splits: int32")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(RowsUnknown(c, 0, 0));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });
REGISTER_KERNEL_BUILDER(Name("HorovodAlltoall").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_ALLTOALL>);

REGISTER_OP("HorovodReducescatter")
    .Attr("T: {int32, int64, float16, bfloat16, float32, float64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("output: T")
    .SetShapeFn(FirstDimUnknown);
REGISTER_KERNEL_BUILDER(Name("HorovodReducescatter").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_REDUCESCATTER>);

REGISTER_OP("HorovodGroupedReducescatter")
    .Attr("T: {int32, int64, float16, bfloat16, float32, float64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("num_tensors: int")
    .Attr("ignore_name_scope: bool = False")
    .Attr("process_set_id: int = 0")
    .Input("tensors: num_tensors*T")
    .Output("output: num_tensors*T")
    .SetShapeFn(FirstDimUnknown);
REGISTER_KERNEL_BUILDER(Name("HorovodGroupedReducescatter").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_REDUCESCATTER>);

REGISTER_OP("HorovodJoin").Output("last_joined_rank: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodJoin").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_JOIN>);

REGISTER_OP("HorovodBarrier").Attr("process_set_id: int = 0").SetIsStateful();
REGISTER_KERNEL_BUILDER(Name("HorovodBarrier").Device(::tensorflow::DEVICE_CPU), KindOp<FV_OP_KIND_BARRIER>);

REGISTER_OP("HorovodSize").Attr("process_set_id: int = 0").Output("size: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodSize").Device(::tensorflow::DEVICE_CPU), SizeOp);

REGISTER_OP("HorovodProcessSetIncluded").Attr("process_set_id: int = 0").Output("included: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodProcessSetIncluded").Device(::tensorflow::DEVICE_CPU), IncludedOp);

REGISTER_OP("HorovodLocalSize").Output("local_size: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodLocalSize").Device(::tensorflow::DEVICE_CPU), QueryOp<fv_local_size>);

REGISTER_OP("HorovodRank").Output("rank: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodRank").Device(::tensorflow::DEVICE_CPU), QueryOp<fv_rank>);

REGISTER_OP("HorovodLocalRank").Output("local_rank: int32").SetIsStateful().SetShapeFn(Scalar);
REGISTER_KERNEL_BUILDER(Name("HorovodLocalRank").Device(::tensorflow::DEVICE_CPU), QueryOp<fv_local_rank>);
