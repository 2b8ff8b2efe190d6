//! One step of the scale model, event by event: the gradients reach the framework in backward
//! order, each is submitted, negotiation rounds agree on what every rank has (online: one
//! vote per round once the names are cached; Horovod's protocol: a coordinator's gather and
//! broadcast per round; offline: a frozen plan, no round at all), ferrovod's own fusion planner
//! cuts each round's tensors into batches, its cost model picks each batch's algorithm, its
//! codecs say the bytes on the wire, and the batches run on the set's lanes over the network
//! model. The decisions are the library's functions; only the clock is the model's.

use std::ops::Range;
use std::sync::Arc;

use crate::collective::cost::{self, CostModel, Link, Policy};
use crate::collective::plan::{self, Levels, Route, Settings};
use crate::compress::{Codec, Codecs};
use crate::config::{AlgorithmChoice, Config, NegotiationMode};
use crate::dtype::DataType;
use crate::fusion::planner;
use crate::message::{CPU_DEVICE, ReduceOp, Response};
use crate::negotiate::learn::{GroupLearner, LearnContext, PlanLearner};
use crate::negotiate::ready_bitmap::{self, Vote};
use crate::sim::network::{self, Algorithm, Fabric, Topology};

/// A gradient of a model's shape set: its parameter's name and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradient {
    pub name: String,
    pub shape: Vec<i64>,
}

impl Gradient {
    pub fn values(&self) -> usize {
        self.shape.iter().product::<i64>().max(0) as usize
    }
}

/// A shape set as `../shared/data` keeps it: `name<TAB>AxBxC` lines in registration order
/// (`#` starts a comment). Gradients come back in the reverse order.
pub fn shapes(text: &str) -> Result<Vec<Gradient>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, dims) = line
            .split_once('\t')
            .ok_or_else(|| format!("line {}: no tab between name and shape", n + 1))?;
        let shape = (dims.split('x'))
            .map(|d| d.trim().parse::<i64>().ok().filter(|d| *d > 0))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| format!("line {}: shape {dims:?} is not AxBxC", n + 1))?;
        out.push(Gradient {
            name: name.to_string(),
            shape,
        });
    }
    Ok(out)
}

/// How the ranks agree on what to reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Negotiation {
    /// ferrovod's online protocol with the names cached: one AND-allreduce of a bit per cached
    /// tensor per round.
    Online,
    /// A frozen plan: each batch starts once its tensors are submitted, no message.
    Offline,
    /// Horovod's protocol: every rank's requests gathered at the coordinator, the responses
    /// broadcast, each round.
    Horovod,
}

/// Bytes of one request in Horovod's protocol (name, shape, type, device, op) and of one
/// response, as its wire format has them for a parameter's name.
const REQUEST_BYTES: f64 = 96.0;
const RESPONSE_BYTES: f64 = 80.0;

/// What each rank's software costs, beside the network's time (default: nothing, and no
/// lane beyond the one every job has).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Host {
    /// Seconds the framework takes to submit one tensor.
    pub submit: f64,
    /// Seconds from a submission to the background loop's round that can take it.
    pub wake: f64,
    /// Seconds of one round's own work on a rank, beside its messages.
    pub round: f64,
    /// Seconds each collective call costs beside its transfer (its set-up and launch).
    pub call: f64,
    /// Seconds per byte a batch of several tensors spends packed into and out of the fusion
    /// buffer (host memory; a GPU's copies are kernels that overlap, 0).
    pub pack: f64,
    /// Seconds per value of a codec's own arithmetic (casts, PowerSGD's products, top-k's
    /// selection) on one rank.
    pub codec: f64,
    /// Batches that run at once (NCCL streams; one on host memory).
    pub lanes: usize,
}

/// A job of the model: where it runs and how ferrovod is set up.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub topology: Topology,
    pub fabric: Fabric,
    pub host: Host,
    pub negotiation: Negotiation,
    /// `HOROVOD_FUSION_THRESHOLD`.
    pub threshold: usize,
    /// Host tensors of this size or more run alone (`planner::direct_bytes`).
    pub direct_bytes: usize,
    /// Flat host allreduces of this size or more run the ring (`cost::ring_min_bytes`).
    pub ring_min_bytes: usize,
    pub codecs: Codecs,
    /// Flat or hierarchical per batch (`cost::Policy`, the library's choice).
    pub policy: Policy,
    /// `FERROVOD_PLAN_WARMUP_STEPS`: identical steps before groups or a plan are learned.
    pub warmup: usize,
    /// What a flat allreduce is on this engine, and a hierarchical one.
    pub flat: Algorithm,
    pub hierarchical: Algorithm,
    /// GPU tensors (device 0) or host ones.
    pub on_gpu: bool,
}

