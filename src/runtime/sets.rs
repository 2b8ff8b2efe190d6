//! The process sets this rank takes part in: each with its communicators, its negotiation, its
//! pending tensors and where its batches run. Sets are created and removed collectively over
//! the world, at the same point on every rank.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::collective::cost::{self, Policy};
use crate::collective::p2p::PointToPoint;
use crate::collective::parallel;
use crate::error::{Error, Result};
use crate::fusion::planner;
use crate::message::{OpKind, Response};
use crate::negotiate::online::Negotiator;
use crate::negotiate::set::SetNegotiation;
use crate::runtime::Runtime;
use crate::runtime::channel::{self, Channel};
use crate::runtime::entry::{PendingEntries, TensorEntry};
use crate::runtime::executor::{Carried, Executor, Hierarchy};
use crate::runtime::gpu;
use crate::runtime::job::JobSettings;
use crate::transport::Transport;
use crate::transport::mpi::MpiComm;

/// One process set this rank belongs to.
pub(crate) struct SetState {
    pub id: i32,
    /// Control collectives (votes, coordinator rounds, plan and autotune agreement), bounded by
    /// the stall shutdown time.
    pub ctrl: MpiComm,
    pub negotiation: SetNegotiation,
    pub entries: PendingEntries,
    /// The set's data communicator, with its buffers and NCCL streams.
    pub executor: Executor,
    /// With more than one channel: the workers batches are handed to, and the next batch's
    /// number (identical on every rank).
    pub channels: Vec<Channel>,
    pub batch_seq: u64,
    /// Host tensors of this size or more run alone, in place (`fusion::planner::direct_bytes`).
    pub direct_bytes: usize,
    /// Advanced by every vote in which some rank's GPU tensors moved (`collective::replay`).
    pub graph_epoch: u64,
    /// Sends and receives in flight, over a communicator of their own.
    pub p2p: PointToPoint<MpiComm, TensorEntry>,
    /// What its executors' GPU batches connected, as callers read it (`Sets::publish`).
    pub connected: SetConnected,
}

/// A set's executors' NCCL connections (`gpu::Connected`): the set's own, and its channels'.
#[derive(Clone)]
pub(crate) struct SetConnected {
    main: Arc<gpu::Connected>,
    channels: Vec<Arc<gpu::Connected>>,
}

impl SetConnected {
    /// Whether a batch holding `head` finds every connection it may need made, on whichever of
    /// the set's executors it runs.
    pub fn covers(&self, head: &Response) -> bool {
        match self.channels.is_empty() || !channel::runs_on_channel(head.kind) {
            true => self.main.covers(head),
            false => self.channels.iter().all(|c| c.covers(head)),
        }
    }
}

