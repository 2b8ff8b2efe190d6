//! Element types. The numeric values are Horovod's `DataType` enum (so bindings can pass
//! Horovod's constants through unchanged), with bfloat16 added after Horovod's last value.

/// Element type of a tensor.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    Bool = 9,
    BF16 = 10,
}

impl DataType {
    /// Rust only: as a C macro it would name identifiers that do not exist.
    /// cbindgen:ignore
    pub const ALL: [DataType; 11] = [
        DataType::U8,
        DataType::I8,
        DataType::U16,
        DataType::I16,
        DataType::I32,
        DataType::I64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bool,
        DataType::BF16,
    ];

    pub fn from_i32(v: i32) -> Option<DataType> {
        DataType::ALL.iter().copied().find(|d| *d as i32 == v)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 | DataType::I8 | DataType::Bool => 1,
            DataType::U16 | DataType::I16 | DataType::F16 | DataType::BF16 => 2,
            DataType::I32 | DataType::F32 => 4,
            DataType::I64 | DataType::F64 => 8,
        }
    }

    /// The lower-case name Horovod prints in its mismatch messages.
    pub fn name(self) -> &'static str {
        match self {
            DataType::U8 => "uint8",
            DataType::I8 => "int8",
            DataType::U16 => "uint16",
            DataType::I16 => "int16",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::F16 => "float16",
            DataType::F32 => "float32",
            DataType::F64 => "float64",
            DataType::Bool => "bool",
            DataType::BF16 => "bfloat16",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::BF16 | DataType::F32 | DataType::F64
        )
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_match_horovod() {
        for d in DataType::ALL {
            assert_eq!(DataType::from_i32(d as i32), Some(d));
        }
        assert_eq!(DataType::F32 as i32, 7);
        assert_eq!(DataType::Bool as i32, 9);
        assert_eq!(DataType::from_i32(11), None);
        assert_eq!(DataType::BF16.size(), 2);
    }
}
