//! enqueue, wait and release on a live single-rank runtime (MPI started as a singleton, once
//! for the whole run), with arbitrary kinds, dtypes, reductions, scale factors (NaN, infinite,
//! huge), codecs, multistep settings, names (repeated, unnamed, empty) and timeouts (1e19
//! seconds, infinite, NaN): every call returns a status that is not INTERNAL, every accepted
//! operation completes (a wait of a minute never times out), and a released handle is gone.
//! Tensors stay inside their buffers: the C API cannot check that, and the fuzzer must not
//! make it read past them.
#![no_main]

use std::ffi::{CString, c_void};
use std::sync::Once;

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
    fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.take())
    }
}

/// Elements of each tensor at most, and bytes of each buffer (8-byte dtypes fit).
const MAX_ELEMS: usize = 16;
const BUF: usize = 8 * MAX_ELEMS * 2;

const KINDS: [i32; 6] = [0, 1, 2, 5, 7, 22];
const NAMES: [&str; 5] = ["a", "b", "allreduce.noname.1", "", "a.b"];

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let s = unsafe { capi::fv_init(std::ptr::null()) };
        assert_eq!(s, Status::Ok, "fv_init");
    });
}

fn not_internal(s: Status) -> Status {
    assert_ne!(s, Status::Internal, "a call ended in INTERNAL");
    s
}

/// A timeout from the input: some of them huge or not numbers.
fn timeout(b: &mut Bytes) -> f64 {
    match b.u8() % 6 {
        0 => 1e19,
        1 => f64::INFINITY,
        2 => f64::NAN,
        3 => 1e300,
        4 => 0.0,
        _ => b.f64(),
    }
}

fuzz_target!(|data: &[u8]| {
    init();
    let mut b = Bytes(data);
    let n = 1 + (b.u8() % 3) as usize;
    let elems = (b.u8() as usize) % (MAX_ELEMS + 1);
    let dtype = (b.u8() % 12) as i32;
    let mut inputs: Vec<Vec<u8>> = (0..n).map(|_| (0..BUF).map(|_| b.u8()).collect()).collect();
    let mut outputs: Vec<Vec<u8>> = vec![vec![0u8; BUF]; n];
    let names: Vec<CString> = (0..n)
        .map(|_| CString::new(NAMES[(b.u8() as usize) % NAMES.len()]).unwrap())
        .collect();
    let shape = [elems as i64];
    let splits = [elems as i32];
    let in_place = b.u8() & 1 == 1;
    let tensors: Vec<fv_tensor> = (0..n)
        .map(|i| fv_tensor {
            name: names[i].as_ptr(),
            dtype,
            ndim: 1,
            shape: shape.as_ptr(),
            input: inputs[i].as_mut_ptr() as *const c_void,
            // alltoall and allgather outputs may be allocated by the library (NULL)
            output: if in_place {
                inputs[i].as_mut_ptr().cast()
            } else {
                outputs[i].as_mut_ptr().cast()
            },
            splits: splits.as_ptr(),
            nsplits: i32::from(b.u8() & 1 == 1),
        })
        .collect();
    let op = fv_op {
        kind: KINDS[(b.u8() as usize) % KINDS.len()],
        reduce_op: b.i32() % 6,
        prescale: if b.u8() & 1 == 1 { b.f64() } else { 1.0 },
        postscale: if b.u8() & 1 == 1 { b.f64() } else { 1.0 },
        root_rank: b.i32() % 2,
        process_set: b.i32() % 2,
        device: -1,
        tensors: tensors.as_ptr(),
        num_tensors: n as i32,
        done: None,
        done_user_data: std::ptr::null_mut(),
        alloc: None,
        alloc_user_data: std::ptr::null_mut(),
        stream: std::ptr::null_mut(),
        ready_event: std::ptr::null_mut(),
        compression: b.i32() % 7,
        multistep: b.i32() % 4,
        multistep_mode: b.i32() % 3,
        multistep_warmup: b.i32() % 3,
        // (sends and receives are not among KINDS: with one rank a receive from any rank
        // would wait for ever)
        tag: 0,
        // with one rank an operation's own timeout cannot run out: any value but a bad one
        // completes
        timeout: if b.u8() & 1 == 1 { b.f64() } else { 0.0 },
    };
    let mut h = 0u64;
    // SAFETY (of what the library may read and write): every tensor lies inside its buffer,
    // alive until the operation is released below.
    let s = not_internal(unsafe { capi::fv_enqueue(&op, &mut h) });
    if s != Status::Ok {
        return;
    }
    let first = not_internal(capi::fv_wait(h, timeout(&mut b)));
    if first == Status::Timeout || first == Status::InvalidArgument {
        // too short a wait, or a NaN timeout: a minute is plenty for one rank
        let s = not_internal(capi::fv_wait(h, 60.0));
        assert_ne!(
            s,
            Status::Timeout,
            "an operation of one rank did not complete in a minute"
        );
    }
    let mut done = 0i32;
    assert_eq!(capi::fv_poll(h, &mut done), Status::Ok);
    assert_eq!(done, 1);
    assert_eq!(capi::fv_release(h), Status::Ok);
    assert_eq!(not_internal(capi::fv_release(h)), Status::InvalidArgument);
    drop((inputs, outputs));
});