impl SetState {
    /// `nodes`: each world rank's node (`job::Job::nodes`).
    fn open(
        id: i32,
        comm: MpiComm,
        ranks: Vec<i32>,
        nodes: &[i32],
        rt: &Arc<Runtime>,
        settings: &JobSettings,
    ) -> Result<SetState> {
        let cfg = &rt.config;
        let set_rank = comm.rank();
        let node = ranks
            .get(set_rank)
            .and_then(|r| nodes.get(*r as usize))
            .copied()
            .ok_or_else(|| Error::Internal(format!("no node for rank {set_rank} of set {id}")))?;
        let set_nodes: Vec<i32> = (ranks.iter())
            .filter_map(|r| nodes.get(*r as usize).copied())
            .collect();
        let spans_nodes = set_nodes.iter().any(|n| *n != node);
        let direct_bytes = planner::direct_bytes(settings.fusion_direct_bytes, spans_nodes);
        let ring_min_bytes = cost::ring_min_bytes(settings.ring_min_bytes, &set_nodes);
        let ctrl = comm.dup()?.bounded(
            settings.stall.limit(),
            settings.stall.warn_after,
            ranks.clone(),
            format!("process set {id}"),
        )?;
        let p2p = PointToPoint::new(
            comm.dup()?,
            settings.stall.limit(),
            settings.stall.warn_after,
            format!("process set {id}"),
            ranks.clone(),
            set_rank,
        );
        let negotiator = Negotiator::new(
            set_rank,
            ranks,
            settings.cache_capacity,
            settings.negotiation,
            settings.stall,
        );
        let hierarchy = Hierarchy::open(&comm, node, settings, true)?;
        if id == 0 {
            let policy = hierarchy.as_ref().map_or(Policy::Flat, Hierarchy::policy);
            let _ = rt.allreduce_policy.set(policy);
        }
        let carried = Arc::new(Carried::default());
        let threads = match cfg.compression_threads {
            0 => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let here = rt.topology.get().map_or(1, |t| t.local_size as usize);
                parallel::auto_threads(cores, here)
            }
            n => n,
        };
        let channels = if settings.channels > 1 {
            let done = rt
                .inbox
                .lock()
                .expect("inbox")
                .clone()
                .ok_or_else(Error::shut_down)?;
            let turn = Arc::new(channel::LaunchTurn::default());
            (0..settings.channels)
                .map(|k| {
                    let dup = comm.dup()?;
                    let hierarchy = Hierarchy::open(&dup, node, settings, false)?;
                    let executor = Executor::new(
                        dup,
                        hierarchy,
                        ring_min_bytes,
                        spans_nodes,
                        settings,
                        carried.clone(),
                        threads,
                    );
                    let connected = executor.connected.clone();
                    Channel::spawn(k, executor, done.clone(), rt.clone(), turn.clone())
                        .map(|c| (c, connected))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let (channels, channels_connected): (Vec<_>, Vec<_>) = channels.into_iter().unzip();
        let executor = Executor::new(
            comm,
            hierarchy,
            ring_min_bytes,
            spans_nodes,
            settings,
            carried,
            threads,
        );
        let connected = SetConnected {
            main: executor.connected.clone(),
            channels: channels_connected,
        };
        Ok(SetState {
            id,
            ctrl,
            negotiation: SetNegotiation::new(
                negotiator,
                settings.negotiation,
                settings.plan_warmup_steps,
                id == 0,
                cfg,
            ),
            entries: PendingEntries::default(),
            graph_epoch: 0,
            p2p,
            channels,
            batch_seq: 0,
            direct_bytes,
            executor,
            connected,
        })
    }
}

/// The sets of the job.
pub(crate) struct Sets {
    /// Sets this rank is a member of.
    pub member: BTreeMap<i32, SetState>,
    /// Every set's ranks (identical on all ranks).
    pub all: BTreeMap<i32, Vec<i32>>,
    next_id: i32,
    /// Each world rank's node.
    nodes: Vec<i32>,
}

impl Sets {
    /// The global set (id 0) over `world`; `nodes`: each world rank's node.
    pub fn new(
        world: MpiComm,
        nodes: Vec<i32>,
        rt: &Arc<Runtime>,
        settings: &JobSettings,
    ) -> Result<Sets> {
        let ranks: Vec<i32> = (0..world.size() as i32).collect();
        let global = SetState::open(0, world, ranks.clone(), &nodes, rt, settings)?;
        Ok(Sets {
            member: BTreeMap::from([(0, global)]),
            all: BTreeMap::from([(0, ranks)]),
            next_id: 1,
            nodes,
        })
    }

    /// Creates the set (collective over `world`); an existing identical set is reused.
    pub fn create(
        &mut self,
        world: &MpiComm,
        ranks: Vec<i32>,
        rt: &Arc<Runtime>,
        settings: &JobSettings,
    ) -> Result<i32> {
        if let Some((id, _)) = self.all.iter().find(|(_, r)| **r == ranks) {
            return Ok(*id);
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Some(comm) = world.subset(&ranks)? {
            let set = SetState::open(id, comm, ranks.clone(), &self.nodes, rt, settings)?;
            self.member.insert(id, set);
        }
        self.all.insert(id, ranks);
        Ok(id)
    }

    /// Runs an agreed `AddProcessSet` or `RemoveProcessSet` of the global set and completes
    /// its tensor.
    pub fn change(
        &mut self,
        world: &MpiComm,
        resp: &Response,
        rt: &Arc<Runtime>,
        settings: &JobSettings,
    ) {
        let entry = self
            .member
            .get_mut(&0)
            .and_then(|s| s.entries.remove(&resp.name));
        let outcome: Result<i32> = match resp.kind {
            OpKind::AddProcessSet => {
                let ranks: Vec<i32> = resp.shape.iter().map(|r| *r as i32).collect();
                match self.all.iter().find(|(_, r)| **r == ranks) {
                    Some((id, _)) => Err(Error::InvalidArgument(format!(
                        "A process set with ranks {ranks:?} already exists (id {id})."
                    ))),
                    None => self.create(world, ranks, rt, settings),
                }
            }
            _ => {
                let id = resp.shape.first().copied().unwrap_or(0) as i32;
                if id == 0 || !self.all.contains_key(&id) {
                    Err(Error::InvalidArgument(format!(
                        "Process set {id} does not exist, or has not been registered."
                    )))
                } else {
                    self.all.remove(&id);
                    self.drop_set(id, Error::Aborted(format!("process set {id} was removed")));
                    Ok(id)
                }
            }
        };
        self.publish(rt);
        if let Some(e) = entry {
            match outcome {
                Ok(id) => e.complete(Ok(()), Some(id)),
                Err(err) => e.complete(Err(err), None),
            }
        }
    }

    /// Makes every set's ranks visible to callers (`fv_process_set_ranks`), and the
    /// connections of the sets this rank is a member of (`Runtime::settled`).
    pub fn publish(&self, rt: &Runtime) {
        *rt.sets.write().expect("sets") = self.all.clone();
        *rt.connected.write().expect("connected") = (self.member.iter())
            .map(|(id, s)| (*id, s.connected.clone()))
            .collect();
    }

    /// Stops using set `id` on this rank, failing its pending tensors with `err`.
    pub fn drop_set(&mut self, id: i32, err: Error) {
        if let Some(mut set) = self.member.remove(&id) {
            // every member drops the set at the same point, so its channels' queues finish
            for c in &mut set.channels {
                c.close();
                c.join();
            }
            set.fail_p2p(&err);
            for e in set.entries {
                e.complete(Err(err.clone()), None);
            }
        }
    }
}

impl SetState {
    /// Fails the set's sends and receives still in flight; true if MPI still holds some of
    /// their transfers (then MPI must not be finalized).
    pub fn fail_p2p(&mut self, err: &Error) -> bool {
        let (ops, held) = self.p2p.drain();
        for e in ops {
            e.complete(Err(err.clone()), None);
        }
        held
    }
}
