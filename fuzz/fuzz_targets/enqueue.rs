//! `fv_enqueue`'s argument checking (and the handle queries) on arbitrary operations, before
//! init: every call must return a clear refusal (INVALID_ARGUMENT or NOT_INITIALIZED), never
//! panic (INTERNAL) and never touch memory it was not given. Pointers point into a real
//! buffer, or are NULL; the counts and shapes around them are arbitrary.
#![no_main]

use std::ffi::c_void;

use ferrovod::capi::{self, fv_op, fv_tensor};
use ferrovod::error::Status;
use libfuzzer_sys::fuzz_target;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.take())
    }
    fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.take())
    }
    fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.take())
    }
}

const ARENA: usize = 4096;

fn ok(s: Status) {
    assert!(
        matches!(s, Status::InvalidArgument | Status::NotInitialized),
        "unexpected status {s:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let mut arena = vec![0u8; ARENA];
    let base = arena.as_mut_ptr();
    let n = (b.u8() % 5) as usize;
    let mut names: Vec<Vec<u8>> = Vec::new();
    let mut shapes: Vec<Vec<i64>> = Vec::new();
    let mut splits: Vec<Vec<i32>> = Vec::new();
    let mut specs = Vec::new();
    for _ in 0..n {
        let len = (b.u8() % 12) as usize;
        let mut name: Vec<u8> = (0..len).map(|_| b.u8()).filter(|c| *c != 0).collect();
        name.push(0);
        names.push(name);
        let ndim = b.u8() % 5;
        shapes.push((0..ndim).map(|_| b.i64()).collect());
        let ns = b.u8() % 5;
        splits.push((0..ns).map(|_| b.i32()).collect());
        specs.push((
            b.u8(),
            b.i32(),
            b.i32(),
            b.u8(),
            (b.i32() as usize) % ARENA,
            b.u8(),
        ));
    }
    // SAFETY (of what the library may assume): every pointer below is NULL or inside `arena`,
    // `names`, `shapes` or `splits`, all alive until the end of this function.
    let at = |off: usize| unsafe { base.add(off) } as *mut c_void;
    let tensors: Vec<fv_tensor> = specs
        .iter()
        .enumerate()
        .map(
            |(i, (flags, dtype, ndim_claim, out_mode, off, split_flags))| fv_tensor {
                name: if flags & 1 == 0 {
                    names[i].as_ptr().cast()
                } else {
                    std::ptr::null()
                },
                dtype: *dtype % 16,
                ndim: if flags & 2 == 0 {
                    shapes[i].len() as i32
                } else {
                    *ndim_claim % 8
                },
                shape: if shapes[i].is_empty() {
                    std::ptr::null()
                } else {
                    shapes[i].as_ptr()
                },
                input: if flags & 4 == 0 {
                    at(*off)
                } else {
                    std::ptr::null()
                },
                output: match out_mode % 3 {
                    0 => std::ptr::null_mut(),
                    1 => at(*off),
                    _ => at((*off + (*out_mode as usize)) % ARENA),
                },
                splits: if split_flags & 1 == 0 || splits[i].is_empty() {
                    std::ptr::null()
                } else {
                    splits[i].as_ptr()
                },
                nsplits: if split_flags & 2 == 0 {
                    splits[i].len() as i32
                } else {
                    (*split_flags as i32 >> 2).min(splits[i].len() as i32)
                },
            },
        )
        .collect();
    // a claimed ndim larger than the shape array would read past it: keep the claim within it
    let tensors: Vec<fv_tensor> = tensors
        .into_iter()
        .enumerate()
        .map(|(i, mut t)| {
            if t.ndim > shapes[i].len() as i32 {
                t.ndim = shapes[i].len() as i32;
            }
            t
        })
        .collect();
    let claimed = b.u8() % 8;
    let op = fv_op {
        // 12: gossip (22), 13 and 14: send and receive (23, 24), ferrovod's own kinds
        kind: match b.i32() % 15 {
            12 => 22,
            13 => 23,
            14 => 24,
            k => k,
        },
        reduce_op: b.i32() % 8,
        prescale: b.f64(),
        postscale: b.f64(),
        root_rank: b.i32(),
        process_set: b.i32(),
        device: b.i32() % 3 - 1,
        tensors: if tensors.is_empty() {
            std::ptr::null()
        } else {
            tensors.as_ptr()
        },
        num_tensors: (claimed as i32).min(tensors.len() as i32) - i32::from(claimed == 7),
        done: None,
        done_user_data: std::ptr::null_mut(),
        alloc: None,
        alloc_user_data: std::ptr::null_mut(),
        stream: std::ptr::null_mut(),
        ready_event: std::ptr::null_mut(),
        // the known codes and some unknown ones
        compression: b.i32() % 8,
        multistep: b.i32() % 4,
        multistep_mode: b.i32() % 3,
        multistep_warmup: b.i32() % 3,
        tag: b.i32(),
        // any f64: NaN, infinite, negative and huge ones are refused
        timeout: b.f64(),
    };
    let mut h = 0u64;
    let out = if b.u8() & 1 == 0 {
        &mut h as *mut u64
    } else {
        std::ptr::null_mut()
    };
    // SAFETY: as above.
    ok(unsafe { capi::fv_enqueue(&op, out) });
    // handle queries with arbitrary arguments
    let hid = b.i64() as u64;
    ok(capi::fv_wait(hid, b.f64()));
    let mut dims = [0i64; 4];
    let mut nd = 0i32;
    ok(capi::fv_handle_shape(
        hid,
        b.i32(),
        dims.as_mut_ptr(),
        4,
        &mut nd,
    ));
    drop(arena);
});
