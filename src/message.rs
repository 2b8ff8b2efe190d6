//! What ranks tell each other about tensors: a `Request` (one rank's view of one tensor) and a
//! `Response` (the agreed operation every rank executes). Encoding lives in `negotiate::wire`.

use crate::dtype::DataType;
use crate::error::{Error, Result};

/// Collective kinds. Values follow Horovod's `RequestType`; process-set changes are ferrovod's
/// own, negotiated like tensors so that no per-cycle control traffic is needed for them; so is
/// gossip.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    Allreduce = 0,
    Allgather = 1,
    Broadcast = 2,
    Join = 3,
    Alltoall = 5,
    Barrier = 6,
    Reducescatter = 7,
    AddProcessSet = 20,
    RemoveProcessSet = 21,
    /// ferrovod's own: every rank averages its tensor with one peer's (`collective::gossip`).
    Gossip = 22,
    /// ferrovod's own: point-to-point, between two ranks of a set, outside negotiation
    /// (`collective::p2p`); the peer is `fv_op.root_rank`.
    Send = 23,
    Recv = 24,
}

impl OpKind {
    /// Rust only: as a C macro it would name identifiers that do not exist.
    /// cbindgen:ignore
    pub const ALL: [OpKind; 12] = [
        OpKind::Allreduce,
        OpKind::Allgather,
        OpKind::Broadcast,
        OpKind::Join,
        OpKind::Alltoall,
        OpKind::Barrier,
        OpKind::Reducescatter,
        OpKind::AddProcessSet,
        OpKind::RemoveProcessSet,
        OpKind::Gossip,
        OpKind::Send,
        OpKind::Recv,
    ];

    pub fn from_i32(v: i32) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| *k as i32 == v)
    }

    /// Upper-case name used in Horovod's messages and timeline (`ALLREDUCE`, ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Allreduce => "ALLREDUCE",
            OpKind::Allgather => "ALLGATHER",
            OpKind::Broadcast => "BROADCAST",
            OpKind::Join => "JOIN",
            OpKind::Alltoall => "ALLTOALL",
            OpKind::Barrier => "BARRIER",
            OpKind::Reducescatter => "REDUCESCATTER",
            OpKind::AddProcessSet => "ADD_PROCESS_SET",
            OpKind::RemoveProcessSet => "REMOVE_PROCESS_SET",
            OpKind::Gossip => "GOSSIP",
            OpKind::Send => "SEND",
            OpKind::Recv => "RECV",
        }
    }

    /// Whether this kind travels between two ranks without negotiation.
    pub fn is_point_to_point(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv)
    }

    /// Whether a response of this kind may be reused from the response cache.
    pub fn cacheable(self) -> bool {
        matches!(
            self,
            OpKind::Allreduce
                | OpKind::Allgather
                | OpKind::Broadcast
                | OpKind::Alltoall
                | OpKind::Reducescatter
                | OpKind::Gossip
        )
    }
}

/// Reduction operators; values follow Horovod (`Average=0, Sum=1, Adasum=2, Min=3, Max=4, Product=5`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Average = 0,
    Sum = 1,
    Adasum = 2,
    Min = 3,
    Max = 4,
    Product = 5,
}

impl ReduceOp {
    pub fn from_i32(v: i32) -> Option<ReduceOp> {
        [
            ReduceOp::Average,
            ReduceOp::Sum,
            ReduceOp::Adasum,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Product,
        ]
        .into_iter()
        .find(|k| *k as i32 == v)
    }

    /// The position of an elementwise reduction in (Sum, Min, Max, Product): how the backends'
    /// per-reduction tables and kernels are indexed. Average (a postscale) and Adasum are not
    /// elementwise.
    pub fn elementwise_index(self) -> Result<usize> {
        match self {
            ReduceOp::Sum => Ok(0),
            ReduceOp::Min => Ok(1),
            ReduceOp::Max => Ok(2),
            ReduceOp::Product => Ok(3),
            other => Err(Error::InvalidArgument(format!(
                "reduction {other:?} is not an elementwise reduction"
            ))),
        }
    }
}

