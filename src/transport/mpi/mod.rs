//! The MPI backend: process-wide MPI setup and a `Transport` over one communicator. All MPI
//! calls of the runtime are made from its background thread.

use std::ffi::{c_int, c_void};
use std::time::Duration;

use mpi::ffi;

use crate::dtype::DataType;
use crate::elementwise::{reduce_bf16, reduce_f16};
use crate::error::{Error, Result, Stall};
use crate::message::ReduceOp;
use crate::transport::{Segment, Transport};

unsafe extern "C" {
    static FERROVOD_MPI_IN_PLACE: *mut c_void;
    static FERROVOD_MPI_BYTE: ffi::MPI_Datatype;
}

/// Largest element count passed to one MPI call; larger transfers are split.
pub use crate::message::MPI_MAX_COUNT as MAX_COUNT;

mod bounded;
mod collectives;
mod ops;
mod p2p;
mod setup;
mod watchdog;

use ops::*;
pub use p2p::Transfer;
pub use setup::*;
pub use watchdog::*;

/// Waits for every request (completed ones are null and return at once).
fn wait_all(reqs: &mut [ffi::MPI_Request]) -> Result<()> {
    // SAFETY: every request was posted by `post_all` (or is already null).
    check(
        unsafe {
            ffi::MPI_Waitall(
                reqs.len() as c_int,
                reqs.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        },
        "MPI_Waitall",
    )
}

fn in_place() -> *mut c_void {
    // SAFETY: a constant initialised at load time by the C shim.
    unsafe { FERROVOD_MPI_IN_PLACE }
}

fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: a constant initialised at load time by the C shim.
    unsafe { FERROVOD_MPI_BYTE }
}

fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING (256) bytes or more.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    Err(Error::Backend(format!(
        "{what} failed: {}",
        String::from_utf8_lossy(&buf)
    )))
}

/// Waits for `req` by polling with backoff (spin, then yield, then 100 us sleeps), so a rank
/// waiting for slower peers gives its core to the framework's threads instead of spinning
/// inside MPI. Returns false if `limit` passed first (the request is then still active);
/// `slow` is told how long it has waited, about once a second.
fn wait_polled(
    req: &mut ffi::MPI_Request,
    limit: Option<std::time::Duration>,
    slow: &mut dyn FnMut(std::time::Duration),
) -> Result<bool> {
    let start = std::time::Instant::now();
    let mut next_report = std::time::Duration::from_secs(1);
    loop {
        let mut done: c_int = 0;
        // SAFETY: req is an active request of this process.
        let rc = unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        check(rc, "MPI_Test")?;
        if done != 0 {
            return Ok(true);
        }
        let waited = start.elapsed();
        if limit.is_some_and(|l| waited >= l) {
            return Ok(false);
        }
        if waited >= next_report {
            slow(waited);
            next_report += std::time::Duration::from_secs(1);
        }
        if waited < std::time::Duration::from_micros(50) {
            std::hint::spin_loop();
        } else if waited < std::time::Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

/// A pointer for an MPI buffer argument. An empty slice's pointer is dangling (0x1), which is
/// Open MPI's MPI_IN_PLACE; give MPI a real address instead.
fn ptr(s: &[u8]) -> *const c_void {
    static EMPTY: u8 = 0;
    if s.is_empty() {
        std::ptr::addr_of!(EMPTY).cast()
    } else {
        s.as_ptr().cast()
    }
}

fn ptr_mut(s: &mut [u8]) -> *mut c_void {
    ptr(s) as *mut c_void
}

fn displacements(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |acc, c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect()
}

fn fits(counts: &[usize], limit: usize) -> bool {
    counts.iter().sum::<usize>() <= limit
}

fn ints(v: &[usize]) -> Vec<c_int> {
    v.iter().map(|x| *x as c_int).collect()
}

#[derive(Clone, Copy)]
enum Direction {
    Send,
    Recv,
}

/// One MPI communicator, owned (freed on drop).
pub struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    /// Largest count per MPI call (`MAX_COUNT`, lowered in tests to exercise the split paths).
    max_count: usize,
    /// Control communicators only: how long their collectives wait for the other ranks.
    bound: Option<Box<Bound>>,
}

/// The limit on a control communicator's waits, and what names the ranks that never came.
struct Bound {
    /// None: wait for ever (stall checks disabled on this rank).
    limit: Option<Duration>,
    warn: Duration,
    /// A private duplicate, used only to find out who is still there.
    probe: MpiComm,
    /// The global rank of each member.
    global: Vec<i32>,
    what: String,
}

// SAFETY: a communicator handle may be used from any thread; the runtime uses each from one
// thread at a time.
unsafe impl Send for MpiComm {}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if mpi_initialized() {
            // SAFETY: the communicator is ours and no operation on it is in flight.
            unsafe { ffi::MPI_Comm_free(&mut self.comm) };
        }
    }
}

