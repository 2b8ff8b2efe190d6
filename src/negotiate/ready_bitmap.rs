//! The per-cycle vote: one bit vector per rank, combined with a single bitwise-AND allreduce.
//! "Any rank" conditions are stored inverted so that AND computes OR for them; that lets one
//! collective carry status flags, common cache hits and the union of invalidated bits.

/// Layout: word bits `[0, flags)` status flags (inverted), then `n` hit bits, then `n` inverted
/// invalid bits. The "GPU tensors moved" flag is carried only by sets that have agreed on GPU
/// tensors (`flags`), so a host job's vote keeps its size.
const FLAG_SHUTDOWN: usize = 0;
const FLAG_UNCACHED: usize = 1;
const FLAG_GPU_MOVED: usize = 2;

/// Status flags in a vote that carries the GPU flag (`gpu`) or not.
const fn flags(gpu: bool) -> usize {
    2 + gpu as usize
}

/// How many groups a vote with no single tensors carries in one word, with or without the GPU
/// flag (each group takes a hit bit and an invalid bit).
pub(crate) const GROUPS_PER_WORD: usize = (64 - flags(true)) / 2;

/// One rank's vote before the AND.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Vote {
    pub shutdown: bool,
    /// This rank has requests that need a coordinator round.
    pub uncached: bool,
    /// Some GPU tensor waiting here is at other addresses than at its last submission: no
    /// batch agreed now may be replayed from a graph (`collective::replay`). None: the vote
    /// carries no GPU flag (the same on every rank).
    pub gpu_moved: Option<bool>,
    pub hits: Vec<usize>,
    pub invalid: Vec<usize>,
    /// Plan batches (groups) all of whose tensors are ready here: one bit per batch.
    pub group_hits: Vec<usize>,
    /// Groups this rank cannot vote for any more (a member changed or waited too long).
    pub group_invalid: Vec<usize>,
}

/// The vote's tally: what all ranks agreed after the AND.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    pub any_shutdown: bool,
    pub any_uncached: bool,
    pub any_gpu_moved: bool,
    /// Bits every rank voted for, ascending.
    pub common_hits: Vec<usize>,
    /// Bits any rank found invalid, ascending.
    pub invalid: Vec<usize>,
    /// Groups every rank voted for, ascending.
    pub common_group_hits: Vec<usize>,
    /// Groups any rank dissolved, ascending.
    pub group_invalid: Vec<usize>,
}

fn words_for(f: usize, num_bits: usize) -> usize {
    (f + 2 * num_bits).div_ceil(64)
}

fn set(words: &mut [u64], i: usize, v: bool) {
    if v {
        words[i / 64] |= 1 << (i % 64);
    } else {
        words[i / 64] &= !(1 << (i % 64));
    }
}

fn get(words: &[u64], i: usize) -> bool {
    words[i / 64] & (1 << (i % 64)) != 0
}

/// Encodes a vote for a cache with `num_bits` bits (identical on every rank).
pub fn encode(vote: &Vote, num_bits: usize) -> Vec<u64> {
    let f = flags(vote.gpu_moved.is_some());
    let mut w = vec![0u64; words_for(f, num_bits)];
    set(&mut w, FLAG_SHUTDOWN, !vote.shutdown);
    set(&mut w, FLAG_UNCACHED, !vote.uncached);
    if let Some(moved) = vote.gpu_moved {
        set(&mut w, FLAG_GPU_MOVED, !moved);
    }
    for i in 0..num_bits {
        set(&mut w, f + num_bits + i, true);
    }
    for &b in &vote.hits {
        set(&mut w, f + b, true);
    }
    for &b in &vote.invalid {
        set(&mut w, f + num_bits + b, false);
    }
    w
}

