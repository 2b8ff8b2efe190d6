//! MPI datatypes and reduction operations, with user operations for f16 and bf16.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use half::{bf16, f16};
use mpi::ffi;

use super::*;

pub(super) fn native_type(dtype: DataType) -> ffi::MPI_Datatype {
    // SAFETY: reading constants initialised by rsmpi's shim.
    unsafe {
        match dtype {
            DataType::U8 | DataType::Bool => ffi::RSMPI_UINT8_T,
            DataType::I8 => ffi::RSMPI_INT8_T,
            DataType::U16 | DataType::F16 | DataType::BF16 => ffi::RSMPI_UINT16_T,
            DataType::I16 => ffi::RSMPI_INT16_T,
            DataType::I32 => ffi::RSMPI_INT32_T,
            DataType::I64 => ffi::RSMPI_INT64_T,
            DataType::F32 => ffi::RSMPI_FLOAT,
            DataType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

macro_rules! half_op {
    ($fname:ident, $t:ty, $kernel:ident, $op:expr) => {
        unsafe extern "C" fn $fname(
            invec: *mut c_void,
            inoutvec: *mut c_void,
            len: *mut c_int,
            _dt: *mut ffi::MPI_Datatype,
        ) {
            let align = std::mem::align_of::<$t>();
            // SAFETY: MPI passes two buffers of `*len` elements of the 16-bit carrier type,
            // which has the size of `$t`; slices are made over them only where they are
            // aligned for `$t`, otherwise the elements are copied bytewise.
            unsafe {
                let n = (*len).max(0) as usize;
                if invec as usize % align == 0 && inoutvec as usize % align == 0 {
                    let x = std::slice::from_raw_parts(invec as *const $t, n);
                    let acc = std::slice::from_raw_parts_mut(inoutvec as *mut $t, n);
                    $kernel(acc, x, $op);
                } else {
                    let bytes = n * std::mem::size_of::<$t>();
                    let mut x = vec![<$t>::ZERO; n];
                    let mut acc = vec![<$t>::ZERO; n];
                    std::ptr::copy_nonoverlapping(invec as *const u8, x.as_mut_ptr().cast(), bytes);
                    std::ptr::copy_nonoverlapping(
                        inoutvec as *const u8,
                        acc.as_mut_ptr().cast(),
                        bytes,
                    );
                    $kernel(&mut acc, &x, $op);
                    std::ptr::copy_nonoverlapping(acc.as_ptr().cast(), inoutvec as *mut u8, bytes);
                }
            }
        }
    };
}

half_op!(f16_sum, f16, reduce_f16, ReduceOp::Sum);
half_op!(f16_min, f16, reduce_f16, ReduceOp::Min);
half_op!(f16_max, f16, reduce_f16, ReduceOp::Max);
half_op!(f16_prod, f16, reduce_f16, ReduceOp::Product);
half_op!(bf16_sum, bf16, reduce_bf16, ReduceOp::Sum);
half_op!(bf16_min, bf16, reduce_bf16, ReduceOp::Min);
half_op!(bf16_max, bf16, reduce_bf16, ReduceOp::Max);
half_op!(bf16_prod, bf16, reduce_bf16, ReduceOp::Product);

pub(super) struct HalfOps([ffi::MPI_Op; 8]);
// SAFETY: MPI_Op handles are process-wide values, valid from any thread.
unsafe impl Send for HalfOps {}
// SAFETY: as above; they are never mutated after creation.
unsafe impl Sync for HalfOps {}

pub(super) static HALF_OPS: OnceLock<HalfOps> = OnceLock::new();

pub(super) fn half_ops() -> &'static HalfOps {
    HALF_OPS.get_or_init(|| {
        let fns: [ffi::MPI_User_function; 8] = [
            Some(f16_sum),
            Some(f16_min),
            Some(f16_max),
            Some(f16_prod),
            Some(bf16_sum),
            Some(bf16_min),
            Some(bf16_max),
            Some(bf16_prod),
        ];
        // SAFETY: MPI is initialised whenever a communicator exists; each call writes one op.
        HalfOps(fns.map(|f| unsafe {
            let mut op = std::mem::zeroed::<ffi::MPI_Op>();
            ffi::MPI_Op_create(f, 1, &mut op);
            op
        }))
    })
}

pub(super) fn mpi_op(dtype: DataType, op: ReduceOp) -> Result<ffi::MPI_Op> {
    let idx = op.elementwise_index()?;
    // SAFETY: reading constants initialised by rsmpi's shim.
    Ok(unsafe {
        match dtype {
            DataType::F16 => half_ops().0[idx],
            DataType::BF16 => half_ops().0[4 + idx],
            // bool as 0/1 bytes: sum and max are OR, min and product are AND
            DataType::Bool if idx == 0 || idx == 2 => ffi::RSMPI_BOR,
            DataType::Bool => ffi::RSMPI_BAND,
            _ => [
                ffi::RSMPI_SUM,
                ffi::RSMPI_MIN,
                ffi::RSMPI_MAX,
                ffi::RSMPI_PROD,
            ][idx],
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MPI may hand a user operation unaligned buffers: the f16 sum must read them bytewise
    /// and give the same result as on aligned ones.
    #[test]
    fn half_ops_take_unaligned_buffers() {
        let a: Vec<f16> = [1.0f32, 2.5, -3.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let b: Vec<f16> = [0.5f32, 0.5, 4.0]
            .iter()
            .map(|v| f16::from_f32(*v))
            .collect();
        let mut inb = vec![0u8; 7];
        let mut io = vec![0u8; 7];
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            inb[1 + 2 * k..3 + 2 * k].copy_from_slice(&x.to_le_bytes());
            io[1 + 2 * k..3 + 2 * k].copy_from_slice(&y.to_le_bytes());
        }
        let mut len: c_int = 3;
        // SAFETY: both buffers hold 3 f16 values from offset 1 (odd: unaligned for f16).
        unsafe {
            f16_sum(
                inb.as_mut_ptr().add(1).cast(),
                io.as_mut_ptr().add(1).cast(),
                &mut len,
                std::ptr::null_mut(),
            )
        };
        let got: Vec<f32> = (0..3)
            .map(|k| f16::from_le_bytes([io[1 + 2 * k], io[2 + 2 * k]]).to_f32())
            .collect();
        assert_eq!(got, vec![1.5, 3.0, 1.0]);
    }
}
