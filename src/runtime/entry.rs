//! A submitted tensor on its way through the runtime: its request, its memory and its handle.

use std::sync::{Arc, Mutex};

use crate::collective::TensorIo;
use crate::error::{Error, Result};
use crate::message::Request;
use crate::runtime::handle::{Handle, TensorResult};
use crate::transport::memory::HostBuffer;

/// Input memory: the caller's (C API) or owned by the library (Rust API, join zeros).
pub enum InputMem {
    Borrowed(HostBuffer),
    Owned(Vec<u8>),
}

/// Where the result goes.
pub enum OutputMem {
    /// Into the input memory (in place).
    InPlace,
    Borrowed(HostBuffer),
    Owned(Vec<u8>),
    /// Allocated after negotiation (allgather, alltoall, reducescatter).
    Later,
}

/// Allocates outputs whose size is known only after negotiation (the C API's callback).
pub trait OutputAllocator: Send {
    fn allocate(&mut self, index: usize, shape: &[i64], bytes: usize) -> Result<HostBuffer>;
}

pub type SharedAllocator = Arc<Mutex<dyn OutputAllocator>>;

pub struct TensorEntry {
    pub request: Request,
    pub input: InputMem,
    pub output: OutputMem,
    pub splits: Option<Vec<i32>>,
    pub allocator: Option<SharedAllocator>,
    pub handle: Option<Arc<Handle>>,
    /// Position of this tensor within its operation (grouped ops have several).
    pub index: usize,
    out_shape: Vec<i64>,
    received_splits: Vec<i32>,
    /// A failed output allocation: the tensor still takes part in the collective (through a
    /// scratch buffer), so the other ranks are not left waiting, and then fails.
    alloc_error: Option<Error>,
}

impl TensorEntry {
    pub fn new(request: Request, input: InputMem, output: OutputMem) -> TensorEntry {
        TensorEntry {
            out_shape: request.shape.clone(),
            request,
            input,
            output,
            splits: None,
            allocator: None,
            handle: None,
            index: 0,
            received_splits: Vec::new(),
            alloc_error: None,
        }
    }

    /// Finishes this tensor: hands its result (and library-owned output) to the handle.
    pub fn complete(self, outcome: Result<()>, value: Option<i32>) {
        let Some(handle) = self.handle else { return };
        let outcome = match (outcome, self.alloc_error) {
            (Ok(()), Some(e)) => Err(e),
            (o, _) => o,
        };
        let result = outcome.map(|()| {
            let output = match (self.output, self.input) {
                (OutputMem::Owned(v), _) => Some(v),
                (OutputMem::InPlace, InputMem::Owned(v)) => Some(v),
                _ => None,
            };
            TensorResult {
                output,
                shape: self.out_shape,
                received_splits: self.received_splits,
            }
        });
        handle.complete_one(self.index, result, value);
    }
}

fn input_slice(input: &InputMem) -> &[u8] {
    match input {
        InputMem::Borrowed(b) => b.as_slice(),
        InputMem::Owned(v) => v,
    }
}

impl TensorIo for TensorEntry {
    fn input(&self) -> &[u8] {
        input_slice(&self.input)
    }

    fn split_io(&mut self) -> (Option<&[u8]>, &mut [u8]) {
        match (&mut self.input, &mut self.output) {
            (InputMem::Borrowed(b), OutputMem::InPlace | OutputMem::Later) => {
                (None, b.as_mut_slice())
            }
            (InputMem::Owned(v), OutputMem::InPlace | OutputMem::Later) => (None, v.as_mut_slice()),
            (input, OutputMem::Borrowed(out)) => (Some(input_slice(input)), out.as_mut_slice()),
            (input, OutputMem::Owned(out)) => (Some(input_slice(input)), out.as_mut_slice()),
        }
    }

    fn allocate_output(&mut self, shape: &[i64], bytes: usize) -> Result<()> {
        self.out_shape = shape.to_vec();
        let allocated = match &self.allocator {
            Some(alloc) => alloc
                .lock()
                .map_err(|_| Error::Internal("output allocator poisoned".into()))
                .and_then(|mut a| a.allocate(self.index, shape, bytes))
                .and_then(|mut buf| {
                    if buf.len() < bytes {
                        return Err(Error::Aborted(format!(
                            "output allocator returned {} bytes for tensor '{}', {} needed",
                            buf.len(),
                            self.request.name,
                            bytes
                        )));
                    }
                    buf.truncate(bytes);
                    let input = input_slice(&self.input);
                    let (i0, o0) = (input.as_ptr() as usize, buf.as_ptr() as usize);
                    let disjoint = bytes == 0
                        || input.is_empty()
                        || o0 >= i0 + input.len()
                        || i0 >= o0 + bytes;
                    if !disjoint {
                        return Err(Error::Aborted(format!(
                            "output allocator returned memory overlapping the input of tensor '{}'",
                            self.request.name
                        )));
                    }
                    Ok(OutputMem::Borrowed(buf))
                }),
            None => Ok(OutputMem::Owned(vec![0u8; bytes])),
        };
        self.output = allocated.unwrap_or_else(|e| {
            self.alloc_error = Some(e);
            OutputMem::Owned(vec![0u8; bytes])
        });
        Ok(())
    }

    fn send_splits(&self) -> Option<&[i32]> {
        self.splits.as_deref()
    }

    fn set_received_splits(&mut self, splits: Vec<i32>) {
        self.received_splits = splits;
    }
}
