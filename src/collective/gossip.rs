//! Gossip: each rank averages its tensor with one peer's, `(x_self + x_peer) / 2`, the peer
//! chosen by an agreed schedule from the tensor's round (how many times it has been gossiped
//! before). Every rank's peer is its peer's peer, so each exchange is one `sendrecv` and the
//! sum over ranks is kept. Every `sync_every`-th round is an exact average (an allreduce)
//! instead, so that the ranks' copies cannot drift apart for long.
//!
//! Compressed gossip (CHOCO-SGD's idea, over one peer per round): the two ranks of a pair keep
//! the same two public copies of a tensor, each rank's as the other has seen it (`Replicas`).
//! A rank sends the difference between its tensor and its public copy, compressed (16-bit or
//! 8-bit), and both ranks add the decoded difference to that copy. The average moves by half
//! the difference of the two public copies, so the sum over the pair is kept exactly and what
//! compression loses is sent again at the pair's next meeting rather than lost.

use std::sync::Mutex;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::collective::{ActivitySink, TensorIo};
use crate::compress::{Codec, quantize};
use crate::dtype::DataType;
use crate::elementwise;
use crate::error::{Error, Result};
use crate::fusion::FusionBuffer;
use crate::hashing::HashMap;
use crate::message::{ReduceOp, Response};
use crate::store::{self, Recent};
use crate::transport::Transport;

/// Rank `rank`'s peer among `size` in round `round` (itself: it sits the round out).
///
/// A power of two: the hypercube, `rank XOR 2^(round mod log2 size)`, after log2 size
/// consecutive rounds every rank holds the exact average. Otherwise a round-robin tournament
/// (the circle method): `size - 1` rounds (`size` when odd, one rank idle in each) in which
/// every pair meets once; the average is then reached geometrically, not exactly.
pub fn peer(rank: usize, size: usize, round: u64) -> usize {
    if size <= 1 {
        return rank;
    }
    if size.is_power_of_two() {
        let dims = size.trailing_zeros() as u64;
        return rank ^ (1 << (round % dims));
    }
    // players 0..m, m even; the last one is a bye when size is odd
    let m = size + size % 2;
    let turns = (m - 1) as u64;
    let r = (round % turns) as usize;
    let circle = m - 1;
    let partner = if rank == circle {
        r
    } else {
        let q = (2 * r + circle - rank % circle) % circle;
        if q == rank { circle } else { q }
    };
    if partner >= size { rank } else { partner }
}

/// Whether round `round` is an exact average (every `sync_every`-th; 0: never).
pub fn syncs(round: u64, sync_every: u32) -> bool {
    sync_every > 0 && (round + 1).is_multiple_of(sync_every as u64)
}

/// Each tensor's round, per name, within one process set: advanced as its batches run, which
/// is in the same order on every rank (a name is never in flight twice). Bounded as `store`
/// says; since batches run in the agreed order, every rank evicts the same names at the same
/// batch, and with a name's round go its public copies (`Replicas`). An unnamed tensor is
/// always at round 0.
#[derive(Default)]
pub struct Rounds(Mutex<Recent<String, u64>>);

impl Rounds {
    /// The rounds of a batch's tensors, each advanced by one; the names unused for the store's
    /// window leave `replicas` too.
    pub fn advance(&self, resps: &[&Response], replicas: &Replicas) -> Vec<u64> {
        let mut map = self.0.lock().expect("gossip rounds");
        let rounds = (resps.iter())
            .map(|r| match map.touch(&r.name) {
                Some(t) => {
                    *t += 1;
                    *t - 1
                }
                None if store::is_unnamed(&r.name) => 0,
                None => {
                    map.put(r.name.clone(), 1);
                    0
                }
            })
            .collect();
        let gone = map.sweep_keys();
        if !gone.is_empty() {
            let mut pairs = replicas.0.lock().expect("gossip replicas");
            pairs.retain(|(name, _), _| !gone.iter().any(|(g, _)| g == name));
        }
        rounds
    }