/// A receive's peer (`fv_op.root_rank`) that takes the first message with its tag from any
/// rank of the set.
pub const ANY_SOURCE: i32 = -1;

/// Host memory, as Horovod's `CPU_DEVICE_ID`.
pub const CPU_DEVICE: i32 = -1;

/// Reserved tensor names, as in Horovod: the runtime submits them and the coordinator answers
/// a join with one, so they live below both.
pub const JOIN_NAME: &str = "join.noname";
pub const BARRIER_NAME: &str = "barrier.noname";

/// Largest element count passed to one MPI call (MPI counts are C ints); larger transfers are
/// split into several calls. Settings bound `FERROVOD_MPI_MAX_COUNT` by it.
pub const MPI_MAX_COUNT: usize = 1 << 30;

/// One rank's description of one tensor it submitted.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Rank within the process set.
    pub rank: i32,
    pub kind: OpKind,
    pub dtype: DataType,
    pub name: String,
    /// Tensor shape; for process-set changes, the member ranks (add) or the set id (remove).
    pub shape: Vec<i64>,
    /// Broadcast root, relative to the process set.
    pub root: i32,
    pub device: i32,
    pub reduce_op: ReduceOp,
    pub prescale: f64,
    pub postscale: f64,
    /// The operation's own compression (None: the job's).
    pub compression: Option<Compression>,
    /// Allreduce: how often it communicates (resolved: the job's where the op did not say).
    pub multistep: Multistep,
}

/// PowerSGD's factor width unless `FERROVOD_POWERSGD_RANK` says otherwise.
pub const POWERSGD_RANK: usize = 4;

/// How an allreduce's values may travel (the codecs: `compress`), as a job
/// (`FERROVOD_COMPRESSION`, or AIACC's `PERSEUS_ALLREDUCE_DTYPE`; agreed from rank 0) or one
/// operation (the C API's `fv_op.compression`) asks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compression {
    #[default]
    None,
    /// f32 allreduces travel as IEEE half precision.
    Fp16,
    /// f32 allreduces travel as bfloat16.
    Bf16,
    /// Per tensor: f32 below `compress::Codecs::min_bytes` (biases, norm parameters: few bytes, and
    /// the most sensitive to rounding), IEEE half precision from it.
    Mixed,
    /// 8-bit min-max quantization with error feedback (`compress::quantize`).
    U8,
    /// Matrices as two low-rank factors with error feedback (`compress::powersgd`), of this
    /// rank (0: the job's `FERROVOD_POWERSGD_RANK`).
    PowerSgd(u32),
    /// The largest magnitudes only, as (index, value) pairs, with error feedback
    /// (`compress::topk`), this share of them in millionths (0: the job's
    /// `FERROVOD_TOPK_RATIO`).
    TopK(u32),
}

/// The largest rank an operation may ask PowerSGD for (`FERROVOD_POWERSGD_RANK`'s too).
pub const POWERSGD_MAX_RANK: u32 = 1024;

impl Compression {
    pub const ALL: [Compression; 7] = [
        Compression::None,
        Compression::Fp16,
        Compression::Bf16,
        Compression::Mixed,
        Compression::U8,
        Compression::PowerSgd(0),
        Compression::TopK(0),
    ];

    /// `none`, `fp16`, `bf16`, `mixed`, `u8`, `powersgd` or `topk` (`FERROVOD_COMPRESSION`).
    pub fn parse(s: &str) -> Option<Compression> {
        let s = s.trim().to_ascii_lowercase();
        Compression::ALL.into_iter().find(|c| c.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Fp16 => "fp16",
            Compression::Bf16 => "bf16",
            Compression::Mixed => "mixed",
            Compression::U8 => "u8",
            Compression::PowerSgd(_) => "powersgd",
            Compression::TopK(_) => "topk",
        }
    }

