//! Tensor fusion: many small responses become one collective over a fusion buffer.

pub mod autotune;
pub mod planner;

/// A process set's (or channel's) host fusion buffer: fused batches are packed into it, reduced
/// in it and unpacked from it. It grows to the largest batch and is kept, so steady steps
/// allocate nothing.
#[derive(Default)]
pub struct FusionBuffer {
    bytes: Vec<u8>,
    /// For codecs that compute on f32 values (`u8`): kept like the bytes.
    values: Vec<f32>,
}

impl FusionBuffer {
    /// The first `len` bytes (contents unspecified).
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.bytes.len() < len {
            self.bytes.resize(len, 0);
        }
        &mut self.bytes[..len]
    }

    /// The first `len` bytes as an owned vector, for a transport that takes ownership while
    /// it waits; give it back with `restore`.
    pub fn take(&mut self, len: usize) -> Vec<u8> {
        self.get(len);
        let mut owned = std::mem::take(&mut self.bytes);
        owned.truncate(len);
        owned
    }

    pub fn restore(&mut self, bytes: Vec<u8>) {
        self.bytes = bytes;
    }

    /// The first `values` f32 values and the first `bytes` bytes (contents unspecified).
    pub fn values_and_bytes(&mut self, values: usize, bytes: usize) -> (&mut [f32], &mut [u8]) {
        if self.values.len() < values {
            self.values.resize(values, 0.0);
        }
        self.get(bytes);
        (&mut self.values[..values], &mut self.bytes[..bytes])
    }
}

#[cfg(test)]
mod tests {
    use super::FusionBuffer;

    #[test]
    fn the_buffer_grows_keeps_its_bytes_and_comes_back_after_a_take() {
        let mut f = FusionBuffer::default();
        f.get(4).copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(f.get(2), &[1, 2]);
        assert_eq!(&f.get(6)[..4], &[1, 2, 3, 4]);
        let owned = f.take(3);
        assert_eq!(owned, vec![1, 2, 3]);
        f.restore(owned);
        assert_eq!(f.get(3), &[1, 2, 3]);
    }
}
