//! `Transport` over one MPI communicator: the collectives the algorithms run.

use std::ffi::{c_int, c_void};

use mpi::ffi;

use super::*;

impl Transport for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn allreduce(
        &self,
        send: Option<&[u8]>,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Allreduce");
        let esz = dtype.size();
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        let step = self.max_count * esz;
        for (i, chunk) in data.chunks_mut(step).enumerate() {
            let src = match send {
                Some(s) => ptr(&s[i * step..i * step + chunk.len()]),
                None => in_place() as *const c_void,
            };
            // SAFETY: src (or MPI_IN_PLACE) and chunk cover chunk.len()/esz elements of `ty`.
            check(
                unsafe {
                    ffi::MPI_Allreduce(
                        src,
                        ptr_mut(chunk),
                        (chunk.len() / esz) as c_int,
                        ty,
                        mop,
                        self.comm,
                    )
                },
                "MPI_Allreduce",
            )?;
        }
        Ok(())
    }

    fn and_words(&self, words: &mut [u64]) -> Result<()> {
        // SAFETY: reading a constant initialised by rsmpi's shim.
        self.bitwise_words(words, unsafe { ffi::RSMPI_BAND }, "MPI_Iallreduce(BAND)")
    }

    fn or_words(&self, words: &mut [u64]) -> Result<()> {
        // SAFETY: reading a constant initialised by rsmpi's shim.
        self.bitwise_words(words, unsafe { ffi::RSMPI_BOR }, "MPI_Iallreduce(BOR)")
    }

    fn allreduce_owned_within(
        &self,
        mut data: Vec<u8>,
        dtype: DataType,
        op: ReduceOp,
        limit: Option<std::time::Duration>,
        slow: &mut dyn FnMut(std::time::Duration),
    ) -> Result<Option<Vec<u8>>> {
        let esz = dtype.size();
        if data.len() / esz > self.max_count {
            // split transfers stay blocking
            self.allreduce(None, &mut data, dtype, op)?;
            return Ok(Some(data));
        }
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        // SAFETY: zeroed is a valid placeholder for the request out-parameter.
        let mut req = unsafe { std::mem::zeroed::<ffi::MPI_Request>() };
        // SAFETY: data covers len/esz elements of `ty` and outlives the request: it is returned
        // only once the request completed, and leaked otherwise.
        let rc = unsafe {
            ffi::MPI_Iallreduce(
                in_place(),
                ptr_mut(&mut data),
                (data.len() / esz) as c_int,
                ty,
                mop,
                self.comm,
                &mut req,
            )
        };
        check(rc, "MPI_Iallreduce")?;
        match wait_polled(&mut req, limit, slow) {
            Ok(true) => Ok(Some(data)),
            Ok(false) => {
                std::mem::forget(data);
                Ok(None)
            }
            Err(e) => {
                std::mem::forget(data);
                Err(e)
            }
        }
    }

    fn allgatherv(&self, send: Option<&[u8]>, recv: &mut [u8], counts: &[usize]) -> Result<()> {
        let _blocked = blocked("MPI_Allgatherv");
        let displs = displacements(counts);
        if !fits(counts, self.max_count) {
            if let Some(s) = send {
                recv[displs[self.rank]..displs[self.rank] + s.len()].copy_from_slice(s);
            }
            for r in 0..self.size {
                self.bcast_chunked(&mut recv[displs[r]..displs[r] + counts[r]], r)?;
            }
            return Ok(());
        }
        let (src, n) = match send {
            Some(s) => (ptr(s), s.len() as c_int),
            None => (in_place() as *const c_void, 0),
        };
        // SAFETY: recv holds sum(counts) bytes; counts and displacements fit in C ints.
        check(
            unsafe {
                ffi::MPI_Allgatherv(
                    src,
                    n,
                    byte_type(),
                    ptr_mut(recv),
                    ints(counts).as_ptr(),
                    ints(&displs).as_ptr(),
                    byte_type(),
                    self.comm,
                )
            },
            "MPI_Allgatherv",
        )
    }

    fn broadcast(&self, data: &mut [u8], root: usize) -> Result<()> {
        self.bcast_chunked(data, root)
    }

    fn alltoallv(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let _blocked = blocked("MPI_Alltoallv");
        let sd = displacements(send_counts);
        let rd = displacements(recv_counts);
        // Each rank sees only its own counts, so the choice of path is agreed first.
        let mine = send_counts
            .iter()
            .sum::<usize>()
            .max(recv_counts.iter().sum()) as u64;
        if self.max_u64(mine)? <= self.max_count as u64 {
            // SAFETY: buffers hold the summed counts; all values fit in C ints.
            return check(
                unsafe {
                    ffi::MPI_Alltoallv(
                        ptr(send),
                        ints(send_counts).as_ptr(),
                        ints(&sd).as_ptr(),
                        byte_type(),
                        ptr_mut(recv),
                        ints(recv_counts).as_ptr(),
                        ints(&rd).as_ptr(),
                        byte_type(),
                        self.comm,
                    )
                },
                "MPI_Alltoallv",
            );
        }
        // Large: chunked point-to-point, all posted at once
        let mut transfers = Vec::new();
        for r in 0..self.size {
            let incoming = recv[rd[r]..rd[r] + recv_counts[r]].chunks_mut(self.max_count);
            for (k, c) in incoming.enumerate() {
                transfers.push((Direction::Recv, ptr_mut(c), c.len(), r, k));
            }
            let outgoing = send[sd[r]..sd[r] + send_counts[r]].chunks(self.max_count);
            for (k, c) in outgoing.enumerate() {
                transfers.push((Direction::Send, ptr(c) as *mut c_void, c.len(), r, k));
            }
        }
        // SAFETY: every range lies in `send` or `recv`, which outlive the call.
        unsafe { self.transfer_all(&transfers) }
    }

    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Reduce_scatter");
        let esz = dtype.size();
        let ty = native_type(dtype);
        let mop = mpi_op(dtype, op)?;
        let elems: Vec<usize> = counts.iter().map(|c| c / esz).collect();
        if fits(&elems, self.max_count) {
            // SAFETY: send holds sum(counts) bytes, recv counts[rank] bytes.
            return check(
                unsafe {
                    ffi::MPI_Reduce_scatter(
                        ptr(send),
                        ptr_mut(recv),
                        ints(&elems).as_ptr(),
                        ty,
                        mop,
                        self.comm,
                    )
                },
                "MPI_Reduce_scatter",
            );
        }
        // Large: reduce each rank's segment to it, in chunks.
        let displs = displacements(counts);
        let step = self.max_count * esz;
        for r in 0..self.size {
            let seg = &send[displs[r]..displs[r] + counts[r]];
            for (k, c) in seg.chunks(step).enumerate() {
                let dst = if r == self.rank {
                    recv[k * step..].as_mut_ptr().cast()
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: c and (on the root) dst cover c.len()/esz elements.
                check(
                    unsafe {
                        ffi::MPI_Reduce(
                            ptr(c),
                            dst,
                            (c.len() / esz) as c_int,
                            ty,
                            mop,
                            r as c_int,
                            self.comm,
                        )
                    },
                    "MPI_Reduce",
                )?;
            }
        }
        Ok(())
    }

    fn gather_bytes(&self, send: &[u8], root: usize) -> Result<Vec<Vec<u8>>> {
        let is_root = self.rank == root;
        let lens = vec![0u8; if is_root { 8 * self.size } else { 0 }];
        // SAFETY: 8 bytes from each rank into `lens` (root only); both buffers are owned by
        // `control` until the request completes.
        let (_, lens) = self.control(
            "MPI_Igather",
            "a negotiation round",
            ((send.len() as u64).to_le_bytes().to_vec(), lens),
            |(mine, lens), req| unsafe {
                ffi::MPI_Igather(
                    ptr(mine),
                    8,
                    byte_type(),
                    ptr_mut(lens),
                    8,
                    byte_type(),
                    root as c_int,
                    self.comm,
                    req,
                )
            },
        )?;
        let counts: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        let displs = displacements(&counts);
        let total: usize = counts.iter().sum();
        if send.len() > c_int::MAX as usize || total > c_int::MAX as usize {
            // every rank's own length is checked; the root also checks the sum
            return Err(Error::Backend(format!(
                "a negotiation message of {} bytes (gathered: {total}) exceeds MPI's {} byte limit",
                send.len(),
                c_int::MAX
            )));
        }
        let bufs = (
            send.to_vec(),
            vec![0u8; total],
            ints(&counts),
            ints(&displs),
        );
        // SAFETY: root's buffer holds the sum of the gathered lengths (checked to fit a C
        // int); every buffer is owned by `control` until the request completes.
        let (_, all, _, _) = self.control(
            "MPI_Igatherv",
            "a negotiation round",
            bufs,
            |(data, all, c, d), req| unsafe {
                ffi::MPI_Igatherv(
                    ptr(data),
                    data.len() as c_int,
                    byte_type(),
                    ptr_mut(all),
                    c.as_ptr(),
                    d.as_ptr(),
                    byte_type(),
                    root as c_int,
                    self.comm,
                    req,
                )
            },
        )?;
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(c, d)| all[*d..d + c].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, data: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        // SAFETY: 8 bytes, owned by `control` until the request completes.
        let len = self.control(
            "MPI_Ibcast",
            "a negotiation round",
            (data.len() as u64).to_le_bytes().to_vec(),
            |len, req| unsafe {
                ffi::MPI_Ibcast(ptr_mut(len), 8, byte_type(), root as c_int, self.comm, req)
            },
        )?;
        let n = u64::from_le_bytes(len[..].try_into().expect("8 bytes")) as usize;
        let mut data = data;
        data.resize(n, 0);
        for at in (0..n).step_by(self.max_count.max(1)) {
            let chunk = self.max_count.min(n - at);
            // SAFETY: data[at..at + chunk] is valid; `data` is owned by `control` until the
            // request completes.
            data = self.control(
                "MPI_Ibcast",
                "a negotiation round",
                data,
                |data, req| unsafe {
                    ffi::MPI_Ibcast(
                        data.as_mut_ptr().add(at).cast(),
                        chunk as c_int,
                        byte_type(),
                        root as c_int,
                        self.comm,
                        req,
                    )
                },
            )?;
        }
        Ok(data)
    }

    fn sendrecv_while(
        &self,
        send: &[u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Isend/MPI_Irecv");
        self.peers_exist(to, from)?;
        let mut transfers = Vec::new();
        for (k, c) in recv.chunks_mut(self.max_count).enumerate() {
            transfers.push((Direction::Recv, ptr_mut(c), c.len(), from, k));
        }
        for (k, c) in send.chunks(self.max_count).enumerate() {
            transfers.push((Direction::Send, ptr(c) as *mut c_void, c.len(), to, k));
        }
        // SAFETY: every range lies in `send` or `recv`, which outlive the call; `meanwhile`
        // cannot reach them while they are borrowed here.
        unsafe { self.transfer_all_while(&transfers, meanwhile) }
    }

    fn sendrecv_segments(
        &self,
        send: &mut [u8],
        to: usize,
        recv: &mut [u8],
        from: usize,
        segment: usize,
        on: &mut dyn FnMut(Segment) -> Result<()>,
    ) -> Result<()> {
        let _blocked = blocked("MPI_Isend/MPI_Irecv");
        self.peers_exist(to, from)?;
        // the caller's segments are whole elements: cut no other way
        if segment == 0 || segment > self.max_count {
            return Err(Error::InvalidArgument(format!(
                "sendrecv segments of {segment} bytes (1 to {} on this communicator)",
                self.max_count
            )));
        }
        let mut parts: Vec<&mut [u8]> = recv.chunks_mut(segment).collect();
        let receives: Vec<_> = (parts.iter_mut().enumerate())
            .map(|(k, c)| (Direction::Recv, ptr_mut(c), c.len(), from, k))
            .collect();
        // SAFETY: each receive's range is one part of `recv`, which outlives the call; a part
        // is read below only once its receive has completed.
        let mut reqs = unsafe { self.post_all(&receives) }?;
        // each send goes as soon as it is ready, so the first travels while the rest are filled
        let mut failed = None;
        for (k, c) in send.chunks_mut(segment).enumerate() {
            if let Err(e) = on(Segment::Send(k, &mut *c)) {
                failed = Some(e);
                break;
            }
            // SAFETY: `c` lies in `send`, which outlives the call and is not touched again.
            match unsafe { self.post_all(&[(Direction::Send, ptr_mut(c), c.len(), to, k)]) } {
                Ok(posted) => reqs.extend(posted),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            // this rank stops half way: its receives may never all be matched
            for req in &mut reqs[..parts.len()] {
                // SAFETY: a receive posted above.
                unsafe { ffi::MPI_Cancel(req) };
            }
            let _ = wait_all(&mut reqs);
            return Err(e);
        }
        let mut outcome = Ok(());
        for (k, part) in parts.iter().enumerate() {
            // SAFETY: request k is part k's receive, posted above.
            let waited = check(
                unsafe { ffi::MPI_Wait(&mut reqs[k], ffi::RSMPI_STATUS_IGNORE) },
                "MPI_Wait",
            );
            outcome = waited.and_then(|_| on(Segment::Received(k, part)));
            if outcome.is_err() {
                break;
            }
        }
        // the rest complete before the buffers go, whatever failed
        outcome.and(wait_all(&mut reqs))
    }

    fn barrier(&self) -> Result<()> {
        let _blocked = blocked("MPI_Barrier");
        // SAFETY: comm is valid.
        check(unsafe { ffi::MPI_Barrier(self.comm) }, "MPI_Barrier")
    }

    fn max_transfer_bytes(&self) -> usize {
        self.max_count
    }
}