    /// Names with a round.
    pub fn len(&self) -> usize {
        self.0.lock().expect("gossip rounds").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a gossip batch runs: its tensors' rounds, the exact-average period, and how the values
/// travel (`Codec::None`, or compressed differences against `replicas`).
pub struct Schedule<'a> {
    pub rounds: Vec<u64>,
    pub sync_every: u32,
    pub codec: Codec,
    pub replicas: &'a Replicas,
}

/// The public copies of a pair's tensor: this rank's and the peer's, as both have seen them.
#[derive(Default)]
struct Pair {
    mine: Vec<f32>,
    theirs: Vec<f32>,
}

/// Compressed gossip's public copies, per tensor name and peer (zeros before the first
/// meeting, or after the tensor's size changed).
#[derive(Default)]
pub struct Replicas(Mutex<HashMap<(String, usize), Pair>>);

impl Replicas {
    /// Pairs held.
    pub fn len(&self) -> usize {
        self.0.lock().expect("gossip replicas").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Values per block of a compressed difference (an 8-bit block's scale covers this many).
const BLOCK: usize = 1024;

/// The bytes on the wire of `values` f32 differences.
fn diff_len(codec: Codec, values: usize) -> usize {
    match codec {
        Codec::Half(w) => values * w.size(),
        Codec::U8 => values.div_ceil(BLOCK) * quantize::HEADER + values,
        // gossip never travels as PowerSGD or top-k (`Codecs::of`)
        Codec::None | Codec::PowerSgd(_) | Codec::TopK(_) => values * 4,
    }
}

/// Encodes one block of differences `d` into `out` (`diff_len(d.len())` bytes), and writes
/// what the receiver will decode into `back`.
fn encode_block(codec: Codec, d: &[f32], out: &mut [u8], back: &mut [f32]) {
    fn narrow<H: Copy + Default>(
        d: &[f32],
        out: &mut [u8],
        back: &mut [f32],
        bytes: fn(H) -> [u8; 2],
    ) where
        [H]: HalfFloatSliceExt,
    {
        let mut h = [H::default(); BLOCK];
        let h = &mut h[..d.len()];
        h.convert_from_f32_slice(d);
        h.convert_to_f32_slice(back);
        for (o, v) in out.chunks_exact_mut(2).zip(h.iter()) {
            o.copy_from_slice(&bytes(*v));
        }
    }
    match codec {
        Codec::Half(DataType::BF16) => narrow::<bf16>(d, out, back, bf16::to_le_bytes),
        Codec::Half(_) => narrow::<f16>(d, out, back, f16::to_le_bytes),
        Codec::U8 => {
            // `back` first holds what rounding lost: the decoded value is what is left
            quantize::encode(d, out, back);
            back.iter_mut().zip(d).for_each(|(l, v)| *l = v - *l);
        }
        Codec::None | Codec::PowerSgd(_) | Codec::TopK(_) => {
            for ((v, o), b) in d.iter().zip(out.chunks_exact_mut(4)).zip(back) {
                o.copy_from_slice(&v.to_le_bytes());
                *b = *v;
            }
        }
    }
}

/// Decodes one block of differences from `src` into `out`.
fn decode_block(codec: Codec, src: &[u8], out: &mut [f32]) {
    fn widen<H: Copy + Default>(src: &[u8], out: &mut [f32], from: fn([u8; 2]) -> H)
    where
        [H]: HalfFloatSliceExt,
    {
        let mut h = [H::default(); BLOCK];
        let h = &mut h[..out.len()];
        for (v, s) in h.iter_mut().zip(src.chunks_exact(2)) {
            *v = from([s[0], s[1]]);
        }
        h.convert_to_f32_slice(out);
    }
    match codec {
        Codec::Half(DataType::BF16) => widen::<bf16>(src, out, bf16::from_le_bytes),
        Codec::Half(_) => widen::<f16>(src, out, f16::from_le_bytes),
        Codec::U8 => quantize::decode(src, out, false),
        Codec::None | Codec::PowerSgd(_) | Codec::TopK(_) => {
            (out.iter_mut().zip(src.chunks_exact(4)))
                .for_each(|(o, s)| *o = f32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        }
    }
}

/// The memory a gossip batch works in and its transfers: host memory over MPI (`HostMixing`),
/// GPU memory over NCCL (`collective::device`). Each call works on one round's members.
pub trait Mixing {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The members' exact average over every rank.
    fn average(&mut self, members: &[usize]) -> Result<()>;
    /// The members' own values (a round whose peer is this rank).
    fn keep(&mut self, members: &[usize]) -> Result<()>;
    /// The members averaged with `peer`'s, one message each way.
    fn exchange(&mut self, peer: usize, members: &[usize]) -> Result<()>;
}

/// Gossip of one batch, written once for every memory: tensors of one floating dtype, grouped
/// by round (in rising order, so every rank meets its peers in the same order); each group
/// travels as one message, to the round's peer or, on a sync round, to every rank.
pub fn mix<M: Mixing + ?Sized>(m: &mut M, schedule: &Schedule, dtype: DataType) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::Internal(format!("gossip of {}", dtype.name())));
    }
    for (round, members) in by_round(&schedule.rounds) {
        let peer = peer(m.rank(), m.size(), round);
        if syncs(round, schedule.sync_every) {
            m.average(&members)?;
        } else if peer == m.rank() {
            m.keep(&members)?;
        } else {
            m.exchange(peer, &members)?;
        }
    }
    Ok(())
}

/// Gossip of one batch of host tensors; under a codec (f32 only) the exchanges travel
/// compressed against the pair's public copies.
pub fn batch(
    t: &dyn Transport,
    schedule: &Schedule,
    resps: &[&Response],
    ios: &mut [&mut dyn TensorIo],
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let dtype = resps[0].dtype;
    if schedule.codec != Codec::None && dtype != DataType::F32 {
        return Err(Error::Internal(format!(
            "compressed gossip of {}",
            dtype.name()
        )));
    }
    let mut host = HostMixing {
        t,
        dtype,
        schedule,
        resps,
        ios,
        fusion,
        act,
    };
    mix(&mut host, schedule, dtype)
}

/// Host memory over a `Transport`.
struct HostMixing<'h, 'a> {
    t: &'h dyn Transport,
    dtype: DataType,
    schedule: &'h Schedule<'h>,
    resps: &'h [&'h Response],
    ios: &'h mut [&'a mut dyn TensorIo],
    fusion: &'h mut FusionBuffer,
    act: ActivitySink<'h>,
}

