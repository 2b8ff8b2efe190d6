//! A codec's local arithmetic spread over a few threads of this rank: a batch's tensors cut
//! into consecutive runs of about equal work, one run per thread. Each tensor is computed by
//! one thread with the code a single thread runs, so the results are the same bits for any
//! number of threads, and the number is a local choice (no rank needs to agree on it).

use std::ops::Range;

/// Below this many values in all, a batch's phase runs on the calling thread alone: starting
/// threads would cost more than they save.
const MIN_PARALLEL_VALUES: usize = 1 << 18;

/// Consecutive runs of `weights` (at most `threads`, none empty), each about an equal share of
/// the total: a run ends once it holds its share, so no run but the last holds more than its
/// share plus one item.
pub fn runs(weights: &[usize], threads: usize) -> Vec<Range<usize>> {
    let total: usize = weights.iter().sum();
    let threads = threads.clamp(1, weights.len().max(1));
    let mut out = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0usize);
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        // the k-th cut comes once the runs so far hold k shares of the total
        let k = out.len() + 1;
        if k < threads && acc * threads >= total * k {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < weights.len() {
        out.push(start..weights.len());
    }
    out
}

/// Runs `f` on every item, on up to `threads` threads (the calling thread among them): the
/// items cut into `runs` of about equal `weight` each (values, say). Small batches run on the
/// calling thread alone.
pub fn for_each<T: Send>(
    items: &mut [T],
    threads: usize,
    weight: impl Fn(&T) -> usize,
    f: impl Fn(&mut T) + Sync,
) {
    let weights: Vec<usize> = items.iter().map(&weight).collect();
    if threads <= 1 || weights.iter().sum::<usize>() < MIN_PARALLEL_VALUES {
        items.iter_mut().for_each(f);
        return;
    }
    let cuts = runs(&weights, threads);
    let f = &f;
    std::thread::scope(|scope| {
        let mut rest = items;
        let mut parts = Vec::with_capacity(cuts.len());
        for r in &cuts {
            let (part, tail) = rest.split_at_mut(r.len());
            parts.push(part);
            rest = tail;
        }
        let mut parts = parts.into_iter();
        let mine = parts.next();
        for part in parts {
            scope.spawn(move || part.iter_mut().for_each(f));
        }
        if let Some(part) = mine {
            part.iter_mut().for_each(f);
        }
    });
}

/// How many threads a codec's arithmetic takes when the setting leaves it to ferrovod (0):
/// the cores this process may run on shared among the ranks of its node, at most 8 (past a few
/// threads the passes over the tensors are bound by memory, not by the cores).
pub fn auto_threads(cores: usize, ranks_here: usize) -> usize {
    (cores / ranks_here.max(1)).clamp(1, 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_every_item_once_in_order() {
        for weights in [
            vec![5usize, 1, 1, 1, 8, 2, 2, 3],
            vec![1; 10],
            vec![100, 1, 1],
            vec![0, 0, 7],
        ] {
            for threads in 1..=12 {
                let rs = runs(&weights, threads);
                assert!(
                    rs.len() <= threads.min(weights.len()),
                    "{weights:?} {threads}"
                );
                let mut next = 0;
                for r in &rs {
                    assert_eq!(r.start, next);
                    assert!(r.end > r.start, "no empty run: {rs:?}");
                    next = r.end;
                }
                assert_eq!(next, weights.len());
            }
        }
        assert!(runs(&[], 4).is_empty());
    }

    #[test]
    fn runs_hold_about_equal_shares() {
        let weights = vec![1usize; 100];
        let rs = runs(&weights, 4);
        assert_eq!(rs, vec![0..25, 25..50, 50..75, 75..100]);
        // a heavy item ends its run at once
        assert_eq!(
            runs(&[10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2),
            vec![0..1, 1..11]
        );
    }

    #[test]
    fn for_each_gives_the_single_threads_results() {
        let make = || -> Vec<Vec<f32>> {
            (0..40)
                .map(|i| (0..(1000 + 997 * i)).map(|j| (j * 7 + i) as f32).collect())
                .collect()
        };
        let work = |v: &mut Vec<f32>| {
            let s: f32 = v.iter().sum();
            v.iter_mut().for_each(|x| *x = (*x * 0.5 + s).sqrt());
        };
        let mut one = make();
        for_each(&mut one, 1, Vec::len, work);
        for threads in [2, 3, 8] {
            let mut many = make();
            for_each(&mut many, threads, Vec::len, work);
            assert!(one == many, "{threads} threads");
        }
    }

    #[test]
    fn auto_threads_shares_the_cores() {
        assert_eq!(auto_threads(16, 1), 8);
        assert_eq!(auto_threads(16, 4), 4);
        assert_eq!(auto_threads(2, 2), 1);
        assert_eq!(auto_threads(1, 8), 1);
        assert_eq!(auto_threads(4, 0), 4);
    }
}