/// What a job learns from its first steps: the groups its votes carry one bit each for, or a
/// frozen plan's batches (offline, host tensors); the tensors' names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Learned {
    Groups(Vec<Vec<String>>),
    Plan(Vec<Vec<String>>),
}

/// One batch of a vote as the library runs it: its members (indices into the vote's
/// responses), its codec and its route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub members: Vec<usize>,
    pub codec: Codec,
    pub route: Route,
}

/// What one simulated step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    /// Seconds from the step's start until every batch is done.
    pub end: f64,
    /// Seconds when the last gradient was submitted.
    pub submitted: f64,
    pub batches: usize,
    /// Negotiation rounds and the bytes one rank sent and received for them.
    pub rounds: usize,
    pub control_bytes: f64,
    /// Each batch: (start, end, bytes on the wire per rank, algorithm).
    pub trace: Vec<(f64, f64, usize, Algorithm)>,
}

/// The response every rank agrees on for `g`: an f32 average, as a training job's gradients.
fn response(g: &Gradient, on_gpu: bool) -> Response {
    let device = if on_gpu { 0 } else { CPU_DEVICE };
    Response::allreduce(&g.name, DataType::F32, &g.shape, ReduceOp::Average, device)
}

impl Job {
    /// A job with ferrovod's defaults: online negotiation, a fusion threshold of 128 MiB, no
    /// codec, flat allreduces (by ring), hierarchical ones with a ring across nodes.
    pub fn new(topology: Topology, fabric: Fabric, host: Host, on_gpu: bool) -> Job {
        Job::from_config(
            topology,
            fabric,
            host,
            on_gpu,
            &Config::from_lookup(&|_| None),
        )
    }

    /// The job `cfg` sets up (as one rank reads it; the library runs with rank 0's), placed
    /// as the topology says: ranks in blocks of `per_node`. `FERROVOD_ALGORITHM=auto` chooses
    /// by a cost model of the fabric's messages, where the library measures its own.
    pub fn from_config(
        topology: Topology,
        fabric: Fabric,
        host: Host,
        on_gpu: bool,
        cfg: &Config,
    ) -> Job {
        let (nodes, per_node) = (topology.nodes, topology.per_node);
        let node_map: Vec<i32> = (0..topology.ranks())
            .map(|r| (r / per_node) as i32)
            .collect();
        let policy = match cfg.algorithm {
            AlgorithmChoice::Flat => Policy::Flat,
            AlgorithmChoice::Hierarchical => Policy::Hierarchical,
            // one node, or one rank on each: the library opens no hierarchy
            AlgorithmChoice::Auto if nodes == 1 || per_node == 1 => Policy::Flat,
            AlgorithmChoice::Auto => Policy::Auto(CostModel::from_messages(
                fabric.inside,
                fabric.nic,
                per_node,
                nodes,
            )),
        };
        Job {
            topology,
            fabric,
            host,
            negotiation: match cfg.negotiation {
                NegotiationMode::Online => Negotiation::Online,
                NegotiationMode::Offline => Negotiation::Offline,
                NegotiationMode::Horovod => Negotiation::Horovod,
            },
            threshold: cfg.fusion_threshold,
            direct_bytes: planner::direct_bytes(cfg.fusion_direct_bytes, nodes > 1),
            ring_min_bytes: cost::ring_min_bytes(cfg.ring_min_bytes, &node_map),
            codecs: Codecs::from_config(cfg),
            policy,
            warmup: cfg.plan_warmup_steps,
            flat: Algorithm::Ring,
            hierarchical: Algorithm::Hierarchical,
            on_gpu,
        }
    }

    /// The batches one vote's agreed responses run as: the library's fusion planner over
    /// the vote's learned groups (`groups`: their sizes, first in the vote) and its choice of
    /// route for each batch (`plan::choose`), as `runtime::launch` calls them.
    pub fn plan_vote(&self, resps: &[&Response], groups: &[usize]) -> Vec<Planned> {
        let batches = planner::plan_segments(
            resps,
            groups,
            self.threshold,
            self.direct_bytes,
            &self.codecs,
        );
        batches
            .into_iter()
            .map(|b| {
                let batch: Vec<&Response> = b.members.iter().map(|m| resps[*m]).collect();
                let route = self.route(&batch, b.codec);
                Planned {
                    members: b.members,
                    codec: b.codec,
                    route,
                }
            })
            .collect()
    }