impl Mixing for HostMixing<'_, '_> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn average(&mut self, members: &[usize]) -> Result<()> {
        let (t, dtype, act) = (self.t, self.dtype, &mut *self.act);
        let fusion = &mut *self.fusion;
        let group = Group {
            ios: &mut *self.ios,
            members,
        };
        average(t, dtype, group, fusion, act)
    }

    fn keep(&mut self, members: &[usize]) -> Result<()> {
        for i in members {
            if let (Some(input), out) = self.ios[*i].split_io() {
                out.copy_from_slice(input);
            }
        }
        Ok(())
    }

    fn exchange(&mut self, peer: usize, members: &[usize]) -> Result<()> {
        let (t, dtype, act) = (self.t, self.dtype, &mut *self.act);
        let codec = self.schedule.codec;
        let replicas = self.schedule.replicas;
        let names: Vec<&str> = (members.iter())
            .map(|i| self.resps[*i].name.as_str())
            .collect();
        let fusion = &mut *self.fusion;
        let group = Group {
            ios: &mut *self.ios,
            members,
        };
        if codec == Codec::None {
            return exchange(t, dtype, peer, group, fusion, act);
        }
        let pairs = Exchange {
            codec,
            peer,
            replicas,
            names: &names,
        };
        exchange_compressed(t, &pairs, group, fusion, act)
    }
}

/// A batch's members grouped by round, rounds rising (the order every rank meets its peers in).
fn by_round(rounds: &[u64]) -> Vec<(u64, Vec<usize>)> {
    let mut distinct = rounds.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    (distinct.into_iter())
        .map(|round| {
            let members = (0..rounds.len()).filter(|i| rounds[*i] == round);
            (round, members.collect())
        })
        .collect()
}

/// The tensors of one round among a batch's.
struct Group<'g, 'a> {
    ios: &'g mut [&'a mut dyn TensorIo],
    members: &'g [usize],
}

impl Group<'_, '_> {
    fn input_bytes(&self) -> usize {
        self.members
            .iter()
            .map(|i| self.ios[*i].input().len())
            .sum()
    }

    /// Every member's input, in order, into consecutive places of `dst`.
    fn pack(&self, dst: &mut [u8]) {
        let mut at = 0;
        for i in self.members {
            let input = self.ios[*i].input();
            dst[at..at + input.len()].copy_from_slice(input);
            at += input.len();
        }
    }

