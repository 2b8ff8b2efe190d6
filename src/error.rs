//! One error type for the whole library; the C status codes and the Python exception types are
//! derived from it in one place (`Error::status`).

use std::fmt;
use std::time::Duration;

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

/// A wait for other ranks that outlived the stall shutdown time.
#[derive(Clone, Debug, PartialEq)]
pub struct Stall {
    /// The global rank that gave up.
    pub rank: i32,
    /// `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`.
    pub limit: Duration,
    /// What it waited in ("the vote of process set 0", "offline plan batch 3 (a, b)").
    pub waiting_in: String,
    /// The global ranks that did not answer the presence probe; `None`: no probe could be
    /// made (it needs MPI_THREAD_MULTIPLE beside a blocked call).
    pub missing: Option<Vec<i32>>,
    /// What a missing rank may be doing, for this kind of wait.
    pub hint: &'static str,
}

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let missing = match self.missing.as_deref() {
            Some([]) => {
                "none found (every rank answered; they may wait in different collectives)".into()
            }
            Some(ranks) => ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            None => "unknown (MPI_THREAD_MULTIPLE is needed to ask)".to_string(),
        };
        write!(
            f,
            "Stalled ranks: rank {} waited more than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={} in {} for ranks that never joined it. Missing ranks: {missing}. {} Shutting down.",
            self.rank,
            self.limit.as_secs(),
            self.waiting_in,
            self.hint
        )
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    NotInitialized,
    /// The runtime stopped; the string says why (a rank shut down, a stall, a dead peer).
    ShutDown(String),
    /// This rank gave up waiting for others (the job shuts down).
    Stalled(Box<Stall>),
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
            Error::ShutDown(_) | Error::Stalled(_) => Status::ShutDown,
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
            Error::Stalled(s) => s.fmt(f),
            Error::Timeout => f.write_str("timed out waiting for the operation to complete"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::{Error, Stall, Status};
    use std::time::Duration;

    #[test]
    fn a_stall_names_who_waited_where_and_who_is_missing() {
        let stall = |missing: Option<Vec<i32>>| {
            Error::Stalled(Box::new(Stall {
                rank: 0,
                limit: Duration::from_secs(2),
                waiting_in: "the vote of process set 0".into(),
                missing,
                hint: "A missing rank is stopped, hung, or blocked elsewhere.",
            }))
        };
        let e = stall(Some(vec![1, 3]));
        assert_eq!(e.status(), Status::ShutDown);
        let msg = e.to_string();
        assert!(msg.starts_with("Stalled ranks: rank 0 waited more than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2 in the vote of process set 0"), "{msg}");
        assert!(msg.contains("Missing ranks: 1, 3."), "{msg}");
        assert!(
            stall(Some(vec![]))
                .to_string()
                .contains("Missing ranks: none found")
        );
        assert!(stall(None).to_string().contains("Missing ranks: unknown"));
    }

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