/// Decodes the AND of every rank's `encode` (`gpu`: the votes carried the GPU flag).
pub fn decode(words: &[u64], num_bits: usize, gpu: bool) -> Tally {
    let f = flags(gpu);
    Tally {
        any_shutdown: !get(words, FLAG_SHUTDOWN),
        any_uncached: !get(words, FLAG_UNCACHED),
        any_gpu_moved: gpu && !get(words, FLAG_GPU_MOVED),
        common_hits: (0..num_bits).filter(|b| get(words, f + b)).collect(),
        invalid: (0..num_bits)
            .filter(|b| !get(words, f + num_bits + b))
            .collect(),
        ..Tally::default()
    }
}

/// Horovod's form of the same vote, for the baseline mode: a hit vector for a bitwise-AND
/// allreduce and a vector of status flags and invalid bits (not inverted) for a bitwise-OR
/// allreduce.
pub fn encode_split(vote: &Vote, num_bits: usize) -> (Vec<u64>, Vec<u64>) {
    let f = flags(vote.gpu_moved.is_some());
    let mut hits = vec![0u64; num_bits.div_ceil(64).max(1)];
    for &b in &vote.hits {
        set(&mut hits, b, true);
    }
    let mut flag_words = vec![0u64; (f + num_bits).div_ceil(64)];
    set(&mut flag_words, FLAG_SHUTDOWN, vote.shutdown);
    set(&mut flag_words, FLAG_UNCACHED, vote.uncached);
    if let Some(moved) = vote.gpu_moved {
        set(&mut flag_words, FLAG_GPU_MOVED, moved);
    }
    for &b in &vote.invalid {
        set(&mut flag_words, f + b, true);
    }
    (hits, flag_words)
}

/// Decodes the AND of every rank's hit vector and the OR of their flag vectors.
pub fn decode_split(hits: &[u64], flag_words: &[u64], num_bits: usize, gpu: bool) -> Tally {
    let f = flags(gpu);
    Tally {
        any_shutdown: get(flag_words, FLAG_SHUTDOWN),
        any_uncached: get(flag_words, FLAG_UNCACHED),
        any_gpu_moved: gpu && get(flag_words, FLAG_GPU_MOVED),
        common_hits: (0..num_bits).filter(|b| get(hits, *b)).collect(),
        invalid: (0..num_bits).filter(|b| get(flag_words, f + b)).collect(),
        ..Tally::default()
    }
}

/// The online vote with groups: `encode`'s layout for `num_bits` single tensors, then one hit
/// bit and one inverted invalid bit per group (plan batch).
pub fn encode_grouped(vote: &Vote, num_bits: usize, groups: usize) -> Vec<u64> {
    let base = flags(vote.gpu_moved.is_some()) + 2 * num_bits;
    let mut w = encode(vote, num_bits);
    w.resize((base + 2 * groups).div_ceil(64), 0);
    for g in 0..groups {
        set(&mut w, base + groups + g, true);
    }
    for &g in &vote.group_hits {
        set(&mut w, base + g, true);
    }
    for &g in &vote.group_invalid {
        set(&mut w, base + groups + g, false);
    }
    w
}

/// Decodes the AND of every rank's `encode_grouped`.
pub fn decode_grouped(words: &[u64], num_bits: usize, groups: usize, gpu: bool) -> Tally {
    let base = flags(gpu) + 2 * num_bits;
    let mut a = decode(words, num_bits, gpu);
    a.common_group_hits = (0..groups).filter(|g| get(words, base + g)).collect();
    a.group_invalid = (0..groups)
        .filter(|g| !get(words, base + groups + g))
        .collect();
    a
}