    /// Every member's output from consecutive places of `src` through `decode(out, place)`.
    fn unpack(&mut self, mut decode: impl FnMut(&mut [u8], usize) -> Result<()>) -> Result<()> {
        let mut at = 0;
        for i in self.members {
            let (_, out) = self.ios[*i].split_io();
            decode(out, at)?;
            at += out.len();
        }
        Ok(())
    }
}

/// The exact average over all ranks.
fn average(
    t: &dyn Transport,
    dtype: DataType,
    mut group: Group,
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let buf = fusion.get(group.input_bytes());
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    group.pack(buf);
    act(Some("MPI_ALLREDUCE"));
    t.allreduce(None, buf, dtype, ReduceOp::Sum)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    let scale = 1.0 / t.size() as f64;
    group
        .unpack(|out, at| elementwise::copy_scaled(out, &buf[at..at + out.len()], dtype, scale))?;
    act(None);
    Ok(())
}

/// `(mine + peer's) / 2`, one message each way.
fn exchange(
    t: &dyn Transport,
    dtype: DataType,
    peer: usize,
    mut group: Group,
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let total = group.input_bytes();
    let (mine, theirs) = fusion.get(2 * total).split_at_mut(total);
    act(Some("MEMCPY_IN_FUSION_BUFFER"));
    group.pack(mine);
    // one message each way: over TCP, MPI moves data only inside its calls, so work between
    // pieces in flight stalls them (BENCHMARKS.md, 2026-11-26, gossip on 4 hosts × 1 rank)
    act(Some("GOSSIP_SENDRECV"));
    t.sendrecv(mine, peer, theirs, peer)?;
    act(Some("MEMCPY_OUT_FUSION_BUFFER"));
    group.unpack(|out, at| {
        let end = at + out.len();
        elementwise::mean_of_two(out, &mine[at..end], &theirs[at..end], dtype)
    })?;
    act(None);
    Ok(())
}

/// A compressed exchange with one peer.
struct Exchange<'a> {
    codec: Codec,
    peer: usize,
    replicas: &'a Replicas,
    /// The group's tensor names, in member order.
    names: &'a [&'a str],
}