    /// The name, with the operation's own parameter where it has one (`topk (ratio 0.05)`).
    pub fn describe(self) -> String {
        match self {
            Compression::PowerSgd(r) if r > 0 => format!("powersgd (rank {r})"),
            Compression::TopK(p) if p > 0 => format!("topk (ratio {})", p as f64 / 1e6),
            c => c.name().to_string(),
        }
    }

    /// The codec's parameter (0 where it has none, or where it is the job's).
    pub fn param(self) -> u32 {
        match self {
            Compression::PowerSgd(p) | Compression::TopK(p) => p,
            _ => 0,
        }
    }

    /// This compression with parameter `p`: an error where it takes none (`p` > 0) or `p` is out
    /// of its range (PowerSGD's rank above `POWERSGD_MAX_RANK`, top-k's share above a million
    /// millionths).
    pub fn with_param(self, p: u32) -> std::result::Result<Compression, String> {
        match self {
            _ if p == 0 => Ok(self),
            Compression::PowerSgd(_) if p <= POWERSGD_MAX_RANK => Ok(Compression::PowerSgd(p)),
            Compression::TopK(_) if p <= 1_000_000 => Ok(Compression::TopK(p)),
            Compression::PowerSgd(_) => {
                Err(format!("PowerSGD rank {p} is above {POWERSGD_MAX_RANK}"))
            }
            Compression::TopK(_) => Err(format!("top-k ratio of {p} millionths is above one")),
            c => Err(format!(
                "{} compression takes no parameter ({p} given)",
                c.name()
            )),
        }
    }

    /// AIACC's `PERSEUS_ALLREDUCE_DTYPE`: 0 fp16, 1 none, 2 mixed.
    pub fn from_perseus(s: &str) -> Option<Compression> {
        match s.trim() {
            "0" => Some(Compression::Fp16),
            "1" => Some(Compression::None),
            "2" => Some(Compression::Mixed),
            _ => None,
        }
    }

    /// The value on the wire and in the C API (`FV_COMPRESSION_*` less one: 0 there is "the
    /// job's").
    pub fn code(self) -> usize {
        match self {
            Compression::None => 0,
            Compression::Fp16 => 1,
            Compression::Bf16 => 2,
            Compression::Mixed => 3,
            Compression::U8 => 4,
            Compression::PowerSgd(_) => 5,
            Compression::TopK(_) => 6,
        }
    }

    pub fn from_code(c: usize) -> Option<Compression> {
        Compression::ALL.get(c).copied()
    }
}

/// How often an allreduce communicates (`compress::multistep`): on every `every`-th call of a
/// tensor, and on each of its first `warmup` calls (post-local SGD). Between communications
/// the calls' inputs are summed and the sum is reduced (`accumulate`: gradients, Horovod's
/// `backward_passes_per_step`), or only the communicating call's input is (parameters: local
/// SGD, model averaging).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Multistep {
    pub every: u32,
    pub warmup: u32,
    pub accumulate: bool,
}

impl Multistep {
    /// Every call communicates.
    pub const EVERY_CALL: Multistep = Multistep {
        every: 1,
        warmup: 0,
        accumulate: true,
    };

    /// Whether a tensor's call number `call` (0 for its first) communicates: a pure function of
    /// the call count, which every rank's script advances alike.
    pub fn communicates(self, call: u64) -> bool {
        let (every, warmup) = (self.every.max(1) as u64, self.warmup as u64);
        call < warmup || (call - warmup + 1).is_multiple_of(every)
    }

    pub fn is_every_call(self) -> bool {
        self.every <= 1
    }
}

impl Default for Multistep {
    fn default() -> Multistep {
        Multistep::EVERY_CALL
    }
}

/// What two descriptions of one tensor must agree on for the same collective to run: everything
/// but the name, the data and (for responses) the outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct OpParams<'a> {
    pub kind: OpKind,
    pub dtype: DataType,
    pub shape: &'a [i64],
    pub root: i32,
    pub device: i32,
    pub reduce_op: ReduceOp,
    pub prescale: f64,
    pub postscale: f64,
    pub compression: Option<Compression>,
    pub multistep: Multistep,
}

