//! One error type for the whole library; the C status codes and the Python exception types are
//! derived from it in one place (`Error::status`).

use std::fmt;

/// Status codes returned by every C API call. The first six follow Horovod's `StatusType`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    /// Collective or backend failure (Horovod's UNKNOWN_ERROR).
    Unknown = 1,
    /// Ranks disagreed about a tensor (TensorFlow: FailedPreconditionError).
    Precondition = 2,
    Aborted = 3,
    /// Bad argument detected at the call (TensorFlow: InvalidArgumentError).
    InvalidArgument = 4,
    /// The operation has not completed yet.
    InProgress = 5,
    NotInitialized = 6,
    /// The runtime has shut down (locally or because another rank did).
    ShutDown = 7,
    /// A wait ran out of time; the operation is still pending.
    Timeout = 8,
    /// A panic was caught at the C boundary.
    Internal = 9,
}

impl Status {
    /// The status as a canonical error code (`absl::StatusCode`, TensorFlow's and gRPC's error
    /// space), for framework ops written in C++: the one mapping they share. The six codes
    /// Horovod has map as Horovod's TensorFlow ops map them; a shutdown is Horovod's
    /// UNKNOWN_ERROR (its elastic mode recognises failed ops by it).
    pub fn canonical_code(self) -> i32 {
        const UNKNOWN: i32 = 2;
        const INVALID_ARGUMENT: i32 = 3;
        const DEADLINE_EXCEEDED: i32 = 4;
        const FAILED_PRECONDITION: i32 = 9;
        const ABORTED: i32 = 10;
        const INTERNAL: i32 = 13;
        match self {
            Status::Ok => 0,
            Status::Unknown | Status::InProgress | Status::ShutDown => UNKNOWN,
            Status::Precondition | Status::NotInitialized => FAILED_PRECONDITION,
            Status::Aborted => ABORTED,
            Status::InvalidArgument => INVALID_ARGUMENT,
            Status::Timeout => DEADLINE_EXCEEDED,
            Status::Internal => INTERNAL,
        }
    }

    /// Every status, for lookups by code.
    /// cbindgen:ignore
    pub const ALL: [Status; 10] = [
        Status::Ok,
        Status::Unknown,
        Status::Precondition,
        Status::Aborted,
        Status::InvalidArgument,
        Status::InProgress,
        Status::NotInitialized,
        Status::ShutDown,
        Status::Timeout,
        Status::Internal,
    ];
}

/// The text Horovod gives every operation that fails because the job is shutting down.
pub const SHUT_DOWN_MESSAGE: &str = "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown was caused by an exception, you should see the exception in the log before the first shutdown message.";

/// The text for any call made before initialisation.
pub const NOT_INITIALIZED_MESSAGE: &str = "Horovod has not been initialized; use hvd.init().";

#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    NotInitialized,
    /// The runtime stopped; the string says why (a rank shut down, a stall, a dead peer).
    ShutDown(String),
    InvalidArgument(String),
    /// Cross-rank disagreement found in negotiation.
    Precondition(String),
    Aborted(String),
    /// An MPI (or later NCCL/ibverbs) call failed.
    Backend(String),
    Timeout,
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn status(&self) -> Status {
        match self {
            Error::NotInitialized => Status::NotInitialized,
            Error::ShutDown(_) => Status::ShutDown,
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::Precondition(_) => Status::Precondition,
            Error::Aborted(_) => Status::Aborted,
            Error::Backend(_) => Status::Unknown,
            Error::Timeout => Status::Timeout,
            Error::Internal(_) => Status::Internal,
        }
    }

    pub fn shut_down() -> Error {
        Error::ShutDown(SHUT_DOWN_MESSAGE.to_string())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotInitialized => f.write_str(NOT_INITIALIZED_MESSAGE),
            Error::ShutDown(m)
            | Error::InvalidArgument(m)
            | Error::Precondition(m)
            | Error::Aborted(m)
            | Error::Backend(m)
            | Error::Internal(m) => f.write_str(m),
            Error::Timeout => f.write_str("timed out waiting for the operation to complete"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::Status;

    #[test]
    fn canonical_codes_keep_horovods_mapping() {
        // Horovod's TensorFlow ops: UNKNOWN_ERROR, PRECONDITION_ERROR, ABORTED, INVALID_ARGUMENT
        // become TensorFlow's Unknown (2), FailedPrecondition (9), Aborted (10), InvalidArgument (3)
        let want = [
            (Status::Ok, 0),
            (Status::Unknown, 2),
            (Status::Precondition, 9),
            (Status::Aborted, 10),
            (Status::InvalidArgument, 3),
            (Status::ShutDown, 2),
            (Status::NotInitialized, 9),
            (Status::Timeout, 4),
            (Status::Internal, 13),
        ];
        for (status, code) in want {
            assert_eq!(status.canonical_code(), code, "{status:?}");
        }
        for (i, s) in Status::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "ALL is in code order");
            assert_eq!(s.canonical_code() == 0, *s == Status::Ok);
        }
    }
}
