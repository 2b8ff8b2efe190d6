//! Caller-owned host memory handed to the runtime through the C API. Built only by the C
//! boundary, whose caller promises the memory stays valid and untouched until completion.

/// A byte range owned by the caller.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the C API contract makes the caller keep the memory alive and unaliased by its own
// threads until the operation completes; the runtime touches it from one thread at a time.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    /// # Safety
    /// `ptr` must be valid for reads (and writes, if used as an output) of `len` bytes until
    /// the operation that holds this buffer completes, and nothing else may write it meanwhile.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> HostBuffer {
        HostBuffer { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Shrinks the view to its first `len` bytes (an allocator may hand out more).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid for `len` bytes per the constructor's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: valid and exclusively ours for `len` bytes per the constructor's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A byte range of GPU memory owned by the caller (same contract as `HostBuffer`, on the
/// device: valid until the operation's completion event has fired).
#[derive(Clone, Copy, Debug)]
pub struct DeviceRange {
    pub ptr: crate::transport::DevicePtr,
    pub len: usize,
}