    /// The route of a batch travelling as `codec` (`plan::choose` with this job's settings).
    pub fn route(&self, batch: &[&Response], codec: Codec) -> Route {
        let t = self.topology;
        // the library opens a hierarchy only for a choice that is not flat, and for `auto`
        // only where a node holds several of the set's ranks and there are several nodes
        let levels = match self.policy {
            Policy::Flat => None,
            _ => Some(Levels {
                policy: self.policy,
                allgather: false,
            }),
        };
        let settings = Settings {
            ring_min_bytes: self.ring_min_bytes,
            nan_check: false,
            graphs: self.on_gpu,
            gossip_pairs: t.nodes > 1,
        };
        let bytes = plan::batch_bytes(batch);
        plan::choose(batch[0], bytes, codec, &settings, levels.as_ref()).route
    }

    /// What the library learns from a job whose steps are agreed vote by vote as `votes`
    /// says (each vote's responses, in order, from the first step on): its own learners, fed
    /// what a rank's loop feeds them. None where it learns nothing from them (Horovod's
    /// protocol; too few steps).
    pub fn learn<'a>(&self, votes: impl IntoIterator<Item = &'a [Response]>) -> Option<Learned> {
        let ctx = LearnContext {
            fusion_threshold: self.threshold,
            direct_bytes: self.direct_bytes,
            codecs: self.codecs,
            alone: true,
        };
        let arcs = |v: &[Response]| v.iter().cloned().map(Arc::new).collect::<Vec<_>>();
        let names = |batches: &[Vec<Response>]| -> Vec<Vec<String>> {
            (batches.iter())
                .map(|b| b.iter().map(|r| r.name.clone()).collect())
                .collect()
        };
        // offline: a plan once its step has run; steps it cannot hold (GPU tensors) vote by
        // groups learned meanwhile, as online
        if self.negotiation == Negotiation::Horovod {
            return None;
        }
        let mut plans =
            (self.negotiation == Negotiation::Offline).then(|| PlanLearner::new(self.warmup));
        let mut groups = GroupLearner::new(self.warmup);
        for v in votes {
            let v = arcs(v);
            let learned = groups.observe(&v, ctx, |_| false, &[]);
            if let Some(p) = plans.as_mut() {
                p.observe(&v, ctx);
                if let Some(plan) = p.take_ready() {
                    return Some(Learned::Plan(names(&plan.batches)));
                }
            }
            if let Some(g) = learned {
                return Some(Learned::Groups(g));
            }
        }
        None
    }

    /// The link negotiation's small messages take: the slowest the set spans.
    fn control_link(&self) -> Link {
        let (i, n) = (self.fabric.inside, self.fabric.nic);
        match (self.topology.nodes, self.topology.per_node) {
            (1, _) => i,
            (_, 1) => n,
            _ => Link {
                alpha: i.alpha.max(n.alpha),
                beta: i.beta.max(n.beta),
            },
        }
    }

    /// Seconds of one negotiation round of protocol `how` whose vote carries `singles` cached
    /// names and `groups` learned groups, of which `taken` tensors (or groups) are agreed in it.
    fn round(&self, how: Negotiation, singles: usize, groups: usize, taken: usize) -> (f64, f64) {
        let p = self.topology.ranks();
        let l = self.control_link();
        match how {
            Negotiation::Offline => (0.0, 0.0),
            Negotiation::Online => {
                // the vote's words as the library encodes them, sent and received at each of
                // the AND allreduce's steps
                let vote = Vote {
                    gpu_moved: self.on_gpu.then_some(false),
                    ..Vote::default()
                };
                let words = ready_bitmap::encode_grouped(&vote, singles, groups).len();
                let bytes = words as f64 * 8.0;
                let t = network::halving_doubling(p, bytes, l);
                let steps = (usize::BITS - (p.max(1) - 1).leading_zeros()) as f64;
                (self.host.round + t, 2.0 * bytes * steps)
            }
            Negotiation::Horovod => {
                // gather every rank's requests at the coordinator, broadcast the responses
                let depth = (usize::BITS - (p.max(1) - 1).leading_zeros()) as f64;
                let gathered = (p - 1) as f64 * taken as f64 * REQUEST_BYTES;
                let answer = taken as f64 * RESPONSE_BYTES;
                let t = depth * l.alpha + gathered * l.beta + network::tree(p, answer, l) / 2.0;
                (
                    self.host.round + t,
                    taken as f64 * (REQUEST_BYTES + RESPONSE_BYTES),
                )
            }
        }
    }

    /// Seconds one batch of `resps` takes on its rank (set-up, packing, the codec's
    /// arithmetic) and on the network, and its bytes per rank on the wire.
    fn batch(
        &self,
        resps: &[&Response],
        codec: Codec,
        route: Route,
    ) -> (f64, f64, usize, Algorithm) {
        let fused: usize = resps.iter().map(|r| r.fused_bytes()).sum();
        let values = fused / 4;
        let wire: usize = resps.iter().map(|r| codec.wire_bytes(r)).sum();
        let algorithm = match route {
            Route::Native => self.flat,
            Route::Ring => Algorithm::Ring,
            Route::Hierarchical => self.hierarchical,
            // gossip ops' own route (the model submits allreduces; its gossip jobs exchange
            // through `flat`)
            Route::Pairs => Algorithm::Exchange(0),
        };
        let t = self.topology;
        let p = t.ranks();
        let net = match codec {
            // every rank's pairs to every rank
            Codec::TopK(_) => {
                let link = self.control_link();
                (p - 1) as f64 * (link.alpha + wire as f64 * link.beta)
            }
            // P, then Q: two allreduces of about half the factors each
            Codec::PowerSgd(_) => 2.0 * self.fabric.allreduce(t, wire as f64 / 2.0, algorithm),
            _ => self.fabric.allreduce(t, wire as f64, algorithm),
        };
        let pack = if resps.len() > 1 {
            self.host.pack * fused as f64
        } else {
            0.0
        };
        let arithmetic = match codec {
            Codec::None => 0.0,
            _ => self.host.codec * values as f64,
        };
        (self.host.call + pack + arithmetic, net, wire, algorithm)
    }
}