/// `x + (theirs - mine) / 2` over the pair's public copies, after both advanced by the
/// compressed differences exchanged now. Block by block, so that each value is read and
/// written once per pass.
fn exchange_compressed(
    t: &dyn Transport,
    how: &Exchange,
    group: Group,
    fusion: &mut FusionBuffer,
    act: ActivitySink,
) -> Result<()> {
    let f32s = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let values: Vec<usize> = (group.members.iter())
        .map(|i| group.ios[*i].input().len() / 4)
        .collect();
    let lens: Vec<usize> = values.iter().map(|v| diff_len(how.codec, *v)).collect();
    let total: usize = lens.iter().sum();
    let (send, recv) = fusion.get(2 * total).split_at_mut(total);
    // taken out, and the lock let go: another channel's batch (other names) must not wait on
    // it while this one waits for its peer, whose other channel may wait on this rank's
    let mut pairs: Vec<Pair> = {
        let mut replicas = how.replicas.0.lock().expect("gossip replicas");
        (how.names.iter().zip(&values))
            .map(|(name, n)| {
                let p = replicas.remove(&(name.to_string(), how.peer));
                p.filter(|p| p.mine.len() == *n).unwrap_or_else(|| Pair {
                    mine: vec![0.0; *n],
                    theirs: vec![0.0; *n],
                })
            })
            .collect()
    };
    act(Some("GOSSIP_COMPRESS"));
    let (mut d, mut back) = ([0f32; BLOCK], [0f32; BLOCK]);
    let mut at = 0;
    for (i, pair) in group.members.iter().zip(&mut pairs) {
        let input = group.ios[*i].input();
        for (x, mine) in input.chunks(4 * BLOCK).zip(pair.mine.chunks_mut(BLOCK)) {
            let k = mine.len();
            for ((d, x), m) in d.iter_mut().zip(x.chunks_exact(4)).zip(mine.iter()) {
                *d = f32s(x) - m;
            }
            let n = diff_len(how.codec, k);
            encode_block(how.codec, &d[..k], &mut send[at..at + n], &mut back[..k]);
            mine.iter_mut().zip(&back).for_each(|(m, b)| *m += b);
            at += n;
        }
    }
    act(Some("GOSSIP_SENDRECV"));
    // on failure the pair's copies are dropped on this side (the job is ending)
    t.sendrecv(send, how.peer, recv, how.peer)?;
    act(Some("GOSSIP_DECOMPRESS"));
    let mut at = 0;
    for (i, pair) in group.members.iter().zip(&mut pairs) {
        let (input, out) = group.ios[*i].split_io();
        let blocks = pair.mine.chunks(BLOCK).zip(pair.theirs.chunks_mut(BLOCK));
        for (b, (mine, theirs)) in blocks.enumerate() {
            let k = mine.len();
            let n = diff_len(how.codec, k);
            decode_block(how.codec, &recv[at..at + n], &mut back[..k]);
            at += n;
            theirs.iter_mut().zip(&back).for_each(|(t, v)| *t += v);
            let place = 4 * BLOCK * b..4 * (BLOCK * b + k);
            if let Some(input) = input {
                out[place.clone()].copy_from_slice(&input[place.clone()]);
            }
            let parts = mine.iter().zip(theirs.iter());
            for (o, (m, t)) in out[place].chunks_exact_mut(4).zip(parts) {
                let v = f32s(o) + 0.5 * (t - m);
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    let mut replicas = how.replicas.0.lock().expect("gossip replicas");
    for (name, pair) in how.names.iter().zip(pairs) {
        // an unnamed tensor never meets its peer again
        if !store::is_unnamed(name) {
            replicas.insert((name.to_string(), how.peer), pair);
        }
    }
    act(None);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ranks_peer_is_its_peers_peer() {
        for size in 1..=13 {
            for round in 0..30 {
                for rank in 0..size {
                    let p = peer(rank, size, round);
                    assert!(p < size);
                    assert_eq!(peer(p, size, round), rank, "size {size} round {round}");
                }
            }
        }
    }

    #[test]
    fn the_hypercube_walks_each_dimension_in_turn() {
        let got: Vec<usize> = (0..6).map(|r| peer(5, 8, r)).collect();
        assert_eq!(got, vec![4, 7, 1, 4, 7, 1]);
        assert_eq!(peer(0, 2, 7), 1);
    }

    /// Pairwise averaging under the schedule, in f64, from distinct values.
    fn simulate(size: usize, rounds: u64) -> Vec<f64> {
        let mut x: Vec<f64> = (0..size).map(|r| (r * r) as f64).collect();
        for round in 0..rounds {
            let prev = x.clone();
            for (rank, v) in x.iter_mut().enumerate() {
                *v = (prev[rank] + prev[peer(rank, size, round)]) / 2.0;
            }
        }
        x
    }

    #[test]
    fn powers_of_two_reach_the_mean_in_log2_rounds() {
        for size in [2usize, 4, 8, 16] {
            let mean = (0..size).map(|r| (r * r) as f64).sum::<f64>() / size as f64;
            let x = simulate(size, size.trailing_zeros() as u64);
            assert!(x.iter().all(|v| (v - mean).abs() < 1e-12), "{size}: {x:?}");
        }
    }

    #[test]
    fn other_sizes_meet_everyone_and_converge() {
        for size in [3usize, 5, 6, 7] {
            let turns = (size + size % 2 - 1) as u64;
            // every pair meets within one tournament
            for a in 0..size {
                for b in 0..size {
                    if a != b {
                        assert!((0..turns).any(|r| peer(a, size, r) == b), "{size}: {a} {b}");
                    }
                }
            }
            let mean = (0..size).map(|r| (r * r) as f64).sum::<f64>() / size as f64;
            let spread = |x: &[f64]| x.iter().map(|v| (v - mean).abs()).fold(0.0, f64::max);
            let start = spread(&simulate(size, 0));
            let later = spread(&simulate(size, 10 * turns));
            assert!(later < start * 1e-3, "{size}: {start} -> {later}");
        }
    }

    #[test]
    fn sync_rounds_come_every_m() {
        let got: Vec<u64> = (0..25).filter(|r| syncs(*r, 10)).collect();
        assert_eq!(got, vec![9, 19]);
        assert!(!(0..100).any(|r| syncs(r, 0)));
    }
}
