//! The one place where a batch's kind picks its algorithm, for host memory and for GPU memory.
//! The runtime hands a batch here with its memory and its transport; which algorithm runs is a
//! function of the agreed responses only, identical on every rank.

use crate::collective::device::{self, DeviceBatch, DeviceIo, Lane};
use crate::collective::plan::Route;
use crate::collective::{
    self, ActivitySink, Algorithms, BatchMemory, HostBatch, TensorIo, gossip, native,
};
use crate::compress::{Codec, Wire};
use crate::error::{Error, Result};
use crate::fusion::FusionBuffer;
use crate::message::{OpKind, ReduceOp, Response};
use crate::transport::{DeviceTransport, Transport};

/// Runs one batch of host tensors over `t`, through the fusion buffer `fusion`, its values
/// travelling as `wire` says, with the algorithms `how` names.
pub fn host(
    t: &dyn Transport,
    how: &Algorithms,
    fusion: &mut FusionBuffer,
    wire: Wire,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    sink: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    match head.kind {
        OpKind::Allreduce => {
            collective::allreduce_batch(t, &how.allreduce, wire, resps, ios, fusion, sink)
        }
        OpKind::Gossip => match &how.gossip {
            Some(s) => collective::gossip::batch(t, s, resps, ios, fusion, sink),
            None => Err(Error::Internal("a gossip batch without its rounds".into())),
        },
        kind => {
            let mut m = HostBatch {
                t,
                levels: how.allgather.as_ref(),
                ios,
                fusion,
            };
            native(&mut m, kind, resps, sink)
        }
    }
}

/// Which communicators a GPU batch runs over (chosen by the runtime from agreed values).
pub enum DeviceRoute<'a> {
    /// The device transport over every rank of the set.
    Flat(&'a dyn DeviceTransport),
    /// An allreduce inside each node, across nodes, inside each node again.
    Hierarchical(device::Levels<'a>),
}

/// How a GPU batch runs (agreed): its plan, for gossip its rounds, and the state its codec
/// carries.
pub struct DeviceHow<'a> {
    pub plan: crate::collective::plan::BatchPlan,
    pub gossip: Option<gossip::Schedule<'a>>,
    pub wire: Wire<'a>,
}

/// Enqueues one batch of GPU tensors on `lane` over `route`; `host` carries what must be agreed
/// or staged on the host (dtypes the device transport cannot reduce, alltoall's counts).
pub fn device(
    route: DeviceRoute,
    host: &dyn Transport,
    lane: &mut Lane,
    how: &DeviceHow,
    resps: &[&Response],
    ios: &mut [&mut dyn DeviceIo],
    sink: ActivitySink,
) -> Result<()> {
    let head = resps[0];
    let codec = how.plan.codec;
    match (codec, &route) {
        (Codec::None, _) => {}
        (_, DeviceRoute::Hierarchical(_)) if head.kind == OpKind::Allreduce => {}
        (Codec::Half(wire), DeviceRoute::Flat(t)) if head.kind == OpKind::Allreduce => {
            return device::allreduce_half(*t, lane, wire, resps, ios, sink);
        }
        (Codec::U8, DeviceRoute::Flat(t)) if head.kind == OpKind::Allreduce => {
            return device::allreduce_u8(*t, lane, resps, ios, sink);
        }
        (Codec::PowerSgd(rank), DeviceRoute::Flat(t)) if head.kind == OpKind::Allreduce => {
            return device::allreduce_powersgd(*t, lane, &how.wire, rank, resps, ios, sink);
        }
        (Codec::TopK(params), DeviceRoute::Flat(t)) if head.kind == OpKind::Allreduce => {
            return device::allreduce_topk(*t, lane, &how.wire, params, resps, ios, sink);
        }
        _ => {
            return Err(Error::Internal(format!(
                "GPU batches have no codec {codec:?} on this route"
            )));
        }
    }
    let t = match route {
        DeviceRoute::Flat(t) => t,
        DeviceRoute::Hierarchical(levels) if head.kind == OpKind::Allreduce => {
            return device::allreduce_hierarchical(&levels, lane, codec, resps, ios, sink);
        }
        DeviceRoute::Hierarchical(_) => {
            return Err(Error::Internal(format!(
                "a GPU {} cannot run hierarchically",
                head.kind.name()
            )));
        }
    };
    match head.kind {
        OpKind::Allreduce => device::allreduce_batch(t, lane, resps, ios, sink),
        // inside one node: the exact average, as a fused allreduce batch (`plan::choose`)
        OpKind::Gossip if how.plan.route == Route::Native => {
            let average = Response {
                kind: OpKind::Allreduce,
                reduce_op: ReduceOp::Average,
                prescale: 1.0,
                postscale: 1.0,
                ..head.clone()
            };
            device::allreduce_batch(t, lane, &[&average], ios, sink)
        }
        OpKind::Gossip => match &how.gossip {
            Some(s) => device::gossip_batch(t, lane, s, resps, ios, sink),
            None => Err(Error::Internal("a gossip batch without its rounds".into())),
        },
        kind => {
            let mut m = DeviceBatch { t, host, lane, ios };
            native(&mut m, kind, resps, sink)
        }
    }
}

/// Allgather, reducescatter, broadcast and alltoall: the engine's own collectives, written
/// once over either memory.
fn native<M: BatchMemory + ?Sized>(
    m: &mut M,
    kind: OpKind,
    resps: &[&Response],
    sink: ActivitySink,
) -> Result<()> {
    match kind {
        OpKind::Allgather => native::allgather_batch(m, resps, sink),
        OpKind::Reducescatter => native::reducescatter_batch(m, resps, sink),
        OpKind::Broadcast => native::broadcast(m, resps[0], sink),
        OpKind::Alltoall => native::alltoall(m, resps[0], sink),
        other => Err(Error::Internal(format!(
            "{} is not a data batch",
            other.name()
        ))),
    }
}