/// The AND a bitwise-AND allreduce computes; used by tests and single-rank runs.
pub fn and_all(votes: &[Vec<u64>]) -> Vec<u64> {
    let mut out = votes[0].clone();
    for v in &votes[1..] {
        out.iter_mut().zip(v).for_each(|(o, x)| *o &= x);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn and_gives_common_hits_and_union_of_flags() {
        let n = 100;
        let a = Vote {
            shutdown: false,
            uncached: true,
            gpu_moved: Some(false),
            hits: vec![1, 5, 70, 99],
            invalid: vec![3],
            ..Vote::default()
        };
        let b = Vote {
            shutdown: false,
            uncached: false,
            gpu_moved: Some(true),
            hits: vec![5, 70, 98],
            invalid: vec![64],
            ..Vote::default()
        };
        let c = Vote {
            shutdown: true,
            uncached: false,
            gpu_moved: Some(false),
            hits: vec![0, 5, 70, 99],
            invalid: vec![],
            ..Vote::default()
        };
        let votes = [encode(&a, n), encode(&b, n), encode(&c, n)];
        let agreed = decode(&and_all(&votes), n, true);
        assert_eq!(
            agreed,
            Tally {
                any_shutdown: true,
                any_uncached: true,
                any_gpu_moved: true,
                common_hits: vec![5, 70],
                invalid: vec![3, 64],
                ..Tally::default()
            }
        );
    }

    #[test]
    fn split_vote_agrees_with_the_single_vote() {
        let n = 130;
        for gpu in [None, Some(false)] {
            let votes = [
                Vote {
                    shutdown: false,
                    uncached: true,
                    gpu_moved: gpu,
                    hits: vec![1, 5, 70, 129],
                    invalid: vec![3],
                    ..Vote::default()
                },
                Vote {
                    shutdown: false,
                    uncached: false,
                    gpu_moved: gpu.map(|_| true),
                    hits: vec![5, 70, 128, 129],
                    invalid: vec![64, 129],
                    ..Vote::default()
                },
                Vote {
                    gpu_moved: gpu,
                    ..Vote::default()
                },
            ];
            for k in 1..=votes.len() {
                let vs = &votes[..k];
                let words: Vec<_> = vs.iter().map(|v| encode(v, n)).collect();
                let single = decode(&and_all(&words), n, gpu.is_some());
                assert_eq!(single.any_gpu_moved, gpu.is_some() && k > 1);
                let (mut hits, mut flags) = encode_split(&vs[0], n);
                for v in &vs[1..] {
                    let (h, f) = encode_split(v, n);
                    hits.iter_mut().zip(h).for_each(|(o, x)| *o &= x);
                    flags.iter_mut().zip(f).for_each(|(o, x)| *o |= x);
                }
                let split = decode_split(&hits, &flags, n, gpu.is_some());
                assert_eq!(split, single, "{k} ranks");
            }
        }
    }

    #[test]
    fn groups_vote_one_bit_each() {
        let (n, g) = (70, 5);
        let a = Vote {
            hits: vec![1, 69],
            group_hits: vec![0, 2, 4],
            group_invalid: vec![],
            ..Vote::default()
        };
        let b = Vote {
            hits: vec![1],
            group_hits: vec![0, 4],
            group_invalid: vec![3],
            ..Vote::default()
        };
        let agreed = decode_grouped(
            &and_all(&[encode_grouped(&a, n, g), encode_grouped(&b, n, g)]),
            n,
            g,
            false,
        );
        assert_eq!(agreed.common_hits, [1]);
        assert_eq!(agreed.common_group_hits, [0, 4]);
        assert_eq!(agreed.group_invalid, [3]);
        // without groups the layout is the plain vote's
        let plain = Vote {
            hits: vec![1, 69],
            ..Vote::default()
        };
        assert_eq!(encode_grouped(&plain, n, 0), encode(&plain, n));
        // 200 tensors in 10 batches: 2 + 2*10 bits instead of 2 + 2*200
        assert_eq!(encode_grouped(&Vote::default(), 0, 10).len(), 1);
        // the GPU flag takes a bit only in sets that carry it
        assert_eq!(encode_grouped(&Vote::default(), 0, 31).len(), 1);
        let gpu = Vote {
            gpu_moved: Some(false),
            ..Vote::default()
        };
        assert_eq!(encode_grouped(&gpu, 0, 31).len(), 2);
    }

    #[test]
    fn idle_vote_agrees_on_nothing() {
        for n in [0, 1, 31, 64, 1024] {
            let v = encode(&Vote::default(), n);
            assert_eq!(
                decode(&and_all(&[v.clone(), v]), n, false),
                Tally::default()
            );
        }
    }
}
