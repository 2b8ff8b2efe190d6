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
    /// the operation that holds this buffer completes, and nothing else may write it meanwhile;
    /// for an operation on a GPU, as device memory of that GPU (see `device_range`).
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

/// A byte range of GPU memory that ferrovod's streams may read and write: ferrovod's own
/// (`DeviceMem::range`) or a caller's (`HostBuffer::device_range`, under the C API's contract),
/// or vouched for with `from_raw`. The functions that enqueue device work take these ranges and
/// check every count against them, so that safe code cannot name device memory it was not given.
/// (How long the memory stays valid is its owner's part: a `DeviceMem` is freed in stream order
/// after the work that uses it; a caller's memory until its operation completes.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRange {
    ptr: crate::transport::DevicePtr,
    len: usize,
}

impl DeviceRange {
    /// # Safety
    /// `ptr..ptr + len` must be device memory of the GPU the operation names, valid for reads
    /// and writes by the work enqueued with it until that work has completed.
    pub unsafe fn from_raw(ptr: crate::transport::DevicePtr, len: usize) -> DeviceRange {
        DeviceRange { ptr, len }
    }

    /// An address range for unit tests of layouts: never handed to device work.
    #[cfg(test)]
    pub(crate) fn for_test(ptr: crate::transport::DevicePtr, len: usize) -> DeviceRange {
        DeviceRange { ptr, len }
    }

    /// No memory (an unused fusion buffer, an empty tensor).
    pub fn empty() -> DeviceRange {
        DeviceRange { ptr: 0, len: 0 }
    }

    pub fn ptr(&self) -> crate::transport::DevicePtr {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `len` bytes from `offset`; an error if they reach past this range.
    pub fn sub(&self, offset: usize, len: usize) -> crate::error::Result<DeviceRange> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(DeviceRange {
                ptr: self.ptr + offset as u64,
                len,
            }),
            _ => Err(crate::error::Error::Internal(format!(
                "device range of {} bytes has no {len} bytes at offset {offset}",
                self.len
            ))),
        }
    }

    /// The first `len` bytes.
    pub fn first(&self, len: usize) -> crate::error::Result<DeviceRange> {
        self.sub(0, len)
    }

    /// Errors unless the range holds `bytes` bytes (what a device call is about to touch).
    pub fn holds(&self, bytes: usize, what: &str) -> crate::error::Result<()> {
        if bytes > self.len {
            return Err(crate::error::Error::Internal(format!(
                "{what}: {bytes} bytes asked of a device range of {}",
                self.len
            )));
        }
        Ok(())
    }
}

impl HostBuffer {
    /// This caller's memory as device memory, for operations on a GPU: `from_raw`'s contract
    /// covers the operation's device memory then (the C API's `fv_op.device`).
    pub fn device_range(&self) -> DeviceRange {
        DeviceRange {
            ptr: self.ptr as crate::transport::DevicePtr,
            len: self.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_ranges_stay_inside() {
        // SAFETY: never used for device work.
        let r = unsafe { DeviceRange::from_raw(0x1000, 64) };
        assert_eq!(r.sub(16, 48).unwrap().ptr(), 0x1010);
        assert!(r.sub(16, 49).is_err());
        assert!(r.sub(usize::MAX, 2).is_err());
        assert!(r.first(64).is_ok() && r.first(65).is_err());
        assert!(r.holds(64, "x").is_ok() && r.holds(65, "x").is_err());
        assert!(DeviceRange::empty().is_empty());
    }
}