/// When each gradient (in backward order) is ready in a training step whose forward pass takes
/// `forward` seconds and backward pass `backward`: each layer's share of the backward pass in
/// proportion to its values, plus an equal share of `per_tensor` (a kernel's least time),
/// within the backward pass's length.
pub fn ready_times(grads: &[Gradient], forward: f64, backward: f64, per_tensor: f64) -> Vec<f64> {
    let n = grads.len() as f64;
    let floor = (per_tensor * n).min(backward);
    let values: f64 = grads.iter().map(|g| g.values() as f64).sum();
    let mut t = forward;
    grads
        .iter()
        .map(|g| {
            t += floor / n + (backward - floor) * g.values() as f64 / values.max(1.0);
            t
        })
        .collect()
}

/// The votes of a step agreed tensor by tensor under protocol `how` (before groups are
/// learned, and always in Horovod's protocol): each round starts once the loop wakes after the
/// first unagreed submission and takes every tensor submitted by then. Each: when it is
/// agreed, its tensors (a range of the step's), and its cost (seconds, bytes).
fn single_votes(job: &Job, how: Negotiation, submitted: &[f64]) -> Vec<(f64, Range<usize>, f64)> {
    let mut votes = Vec::new();
    let (mut next, mut t) = (0, 0.0f64);
    while next < submitted.len() {
        t = t.max(submitted[next] + job.host.wake);
        let taken = (submitted[next..].iter())
            .take_while(|s| **s <= t)
            .count()
            .max(1);
        let (cost, bytes) = job.round(how, submitted.len(), 0, taken);
        t += cost;
        votes.push((t, next..next + taken, bytes));
        next += taken;
    }
    votes
}

