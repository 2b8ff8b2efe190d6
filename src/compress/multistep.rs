//! Multistep: an allreduce that communicates on some calls of a tensor only (`Multistep`).
//! Between communications each tensor's inputs are summed here, per process set and name, in
//! f32 for 32- and 16-bit floats (f64 and integers in their own type); the communicating call
//! sends that sum, cast back to the tensor's dtype. Which calls communicate is a pure function
//! of a tensor's call count, which every rank's script advances alike; the negotiation of the
//! communicating call checks that the ranks agree on the schedule.

use std::sync::Mutex;

use crate::dtype::DataType;
use crate::elementwise;
use crate::error::{Error, Result};
use crate::hashing::HashMap;
use crate::message::{Multistep, ReduceOp};
use crate::store;

/// Tensor names of one process set that may be partway through their schedules at once.
pub const MAX_NAMES: usize = 1 << 16;

/// The type a tensor's inputs are summed in between communications.
fn sum_dtype(dtype: DataType) -> DataType {
    match dtype {
        DataType::F16 | DataType::BF16 => DataType::F32,
        other => other,
    }
}

/// `bytes` of `dtype` as `sum_dtype(dtype)`.
fn widen(bytes: &[u8], dtype: DataType) -> Result<Vec<u8>> {
    match dtype {
        DataType::F16 | DataType::BF16 => {
            let mut wide = vec![0u8; bytes.len() * 2];
            elementwise::decode_half(&mut wide, bytes, dtype, 1.0)?;
            Ok(wide)
        }
        _ => Ok(bytes.to_vec()),
    }
}

#[derive(Default)]
struct Slot {
    /// Calls so far.
    calls: u64,
    /// The inputs since the last communication, summed (empty: none yet).
    sum: Vec<u8>,
}

/// What one call of a multistep allreduce does.
#[derive(Debug, PartialEq)]
pub enum Call {
    /// Nothing travels: the input was summed (or, for `latest`, dropped).
    Skip,
    /// The input itself travels.
    Input,
    /// This sum of the calls' inputs travels, in the tensor's dtype.
    Sum(Vec<u8>),
}

/// Per process set and tensor name: its call count and the inputs summed since its last
/// communication. Keyed set first, so a steady step looks names up without allocating them.
#[derive(Default)]
pub struct Steps(Mutex<HashMap<i32, HashMap<String, Slot>>>);