impl Request {
    pub fn params(&self) -> OpParams<'_> {
        OpParams {
            kind: self.kind,
            dtype: self.dtype,
            shape: &self.shape,
            root: self.root,
            device: self.device,
            reduce_op: self.reduce_op,
            prescale: self.prescale,
            postscale: self.postscale,
            compression: self.compression,
            multistep: self.multistep,
        }
    }

    pub fn num_elements(&self) -> i64 {
        self.shape.iter().product()
    }

    /// A set-rank-0 host request with neutral parameters, for unit tests.
    #[cfg(test)]
    pub(crate) fn test(name: &str, kind: OpKind, dtype: DataType, shape: &[i64]) -> Request {
        Request {
            rank: 0,
            kind,
            dtype,
            name: name.into(),
            shape: shape.to_vec(),
            root: 0,
            device: CPU_DEVICE,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: Multistep::EVERY_CALL,
        }
    }
}

/// What all ranks agreed to do with one tensor (or the error they all report).
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub kind: OpKind,
    pub name: String,
    pub dtype: DataType,
    /// The agreed shape (for allgather/alltoall: the shape submitted by set rank 0).
    pub shape: Vec<i64>,
    /// Allgather: every rank's first dimension, in set-rank order.
    pub first_dims: Vec<i64>,
    pub root: i32,
    pub device: i32,
    pub reduce_op: ReduceOp,
    pub prescale: f64,
    pub postscale: f64,
    /// The operation's own compression (None: the job's).
    pub compression: Option<Compression>,
    pub multistep: Multistep,
    /// Join: the last rank to join. Add process set: the new set's id.
    pub result: i32,
    /// Set when negotiation failed: every rank completes the tensor with this precondition error.
    pub error: Option<String>,
}

impl Response {
    pub fn params(&self) -> OpParams<'_> {
        OpParams {
            kind: self.kind,
            dtype: self.dtype,
            shape: &self.shape,
            root: self.root,
            device: self.device,
            reduce_op: self.reduce_op,
            prescale: self.prescale,
            postscale: self.postscale,
            compression: self.compression,
            multistep: self.multistep,
        }
    }

    pub fn num_elements(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Elements per first-dimension row.
    pub fn row_elements(&self) -> i64 {
        self.shape.iter().skip(1).product()
    }

    /// Bytes this response moves through a fusion buffer.
    pub fn fused_bytes(&self) -> usize {
        let elems = match self.kind {
            OpKind::Allgather => self.first_dims.iter().sum::<i64>() * self.row_elements(),
            _ => self.num_elements(),
        };
        elems.max(0) as usize * self.dtype.size()
    }

    /// A response that fails `name` on every rank with `message`.
    pub fn error(req: &Request, message: String) -> Response {
        let mut r = Response::from_request(req);
        r.error = Some(message);
        r
    }

    /// An agreed allreduce of `name` with neutral parameters (root 0, no scaling, the job's
    /// codec, every call): what the scale model and the schedule check build for a gradient.
    pub fn allreduce(
        name: &str,
        dtype: DataType,
        shape: &[i64],
        reduce_op: ReduceOp,
        device: i32,
    ) -> Response {
        Response {
            kind: OpKind::Allreduce,
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            first_dims: Vec::new(),
            root: 0,
            device,
            reduce_op,
            prescale: 1.0,
            postscale: 1.0,
            compression: None,
            multistep: Multistep::EVERY_CALL,
            result: 0,
            error: None,
        }
    }

    pub fn from_request(req: &Request) -> Response {
        Response {
            kind: req.kind,
            name: req.name.clone(),
            dtype: req.dtype,
            shape: req.shape.clone(),
            first_dims: Vec::new(),
            root: req.root,
            device: req.device,
            reduce_op: req.reduce_op,
            prescale: req.prescale,
            postscale: req.postscale,
            compression: req.compression,
            multistep: req.multistep,
            result: 0,
            error: None,
        }
    }
}
