//! Point-to-point transfers that the caller polls: each owns its bytes, so a transfer that is
//! given up on (its peer never came) cannot leave MPI reading or writing freed memory.

use std::ffi::{c_int, c_void};

use mpi::ffi;

use super::*;

/// A send or receive in flight (or finished), with the bytes it reads or fills.
pub struct Transfer {
    req: ffi::MPI_Request,
    buf: Vec<u8>,
    done: bool,
}

// SAFETY: the request and its buffer move together; the runtime tests a transfer from one
// thread at a time.
unsafe impl Send for Transfer {}

impl Transfer {
    /// Whether it has completed (as last tested).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The bytes sent or received; only once done.
    pub fn into_bytes(mut self) -> Vec<u8> {
        debug_assert!(
            self.done,
            "a transfer's bytes are taken only once it completed"
        );
        std::mem::take(&mut self.buf)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if !self.done {
            // MPI may still use the memory: leak it rather than free it under MPI.
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

impl MpiComm {
    /// The largest tag this communicator accepts (MPI guarantees at least 32767).
    pub fn tag_ub(&self) -> i32 {
        let mut value: *mut c_int = std::ptr::null_mut();
        let mut flag: c_int = 0;
        // SAFETY: MPI_TAG_UB is a predefined attribute of every communicator; MPI stores a
        // pointer to its int value in `value`.
        let rc = unsafe {
            ffi::MPI_Comm_get_attr(
                self.comm,
                ffi::MPI_TAG_UB as c_int,
                (&mut value as *mut *mut c_int).cast::<c_void>(),
                &mut flag,
            )
        };
        if rc != 0 || flag == 0 || value.is_null() {
            return 32767;
        }
        // SAFETY: MPI returned a pointer to the attribute's value, valid while MPI runs.
        unsafe { *value }
    }

    fn posted(&self, dir: Direction, mut buf: Vec<u8>, peer: usize, tag: i32) -> Result<Transfer> {
        if peer >= self.size || tag < 0 || buf.len() > MAX_COUNT {
            return Err(Error::InvalidArgument(format!(
                "point-to-point transfer of {} bytes with rank {peer} (tag {tag}) on a communicator of {} ranks",
                buf.len(),
                self.size
            )));
        }
        let p = ptr_mut(&mut buf);
        // The request holds the heap pointer; moving the Vec into the Transfer keeps it.
        let req = self.post(dir, p, buf.len(), peer, tag as usize)?;
        Ok(Transfer {
            req,
            buf,
            done: false,
        })
    }

    /// Posts a send of `data` to `peer`.
    pub fn post_send(&self, peer: usize, tag: i32, data: Vec<u8>) -> Result<Transfer> {
        self.posted(Direction::Send, data, peer, tag)
    }

    /// Posts a receive of exactly `len` bytes from `peer`.
    pub fn post_recv(&self, peer: usize, tag: i32, len: usize) -> Result<Transfer> {
        self.posted(Direction::Recv, vec![0u8; len], peer, tag)
    }

    /// The next message from `peer` (None: any rank) with `tag`, if one has arrived: its
    /// receive is posted into a buffer of its size (whatever the caller expected). Returns it
    /// with the rank it came from.
    pub fn take_arrived(&self, peer: Option<usize>, tag: i32) -> Result<Option<(Transfer, usize)>> {
        // SAFETY: a constant.
        let source = peer.map_or(unsafe { ffi::RSMPI_ANY_SOURCE }, |p| p as c_int);
        // SAFETY: placeholders for out-parameters.
        let mut msg = unsafe { std::mem::zeroed::<ffi::MPI_Message>() };
        // SAFETY: as above.
        let mut status = unsafe { std::mem::zeroed::<ffi::MPI_Status>() };
        let mut found: c_int = 0;
        // SAFETY: comm is valid; the out-parameters are writable.
        let rc =
            unsafe { ffi::MPI_Improbe(source, tag, self.comm, &mut found, &mut msg, &mut status) };
        check(rc, "MPI_Improbe")?;
        if found == 0 {
            return Ok(None);
        }
        let mut count: c_int = 0;
        // SAFETY: status was filled by the probe that found the message.
        check(
            unsafe { ffi::MPI_Get_count(&status, byte_type(), &mut count) },
            "MPI_Get_count",
        )?;
        let mut buf = vec![0u8; count.max(0) as usize];
        // SAFETY: placeholder for the request.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        // SAFETY: `msg` is the matched message; `buf` holds exactly its bytes and moves into
        // the Transfer with the request (the heap pointer stays valid).
        let rc =
            unsafe { ffi::MPI_Imrecv(ptr_mut(&mut buf), count, byte_type(), &mut msg, &mut req) };
        check(rc, "MPI_Imrecv")?;
        let from = status.MPI_SOURCE.max(0) as usize;
        Ok(Some((
            Transfer {
                req,
                buf,
                done: false,
            },
            from,
        )))
    }

    /// Tests a transfer; true once it completed.
    pub fn test(&self, t: &mut Transfer) -> Result<bool> {
        if t.done {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        // SAFETY: t.req is an active request of this process over t.buf.
        let rc = unsafe { ffi::MPI_Test(&mut t.req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        check(rc, "MPI_Test")?;
        t.done = flag != 0;
        Ok(t.done)
    }

    /// Cancels a small receive that is still posted (a shutdown with nothing coming to it),
    /// so that MPI no longer holds it. Only for receives whose message, if it has begun to
    /// arrive, arrives whole (eager: the acknowledgements).
    pub fn cancel_recv(&self, t: &mut Transfer) {
        if t.done {
            return;
        }
        // SAFETY: t.req is an active receive of this process; a cancelled receive completes
        // at once, and the wait returns whether cancelled or matched meanwhile.
        unsafe {
            ffi::MPI_Cancel(&mut t.req);
            ffi::MPI_Wait(&mut t.req, ffi::RSMPI_STATUS_IGNORE);
        }
        t.done = true;
    }
}