/// One step of `job` whose gradients (`grads`, in the order they are produced: backward
/// order) are ready at the times `ready` (seconds from the step's start, non-decreasing): a
/// step of a job that has run long enough to have learned its groups (online) or frozen its
/// plan (offline) from steps like it.
pub fn step(job: &Job, grads: &[Gradient], ready: &[f64]) -> Step {
    assert_eq!(grads.len(), ready.len(), "a time per gradient");
    let resps: Vec<Response> = grads.iter().map(|g| response(g, job.on_gpu)).collect();
    let mut submitted = Vec::with_capacity(grads.len());
    let mut clock = 0.0f64;
    for r in ready {
        clock = clock.max(*r) + job.host.submit;
        submitted.push(clock);
    }
    let mut out = Step {
        submitted: submitted.last().copied().unwrap_or(0.0),
        ..Step::default()
    };
    // a batch's own work runs on its lane (batches take turns on the NCCL streams, so one's
    // set-up overlaps another's transfer); the transfers share the network, one at a time
    let mut lanes = vec![0.0f64; job.host.lanes.max(1)];
    let mut network_free = 0.0f64;
    // one vote's tensors (indices into the step's), its groups' sizes, when it is agreed
    let mut run = |members: &[usize], groups: &[usize], at: f64, out: &mut Step| {
        let refs: Vec<&Response> = members.iter().map(|i| &resps[*i]).collect();
        for b in job.plan_vote(&refs, groups) {
            let batch: Vec<&Response> = b.members.iter().map(|m| refs[*m]).collect();
            let (local, net, wire, algorithm) = job.batch(&batch, b.codec, b.route);
            let lane = (0..lanes.len())
                .min_by(|a, b| lanes[*a].total_cmp(&lanes[*b]))
                .expect("a lane");
            let start = lanes[lane].max(at);
            let sent = (start + local).max(network_free);
            let end = sent + net;
            (lanes[lane], network_free) = (end, end);
            out.batches += 1;
            out.trace.push((start, end, wire, algorithm));
        }
    };
    // what the library learns: its learners fed the tensor-by-tensor votes of the warm-up
    // steps (online rounds, whatever the mode) and one step more
    let how = match job.negotiation {
        Negotiation::Horovod => Negotiation::Horovod,
        _ => Negotiation::Online,
    };
    let singles = single_votes(job, how, &submitted);
    let steps = job.warmup + 2;
    let learned = job
        .learn((0..steps).flat_map(|_| singles.iter().map(|(_, range, _)| &resps[range.clone()])));
    let index: std::collections::HashMap<&str, usize> = (resps.iter().enumerate())
        .map(|(i, r)| (r.name.as_str(), i))
        .collect();
    let indices = |batches: &[Vec<String>]| -> Vec<Vec<usize>> {
        (batches.iter())
            .map(|g| g.iter().map(|n| index[n.as_str()]).collect())
            .collect()
    };
    let last = |g: &[usize]| g.iter().map(|i| submitted[*i]).fold(0.0, f64::max);
    match learned {
        // the frozen plan's batches, each started once its last tensor is submitted
        Some(Learned::Plan(plan)) => {
            for b in &indices(&plan) {
                run(b, &[b.len()], last(b), &mut out);
            }
        }
        // one bit per learned group: a round takes every group complete when it starts
        Some(Learned::Groups(groups)) => {
            let groups = indices(&groups);
            let (mut g, mut t) = (0, 0.0f64);
            while g < groups.len() {
                t = t.max(last(&groups[g]) + job.host.wake);
                let (mut members, mut sizes) = (Vec::new(), Vec::new());
                while g < groups.len() && last(&groups[g]) <= t {
                    members.extend_from_slice(&groups[g]);
                    sizes.push(groups[g].len());
                    g += 1;
                }
                let (cost, bytes) = job.round(Negotiation::Online, 0, groups.len(), sizes.len());
                t += cost;
                out.rounds += 1;
                out.control_bytes += bytes;
                run(&members, &sizes, t, &mut out);
            }
        }
        None => {
            for (at, range, bytes) in &singles {
                out.rounds += 1;
                out.control_bytes += bytes;
                run(&range.clone().collect::<Vec<_>>(), &[], *at, &mut out);
            }
        }
    }
    out.end = lanes.iter().copied().fold(out.submitted, f64::max);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compress::Compression;

    fn grads(sizes: &[i64]) -> Vec<Gradient> {
        (sizes.iter().enumerate())
            .map(|(i, n)| Gradient {
                name: format!("g{i}"),
                shape: vec![*n],
            })
            .collect()
    }

    fn job(nodes: usize, negotiation: Negotiation) -> Job {
        let link = Link {
            alpha: 10e-6,
            beta: 1e-9,
        };
        let host = Host {
            submit: 1e-6,
            lanes: 1,
            ..Host::default()
        };
        let fabric = Fabric {
            inside: link,
            nic: link,
        };
        Job {
            negotiation,
            threshold: 64 << 20,
            ..Job::new(Topology { nodes, per_node: 1 }, fabric, host, false)
        }
    }

    #[test]
    fn the_backward_pass_emits_its_gradients_by_their_share_of_its_time() {
        let g = grads(&[100, 300, 600]);
        let t = ready_times(&g, 1.0, 2.0, 0.1);
        // 0.3 s of floor split evenly, 1.7 s by values
        let want = [1.0 + 0.1 + 0.17, 1.0 + 0.2 + 0.68, 3.0];
        for (a, b) in t.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{t:?}");
        }
    }

    #[test]
    fn shape_sets_read_as_the_data_files_write_them() {
        let text = "# a comment\nconv.weight\t64x3x7x7\nbn.bias\t64\n\n";
        let g = shapes(text).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!((g[0].values(), g[1].shape.clone()), (64 * 3 * 49, vec![64]));
        assert!(shapes("x\t3xy").unwrap_err().contains("line 1"));
        assert!(shapes("x 3").unwrap_err().contains("no tab"));
    }

    #[test]
    fn gradients_ready_at_once_fuse_into_one_ring_whose_time_is_the_closed_form() {
        let g = grads(&[1000, 2000, 3000]);
        let mut j = job(4, Negotiation::Offline);
        // the warm-up's votes take all three at once: the frozen plan fuses them
        j.host.wake = 10e-6;
        let s = step(&j, &g, &[0.0; 3]);
        assert_eq!(s.batches, 1);
        let bytes = 6000.0 * 4.0;
        let want = 3e-6 + network::ring(4, bytes, j.fabric.nic);
        assert!((s.end - want).abs() < 1e-12, "{} vs {want}", s.end);
        assert_eq!(s.rounds, 0);
    }

    #[test]
    fn online_rounds_take_what_was_submitted_and_cost_a_vote_each() {
        let g = grads(&[1000, 1000, 1000]);
        let mut j = job(2, Negotiation::Online);
        // the loop wakes 5 us after a submission: the second and third gradients, 1 ms after
        // the first and submitted 1 us apart, share a round
        j.host.wake = 5e-6;
        let s = step(&j, &g, &[0.0, 1e-3, 1e-3]);
        assert_eq!((s.rounds, s.batches), (2, 2));
        // one 8-byte word each way per round at two ranks
        assert_eq!(s.control_bytes, 2.0 * 16.0);
        // those two are then one learned group, whose round waits for its last tensor
        let vote = network::halving_doubling(2, 8.0, j.fabric.nic);
        let second = 1e-3 + 2e-6 + 5e-6 + vote;
        let want = second + network::ring(2, 8000.0, j.fabric.nic);
        assert!((s.end - want).abs() < 1e-12, "{} vs {want}", s.end);
        // without the wait, a round each
        j.host.wake = 0.0;
        assert_eq!(step(&j, &g, &[0.0, 1e-3, 1e-3]).rounds, 3);
        // Horovod's protocol: the same batches, a coordinator round each
        let mut h = job(2, Negotiation::Horovod);
        h.host.wake = 5e-6;
        let h = step(&h, &g, &[0.0, 1e-3, 1e-3]);
        assert_eq!((h.rounds, h.batches), (2, 2));
        assert!(h.control_bytes > s.control_bytes);
    }

    #[test]
    fn settings_are_read_as_the_library_reads_them_and_routes_chosen_by_its_plan() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            Config::from_lookup(&move |k| {
                (pairs.iter())
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let j = job(2, Negotiation::Online);
        let at = |t: Topology, cfg: &Config| Job::from_config(t, j.fabric, j.host, false, cfg);
        let two = Topology {
            nodes: 2,
            per_node: 1,
        };
        let plain = at(two, &env(&[]));
        // one rank on each of two nodes: fused up to the threshold below 16 MiB, the ring
        // from 4 MiB
        assert_eq!(plain.direct_bytes, 16 << 20);
        assert_eq!(plain.ring_min_bytes, 4 << 20);
        // 1 MiB and 3 MiB: fused, the ring; as two groups, two native allreduces
        let g = grads(&[256 << 10, 768 << 10]);
        let resps: Vec<Response> = g.iter().map(|g| response(g, false)).collect();
        let small: Vec<&Response> = vec![&resps[0]];
        let all: Vec<&Response> = resps.iter().collect();
        assert_eq!(plain.route(&small, Codec::None), Route::Native);
        let fused = plain.plan_vote(&all, &[]);
        assert_eq!((fused.len(), fused[0].route), (1, Route::Ring));
        let apart = plain.plan_vote(&all, &[1]);
        assert_eq!(apart.len(), 2);
        assert!(apart.iter().all(|b| b.route == Route::Native));
        let ring = at(two, &env(&[("FERROVOD_RING_MIN_BYTES", "1000")]));
        assert_eq!(ring.route(&small, Codec::None), Route::Ring);
        // auto on one node opens no hierarchy; asked for, every batch goes hierarchical
        let one = Topology {
            nodes: 1,
            per_node: 4,
        };
        let auto = at(one, &env(&[("FERROVOD_ALGORITHM", "auto")]));
        assert_eq!(auto.policy, Policy::Flat);
        let two_by_two = Topology {
            nodes: 2,
            per_node: 2,
        };
        let hier = at(two_by_two, &env(&[("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")]));
        assert_eq!(hier.route(&small, Codec::None), Route::Hierarchical);
        let fp16 = at(two, &env(&[("FERROVOD_COMPRESSION", "fp16")]));
        assert_eq!(
            fp16.plan_vote(&all, &[])[0].codec,
            Codec::Half(DataType::F16)
        );
    }

    #[test]
    fn offline_plans_hold_host_tensors_and_gpu_steps_vote_by_groups_meanwhile() {
        // three gradients 1 ms apart: three warm-up votes, a plan of three batches on the host
        let g = grads(&[1000, 1000, 1000]);
        let ready = [0.0, 1e-3, 2e-3];
        let host = step(&job(2, Negotiation::Offline), &g, &ready);
        assert_eq!((host.rounds, host.batches), (0, 3));
        // GPU tensors: no plan; the votes carry one bit per learned bucket, as online
        let mut gpu = job(2, Negotiation::Offline);
        gpu.on_gpu = true;
        let resps: Vec<Response> = g.iter().map(|g| response(g, true)).collect();
        let votes: Vec<&[Response]> = (0..gpu.warmup + 2).flat_map(|_| resps.chunks(1)).collect();
        let names = vec![g.iter().map(|g| g.name.clone()).collect::<Vec<_>>()];
        assert_eq!(
            gpu.learn(votes.iter().copied()),
            Some(Learned::Groups(names))
        );
        let offline = step(&gpu, &g, &ready);
        gpu.negotiation = Negotiation::Online;
        let online = step(&gpu, &g, &ready);
        assert_eq!((offline.rounds, offline.batches), (1, 1));
        assert_eq!(offline, online);
        // too few steps to learn anything
        assert_eq!(gpu.learn(votes[..3].iter().copied()), None);
    }

    #[test]
    fn codecs_change_the_bytes_on_the_wire() {
        let g = grads(&[1 << 20]);
        let mut j = job(2, Negotiation::Offline);
        let plain = step(&j, &g, &[0.0]);
        j.codecs = Codecs {
            setting: Compression::Fp16,
            ..Codecs::default()
        };
        let half = step(&j, &g, &[0.0]);
        assert_eq!(plain.trace[0].2, 4 << 20);
        assert_eq!(half.trace[0].2, 2 << 20);
        assert!(half.end < plain.end);
    }

    #[test]
    fn a_second_lane_overlaps_a_batch_set_up_with_the_other_transfer() {
        // two tensors of 40 MiB under a 64 MiB threshold: two batches, each 10 ms of set-up
        // and about 42 ms of transfer
        let g = grads(&[10 << 20, 10 << 20]);
        let mut j = job(2, Negotiation::Offline);
        j.host.call = 10e-3;
        let one = step(&j, &g, &[0.0, 0.0]);
        j.host.lanes = 2;
        let two = step(&j, &g, &[0.0, 0.0]);
        assert_eq!((one.batches, two.batches), (2, 2));
        let net = network::ring(2, (40 << 20) as f64, j.fabric.nic);
        assert!((one.end - (2.0 * 10e-3 + 2.0 * net + 1e-6)).abs() < 1e-9);
        // the second set-up hides behind the first transfer; the transfers take turns
        assert!(
            (two.end - (10e-3 + 2.0 * net + 1e-6)).abs() < 1e-9,
            "{}",
            two.end
        );
    }
}