impl MpiComm {
    fn wrap(comm: ffi::MPI_Comm) -> Result<MpiComm> {
        let mut rank: c_int = 0;
        let mut size: c_int = 0;
        // SAFETY: comm is a valid communicator; ERRORS_RETURN makes failures codes, not aborts.
        unsafe {
            check(ffi::MPI_Comm_rank(comm, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(comm, &mut size), "MPI_Comm_size")?;
            ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
        }
        Ok(MpiComm {
            comm,
            rank: rank as usize,
            size: size as usize,
            max_count: MAX_COUNT,
            bound: None,
        })
    }

    /// Splits transfers above `n` elements into several MPI calls (and uses the split paths for
    /// v-collectives above `n` bytes). Communicators derived from this one inherit it.
    pub fn with_max_count(mut self, n: usize) -> MpiComm {
        self.max_count = n.clamp(1, MAX_COUNT);
        self
    }

    fn inherit(&self, c: MpiComm) -> MpiComm {
        c.with_max_count(self.max_count)
    }

    fn dup_raw(comm: ffi::MPI_Comm) -> Result<MpiComm> {
        // SAFETY: zeroed is a valid placeholder for the out-parameter.
        let mut out = unsafe { std::mem::zeroed::<ffi::MPI_Comm>() };
        // SAFETY: comm is valid; collective over its members.
        check(unsafe { ffi::MPI_Comm_dup(comm, &mut out) }, "MPI_Comm_dup")?;
        MpiComm::wrap(out)
    }

    /// A private duplicate of MPI_COMM_WORLD.
    pub fn world() -> Result<MpiComm> {
        // SAFETY: constant.
        MpiComm::dup_raw(unsafe { ffi::RSMPI_COMM_WORLD })
    }

    /// A private duplicate of a communicator given by its Fortran handle (`MPI_Comm_c2f`,
    /// mpi4py's `comm.py2f()`).
    pub fn from_fortran(handle: i32) -> Result<MpiComm> {
        // SAFETY: f2c of an invalid handle yields MPI_COMM_NULL (checked) rather than UB in Open MPI.
        let comm = unsafe { ffi::MPI_Comm_f2c(handle) };
        // SAFETY: constant.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::InvalidArgument(format!(
                "MPI communicator handle {handle} is not valid"
            )));
        }
        MpiComm::dup_raw(comm)
    }

    pub fn dup(&self) -> Result<MpiComm> {
        MpiComm::dup_raw(self.comm).map(|c| self.inherit(c))
    }

    /// The sub-communicator of the given ranks (of this communicator), or None on ranks not in
    /// it. Collective over all of this communicator.
    pub fn subset(&self, ranks: &[i32]) -> Result<Option<MpiComm>> {
        // SAFETY: group handles are created and freed here; comm is valid.
        unsafe {
            let mut group = std::mem::zeroed::<ffi::MPI_Group>();
            check(ffi::MPI_Comm_group(self.comm, &mut group), "MPI_Comm_group")?;
            let mut sub = std::mem::zeroed::<ffi::MPI_Group>();
            let rc = ffi::MPI_Group_incl(group, ranks.len() as c_int, ranks.as_ptr(), &mut sub);
            ffi::MPI_Group_free(&mut group);
            check(rc, "MPI_Group_incl")?;
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            let rc = ffi::MPI_Comm_create(self.comm, sub, &mut out);
            ffi::MPI_Group_free(&mut sub);
            check(rc, "MPI_Comm_create")?;
            if out == ffi::RSMPI_COMM_NULL {
                return Ok(None);
            }
            MpiComm::wrap(out).map(|c| Some(self.inherit(c)))
        }
    }

    /// Ranks sharing a node (MPI_COMM_TYPE_SHARED), or blocks of `block` consecutive ranks
    /// when a node size is forced (to emulate several hosts on one machine).
    pub fn split_local(&self, block: Option<usize>) -> Result<MpiComm> {
        // SAFETY: comm is valid; collective over its members.
        unsafe {
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            let rc = match block {
                Some(b) => ffi::MPI_Comm_split(
                    self.comm,
                    (self.rank / b.max(1)) as c_int,
                    self.rank as c_int,
                    &mut out,
                ),
                None => ffi::MPI_Comm_split_type(
                    self.comm,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    self.rank as c_int,
                    ffi::RSMPI_INFO_NULL,
                    &mut out,
                ),
            };
            check(rc, "MPI_Comm_split_type")?;
            MpiComm::wrap(out).map(|c| self.inherit(c))
        }
    }

    /// Ranks with the same `color`, ordered by rank.
    pub fn split(&self, color: i32) -> Result<MpiComm> {
        // SAFETY: comm is valid; collective over its members.
        unsafe {
            let mut out = std::mem::zeroed::<ffi::MPI_Comm>();
            check(
                ffi::MPI_Comm_split(self.comm, color, self.rank as c_int, &mut out),
                "MPI_Comm_split",
            )?;
            MpiComm::wrap(out).map(|c| self.inherit(c))
        }
    }

    /// Posts a non-blocking send or receive of `len` bytes at `buf` to/from `peer`.
    /// The caller keeps the memory valid until the request completes.
    fn post(
        &self,
        dir: Direction,
        buf: *mut c_void,
        len: usize,
        peer: usize,
        tag: usize,
    ) -> Result<ffi::MPI_Request> {
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        let (n, peer, tag) = (len as c_int, peer as c_int, tag as c_int);
        // SAFETY: buf is valid for len bytes until the request completes (caller's contract).
        let rc = unsafe {
            match dir {
                Direction::Send => {
                    ffi::MPI_Isend(buf, n, byte_type(), peer, tag, self.comm, &mut req)
                }
                Direction::Recv => {
                    ffi::MPI_Irecv(buf, n, byte_type(), peer, tag, self.comm, &mut req)
                }
            }
        };
        check(rc, "MPI_Isend/MPI_Irecv")?;
        Ok(req)
    }

    /// Posts every transfer `(direction, buffer, bytes, peer, tag)` at once and waits for all of
    /// them. If posting fails part way, the requests already posted are cancelled and completed
    /// before returning, so none of them outlives the buffers.
    ///
    /// # Safety
    /// Each buffer must be valid for its length (writable for receives) until this returns, and
    /// no two receives may overlap.
    unsafe fn transfer_all(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.transfer_all_while(transfers, &mut || Ok(())) }
    }

    /// `transfer_all`, running `meanwhile` after the transfers are posted and before waiting
    /// for them (its MPI calls on other communicators progress them). The transfers complete
    /// even when `meanwhile` fails; its error is returned first.
    ///
    /// # Safety
    /// As `transfer_all`; `meanwhile` must not touch the buffers.
    unsafe fn transfer_all_while(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        let mut reqs = unsafe { self.post_all(transfers) }?;
        let local = meanwhile();
        local.and(wait_all(&mut reqs))
    }

    /// Posts every transfer of `transfers` (as `transfer_all`); if posting fails part way, the
    /// requests already posted are cancelled and completed before the error returns.
    ///
    /// # Safety
    /// As `transfer_all`: the buffers stay valid until the requests complete.
    unsafe fn post_all(
        &self,
        transfers: &[(Direction, *mut c_void, usize, usize, usize)],
    ) -> Result<Vec<ffi::MPI_Request>> {
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(transfers.len());
        for &(dir, buf, len, peer, tag) in transfers {
            match self.post(dir, buf, len, peer, tag) {
                Ok(req) => reqs.push(req),
                Err(e) => {
                    for req in reqs.iter_mut() {
                        // SAFETY: each request was posted above and is still active.
                        unsafe {
                            ffi::MPI_Cancel(req);
                            ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(reqs)
    }

    /// A sendrecv's two peers, checked against the communicator's ranks.
    fn peers_exist(&self, to: usize, from: usize) -> Result<()> {
        if to >= self.size || from >= self.size {
            return Err(Error::InvalidArgument(format!(
                "sendrecv with rank {to}/{from} on a communicator of {} ranks",
                self.size
            )));
        }
        Ok(())
    }

    /// The largest of every rank's `v`.
    fn max_u64(&self, v: u64) -> Result<u64> {
        let _blocked = blocked("MPI_Allreduce(MAX)");
        let mut out = v;
        // SAFETY: one u64 in place.
        check(
            unsafe {
                ffi::MPI_Allreduce(
                    in_place(),
                    (&mut out as *mut u64).cast(),
                    1,
                    ffi::RSMPI_UINT64_T,
                    ffi::RSMPI_MAX,
                    self.comm,
                )
            },
            "MPI_Allreduce(MAX)",
        )?;
        Ok(out)
    }

    /// Allgather of one i64 per rank: a control collective (bounded on control communicators,
    /// watched elsewhere).
    pub fn allgather_i64(&self, v: i64) -> Result<Vec<i64>> {
        let bufs = (v.to_le_bytes().to_vec(), vec![0u8; 8 * self.size]);
        // SAFETY: 8 bytes from every rank into the second buffer; both are owned by `control`
        // until the request completes.
        let (_, out) = self.control(
            "MPI_Iallgather",
            "a negotiation round",
            bufs,
            |(mine, out), req| unsafe {
                ffi::MPI_Iallgather(
                    ptr(mine),
                    8,
                    byte_type(),
                    ptr_mut(out),
                    8,
                    byte_type(),
                    self.comm,
                    req,
                )
            },
        )?;
        Ok(out
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    fn bcast_chunked(&self, data: &mut [u8], root: usize) -> Result<()> {
        let _blocked = blocked("MPI_Bcast");
        for chunk in data.chunks_mut(self.max_count) {
            // SAFETY: chunk is valid for chunk.len() bytes; collective over the communicator.
            check(
                unsafe {
                    ffi::MPI_Bcast(
                        ptr_mut(chunk),
                        chunk.len() as c_int,
                        byte_type(),
                        root as c_int,
                        self.comm,
                    )
                },
                "MPI_Bcast",
            )?;
        }
        Ok(())
    }
}