impl Steps {
    /// Names partway through their schedules, over every set.
    pub fn len(&self) -> usize {
        let sets = self.0.lock().expect("multistep");
        sets.values().map(|m| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Steps {
    /// Records one call of an operation's tensors (`(name, dtype, input)`, in set `set`) and
    /// says, per tensor, what travels. The tensors of one operation communicate together: if
    /// their call counts differ (a name also used alone), nothing is recorded and the call
    /// fails.
    pub fn call<'a>(
        &self,
        set: i32,
        m: Multistep,
        tensors: impl Iterator<Item = (&'a str, DataType, &'a [u8])> + Clone,
    ) -> Result<Vec<Call>> {
        if let Some((name, _, _)) = tensors.clone().find(|(n, _, _)| store::is_unnamed(n)) {
            return Err(Error::InvalidArgument(format!(
                "multistep: tensor '{name}' is unnamed, and an unnamed operation's name never repeats, so its calls could never be summed; name the tensor, or communicate on every call (multistep 1)"
            )));
        }
        let mut sets = self.0.lock().expect("multistep");
        let map = sets.entry(set).or_default();
        let new_names = tensors.clone().filter(|(n, _, _)| !map.contains_key(*n));
        if map.len() + new_names.count() > MAX_NAMES {
            return Err(Error::InvalidArgument(format!(
                "multistep: more than {MAX_NAMES} tensor names of process set {set} are partway through their schedules; a name's state is dropped once it has communicated (without a warm-up), so this many names in flight at once means names that never repeat"
            )));
        }
        let count = |name: &str| map.get(name).map_or(0, |s| s.calls);
        let mut names = tensors.clone().map(|(n, _, _)| n);
        let first = names.next().map_or(0, count);
        if let Some(other) = names.find(|n| count(n) != first) {
            return Err(Error::InvalidArgument(format!(
                "multistep: tensor '{other}' has been called {} times but the other tensors of its operation {first} times; the tensors of one operation must always be called together",
                count(other)
            )));
        }
        let communicates = m.communicates(first);
        let mut calls = Vec::new();
        for (name, dtype, input) in tensors.clone() {
            if !map.contains_key(name) {
                map.insert(name.to_owned(), Slot::default());
            }
            let slot = map.get_mut(name).expect("inserted");
            slot.calls += 1;
            if !m.accumulate {
                calls.push(if communicates {
                    Call::Input
                } else {
                    Call::Skip
                });
                continue;
            }
            if communicates && slot.sum.is_empty() {
                calls.push(Call::Input);
                continue;
            }
            let wide_len = input.len() / dtype.size() * sum_dtype(dtype).size();
            if slot.sum.is_empty() {
                slot.sum = widen(input, dtype)?;
            } else if slot.sum.len() == wide_len {
                // only 16-bit inputs need a widened copy; the others add in place
                match dtype {
                    DataType::F16 | DataType::BF16 => elementwise::reduce_into(
                        &mut slot.sum,
                        &widen(input, dtype)?,
                        DataType::F32,
                        ReduceOp::Sum,
                    )?,
                    _ => elementwise::reduce_into(&mut slot.sum, input, dtype, ReduceOp::Sum)?,
                }
            } else {
                slot.sum.clear();
                return Err(Error::InvalidArgument(format!(
                    "multistep: tensor '{name}' changed size between the calls summed for one communication"
                )));
            }
            if !communicates {
                calls.push(Call::Skip);
                continue;
            }
            let sum = std::mem::take(&mut slot.sum);
            calls.push(Call::Sum(match dtype {
                DataType::F16 | DataType::BF16 => {
                    let mut narrow = vec![0u8; sum.len() / 2];
                    elementwise::encode_half(&mut narrow, &sum, dtype, 1.0)?;
                    narrow
                }
                _ => sum,
            }));
        }
        if communicates && m.warmup == 0 {
            // back where a tensor never seen starts: nothing summed, the schedule at its
            // beginning; dropping the state changes nothing on any rank
            for (name, _, _) in tensors {
                if map.get(name).is_some_and(|s| s.sum.is_empty()) {
                    map.remove(name);
                }
            }
        }
        Ok(calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every(k: u32, warmup: u32, accumulate: bool) -> Multistep {
        Multistep {
            every: k,
            warmup,
            accumulate,
        }
    }

    #[test]
    fn the_kth_call_communicates_after_the_warmup() {
        let got: Vec<u64> = (0..12)
            .filter(|c| every(4, 0, true).communicates(*c))
            .collect();
        assert_eq!(got, vec![3, 7, 11]);
        let got: Vec<u64> = (0..12)
            .filter(|c| every(4, 2, false).communicates(*c))
            .collect();
        assert_eq!(got, vec![0, 1, 5, 9]);
        assert!((0..5).all(|c| Multistep::EVERY_CALL.communicates(c)));
        assert!((0..5).all(|c| every(0, 0, true).communicates(c)));
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn accumulated_calls_send_their_sum_in_call_order() {
        let steps = Steps::default();
        let m = every(3, 0, true);
        let xs = [[0.1f32, -2.0], [0.2, 3.5], [0.3, 1e-8]];
        let mut out = Vec::new();
        for x in &xs {
            let b = f32s(x);
            out.push(
                steps
                    .call(0, m, [("g", DataType::F32, &b[..])].into_iter())
                    .unwrap(),
            );
        }
        assert_eq!(out[0], vec![Call::Skip]);
        assert_eq!(out[1], vec![Call::Skip]);
        let want = f32s(&[(0.1f32 + 0.2) + 0.3, (-2.0f32 + 3.5) + 1e-8]);
        assert_eq!(out[2], vec![Call::Sum(want)]);
        // the next period starts from nothing
        let b = f32s(&[5.0, 6.0]);
        let next = steps.call(0, m, [("g", DataType::F32, &b[..])].into_iter());
        assert_eq!(next.unwrap(), vec![Call::Skip]);
    }

    /// A name's state goes once it has communicated (no warm-up: a fresh name behaves the
    /// same), so many names leave nothing behind; with a warm-up it must stay.
    #[test]
    fn state_goes_once_a_name_is_back_at_its_start() {
        let steps = Steps::default();
        let b = f32s(&[1.0]);
        for k in 0..1000 {
            let name = format!("g{k}");
            for _ in 0..3 {
                let t = [(name.as_str(), DataType::F32, &b[..])];
                steps.call(0, every(3, 0, true), t.into_iter()).unwrap();
            }
        }
        assert_eq!(steps.len(), 0);
        let t = [("w", DataType::F32, &b[..])];
        for _ in 0..3 {
            steps.call(0, every(3, 1, true), t.into_iter()).unwrap();
        }
        assert_eq!(steps.len(), 1);
        // after the state went, the schedule goes on as if it had stayed
        let t = [("g0", DataType::F32, &b[..])];
        let m = every(3, 0, true);
        let calls: Vec<_> = (0..3)
            .map(|_| steps.call(0, m, t.into_iter()).unwrap())
            .collect();
        assert_eq!(calls[0], vec![Call::Skip]);
        assert_eq!(calls[2], vec![Call::Sum(f32s(&[3.0]))]);
    }

    #[test]
    fn unnamed_tensors_are_refused() {
        let steps = Steps::default();
        let b = f32s(&[1.0]);
        let t = [("allreduce.noname.3", DataType::F32, &b[..])];
        let e = steps.call(0, every(2, 0, true), t.into_iter()).unwrap_err();
        assert!(e.to_string().contains("unnamed"), "{e}");
        assert_eq!(steps.len(), 0);
    }

    #[test]
    fn half_tensors_are_summed_in_f32() {
        use half::f16;
        let steps = Steps::default();
        let m = every(2, 0, true);
        // 2048 + 1 + 1: in f16 each +1 rounds away; in f32 the sum is 2050, exact in f16
        let h = |v: f32| f16::from_f32(v).to_le_bytes().to_vec();
        let a = [h(2048.0), h(1.0)].concat();
        let b = [h(1.0), h(1.0)].concat();
        steps
            .call(0, m, [("h", DataType::F16, &a[..])].into_iter())
            .unwrap();
        let got = steps
            .call(0, m, [("h", DataType::F16, &b[..])].into_iter())
            .unwrap();
        assert_eq!(got, vec![Call::Sum([h(2049.0), h(2.0)].concat())]);
        let a = [h(2048.0), h(1.0), h(1.0)].concat();
        let steps = Steps::default();
        let m = every(3, 0, true);
        let one = h(1.0);
        // a tensor that changes size within a period is an error, not a sum of mismatched parts
        steps
            .call(1, m, [("h", DataType::F16, &a[..4])].into_iter())
            .unwrap();
        steps
            .call(1, m, [("h", DataType::F16, &one[..])].into_iter())
            .unwrap_err();
    }

    #[test]
    fn latest_sends_only_the_communicating_call_and_names_are_per_set() {
        let steps = Steps::default();
        let m = every(2, 1, false);
        let b = f32s(&[1.0]);
        let t = || [("w", DataType::F32, &b[..])].into_iter();
        assert_eq!(steps.call(0, m, t()).unwrap(), vec![Call::Input]); // warm-up
        assert_eq!(steps.call(0, m, t()).unwrap(), vec![Call::Skip]);
        assert_eq!(steps.call(0, m, t()).unwrap(), vec![Call::Input]);
        // another set's tensor of that name counts on its own
        assert_eq!(steps.call(1, m, t()).unwrap(), vec![Call::Input]);
        // warm-up calls of an accumulating tensor send the input itself
        let acc = every(2, 1, true);
        assert_eq!(steps.call(2, acc, t()).unwrap(), vec![Call::Input]);
    }

    #[test]
    fn an_operations_tensors_must_be_at_the_same_call() {
        let steps = Steps::default();
        let m = every(2, 0, true);
        let b = f32s(&[1.0]);
        steps
            .call(0, m, [("a", DataType::F32, &b[..])].into_iter())
            .unwrap();
        let both = [("a", DataType::F32, &b[..]), ("b", DataType::F32, &b[..])];
        let e = steps.call(0, m, both.into_iter()).unwrap_err();
        assert!(e.to_string().contains("'b' has been called 0 times"), "{e}");
        // nothing was recorded by the failed call
        assert_eq!(
            steps
                .call(0, m, [("a", DataType::F32, &b[..])].into_iter())
                .unwrap(),
            vec![Call::Sum(f32s(&[2.0]))]
        );
    }
}
