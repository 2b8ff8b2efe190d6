//! Byte encoding of the control messages exchanged during negotiation. Little-endian,
//! length-prefixed; decoding rejects truncated or corrupt input instead of panicking.

use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::message::{Compression, Multistep, OpKind, ReduceOp, Request, Response};

/// What a rank sends to the coordinator in a slow-path cycle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestList {
    pub requests: Vec<Request>,
    /// The requests that carry an operation's own timeout: (index into `requests`, timeout).
    pub timeouts: Vec<(u32, OpTimeout)>,
}

/// An operation's own bound on waiting for the other ranks, as a request carries it to the
/// coordinator: the bound, and how long the operation had already waited on the sending rank
/// (ranks share no clock, so the coordinator's deadline is its own now plus what is left).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpTimeout {
    pub timeout: std::time::Duration,
    pub waited: std::time::Duration,
}

/// What the coordinator broadcasts back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResponseList {
    pub responses: Vec<Response>,
    /// Ranks (set-relative) that have joined and not yet been released by a JOIN response.
    pub joined: Vec<i32>,
    /// Set when the coordinator decided to shut the job down (e.g. a stall), with the reason.
    pub shutdown: Option<String>,
}

const MAGIC_REQUESTS: u32 = 0x4656_5251; // "FVRQ"
const MAGIC_RESPONSES: u32 = 0x4656_5253; // "FVRS"

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    /// 0: the job's; else the compression's code plus one, then its parameter where it takes
    /// one.
    fn compression(&mut self, c: Option<Compression>) {
        self.u8(c.map_or(0, |c| c.code() as u8 + 1));
        if let Some(c @ (Compression::PowerSgd(_) | Compression::TopK(_))) = c {
            self.u32(c.param());
        }
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn multistep(&mut self, m: Multistep) {
        self.u32(m.every);
        self.u32(m.warmup);
        self.u8(u8::from(m.accumulate));
    }
    fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn i64s(&mut self, v: &[i64]) {
        self.u32(v.len() as u32);
        v.iter().for_each(|x| self.i64(*x));
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn corrupt(what: &str) -> Error {
    Error::Internal(format!("corrupt negotiation message: {what}"))
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| corrupt("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.arr()?))
    }
    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.arr()?))
    }
    fn len(&mut self, elem: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(elem) > self.buf.len() - self.pos {
            return Err(corrupt("length exceeds message"));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String> {
        let n = self.len(1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| corrupt("name is not UTF-8"))
    }
    fn i64s(&mut self) -> Result<Vec<i64>> {
        let n = self.len(8)?;
        (0..n).map(|_| self.i64()).collect()
    }
    fn dtype(&mut self) -> Result<DataType> {
        DataType::from_i32(self.i32()?).ok_or_else(|| corrupt("unknown dtype"))
    }
    fn kind(&mut self) -> Result<OpKind> {
        OpKind::from_i32(self.i32()?).ok_or_else(|| corrupt("unknown op"))
    }
    fn reduce_op(&mut self) -> Result<ReduceOp> {
        ReduceOp::from_i32(self.i32()?).ok_or_else(|| corrupt("unknown reduce op"))
    }
    fn compression(&mut self) -> Result<Option<Compression>> {
        let c = match self.u8()? {
            0 => return Ok(None),
            c => Compression::from_code(c as usize - 1)
                .ok_or_else(|| corrupt("unknown compression"))?,
        };
        match c {
            Compression::PowerSgd(_) | Compression::TopK(_) => {
                let p = self.u32()?;
                c.with_param(p)
                    .map(Some)
                    .map_err(|_| corrupt("compression parameter out of range"))
            }
            c => Ok(Some(c)),
        }
    }
    fn multistep(&mut self) -> Result<Multistep> {
        Ok(Multistep {
            every: self.u32()?,
            warmup: self.u32()?,
            accumulate: match self.u8()? {
                0 => false,
                1 => true,
                _ => return Err(corrupt("bad multistep mode")),
            },
        })
    }
    fn finish(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(corrupt("trailing bytes"))
        }
    }
}

pub fn encode_requests(list: &RequestList) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(MAGIC_REQUESTS);
    w.u32(list.requests.len() as u32);
    for r in &list.requests {
        w.i32(r.rank);
        w.i32(r.kind as i32);
        w.i32(r.dtype as i32);
        w.str(&r.name);
        w.i64s(&r.shape);
        w.i32(r.root);
        w.i32(r.device);
        w.i32(r.reduce_op as i32);
        w.f64(r.prescale);
        w.f64(r.postscale);
        w.compression(r.compression);
        w.multistep(r.multistep);
    }
    w.u32(list.timeouts.len() as u32);
    for (i, t) in &list.timeouts {
        w.u32(*i);
        w.u64(t.timeout.as_micros().min(u64::MAX as u128) as u64);
        w.u64(t.waited.as_micros().min(u64::MAX as u128) as u64);
    }
    w.0
}

pub fn decode_requests(buf: &[u8]) -> Result<RequestList> {
    let mut r = Reader { buf, pos: 0 };
    if r.u32()? != MAGIC_REQUESTS {
        return Err(corrupt("bad request-list tag"));
    }
    let n = r.len(4)?;
    let mut requests = Vec::with_capacity(n);
    for _ in 0..n {
        requests.push(Request {
            rank: r.i32()?,
            kind: r.kind()?,
            dtype: r.dtype()?,
            name: r.str()?,
            shape: r.i64s()?,
            root: r.i32()?,
            device: r.i32()?,
            reduce_op: r.reduce_op()?,
            prescale: r.f64()?,
            postscale: r.f64()?,
            compression: r.compression()?,
            multistep: r.multistep()?,
        });
    }
    let k = r.len(20)?;
    let mut timeouts = Vec::with_capacity(k);
    for _ in 0..k {
        let i = r.u32()?;
        if i as usize >= n {
            return Err(corrupt("timeout of a request not in the list"));
        }
        let timeout = std::time::Duration::from_micros(r.u64()?);
        let waited = std::time::Duration::from_micros(r.u64()?);
        timeouts.push((i, OpTimeout { timeout, waited }));
    }
    r.finish()?;
    Ok(RequestList { requests, timeouts })
}

pub fn encode_responses(list: &ResponseList) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(MAGIC_RESPONSES);
    match &list.shutdown {
        Some(reason) => {
            w.u8(1);
            w.str(reason);
        }
        None => w.u8(0),
    }
    w.i64s(&list.joined.iter().map(|r| *r as i64).collect::<Vec<_>>());
    w.u32(list.responses.len() as u32);
    for r in &list.responses {
        w.i32(r.kind as i32);
        w.str(&r.name);
        w.i32(r.dtype as i32);
        w.i64s(&r.shape);
        w.i64s(&r.first_dims);
        w.i32(r.root);
        w.i32(r.device);
        w.i32(r.reduce_op as i32);
        w.f64(r.prescale);
        w.f64(r.postscale);
        w.compression(r.compression);
        w.multistep(r.multistep);
        w.i32(r.result);
        match &r.error {
            Some(e) => {
                w.u8(1);
                w.str(e);
            }
            None => w.u8(0),
        }
    }
    w.0
}

pub fn decode_responses(buf: &[u8]) -> Result<ResponseList> {
    let mut r = Reader { buf, pos: 0 };
    if r.u32()? != MAGIC_RESPONSES {
        return Err(corrupt("bad response-list tag"));
    }
    let shutdown = match r.u8()? {
        0 => None,
        1 => Some(r.str()?),
        _ => return Err(corrupt("bad shutdown flag")),
    };
    let joined = r
        .i64s()?
        .into_iter()
        .map(|v| i32::try_from(v).map_err(|_| corrupt("joined rank out of range")))
        .collect::<Result<Vec<i32>>>()?;
    let n = r.len(4)?;
    let mut responses = Vec::with_capacity(n);
    for _ in 0..n {
        responses.push(Response {
            kind: r.kind()?,
            name: r.str()?,
            dtype: r.dtype()?,
            shape: r.i64s()?,
            first_dims: r.i64s()?,
            root: r.i32()?,
            device: r.i32()?,
            reduce_op: r.reduce_op()?,
            prescale: r.f64()?,
            postscale: r.f64()?,
            compression: r.compression()?,
            multistep: r.multistep()?,
            result: r.i32()?,
            error: match r.u8()? {
                0 => None,
                1 => Some(r.str()?),
                _ => return Err(corrupt("bad error flag")),
            },
        });
    }
    r.finish()?;
    Ok(ResponseList {
        responses,
        joined,
        shutdown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_request(i: i32) -> Request {
        Request {
            rank: i,
            kind: OpKind::Allgather,
            dtype: DataType::BF16,
            name: format!("layer{i}/kernel:0 ü"),
            shape: vec![3, i as i64, 1 << 40],
            root: 1,
            device: -1,
            reduce_op: ReduceOp::Max,
            prescale: 0.5,
            postscale: 2.0,
            compression: Compression::from_code(i as usize % Compression::ALL.len()).map(
                |c| match c {
                    Compression::PowerSgd(_) | Compression::TopK(_) => c.with_param(3).unwrap(),
                    c => c,
                },
            ),
            multistep: Multistep {
                every: i as u32,
                warmup: 7,
                accumulate: i % 2 == 0,
            },
        }
    }

    #[test]
    fn requests_round_trip() {
        // every compression, PowerSGD's and top-k's with their own parameters
        let list = RequestList {
            requests: (0..8).map(sample_request).collect(),
            timeouts: vec![(
                5,
                OpTimeout {
                    timeout: std::time::Duration::from_millis(1500),
                    waited: std::time::Duration::from_micros(250),
                },
            )],
        };
        assert!(
            list.requests
                .iter()
                .any(|r| r.compression == Some(Compression::TopK(3)))
        );
        assert_eq!(decode_requests(&encode_requests(&list)).unwrap(), list);
        // a parameter out of its range is refused
        let bytes = encode_requests(&RequestList {
            requests: vec![sample_request(6)],
            ..Default::default()
        });
        let at = bytes
            .windows(5)
            .rposition(|w| w == [7, 3, 0, 0, 0])
            .unwrap();
        let mut bad = bytes.clone();
        bad[at + 1..at + 5].copy_from_slice(&2_000_000u32.to_le_bytes());
        assert!(decode_requests(&bad).is_err());
        // a timeout must belong to a request of the list
        let one = OpTimeout {
            timeout: std::time::Duration::from_secs(1),
            waited: std::time::Duration::ZERO,
        };
        let stray = encode_requests(&RequestList {
            requests: vec![sample_request(1)],
            timeouts: vec![(1, one)],
        });
        let err = decode_requests(&stray).unwrap_err().to_string();
        assert!(
            err.contains("timeout of a request not in the list"),
            "{err}"
        );
    }

    #[test]
    fn responses_round_trip() {
        let mut resp = Response::from_request(&sample_request(2));
        resp.first_dims = vec![1, 2, 3];
        let mut failed = resp.clone();
        failed.error = Some("Mismatched data types".into());
        let list = ResponseList {
            responses: vec![resp, failed],
            joined: vec![0, 3],
            shutdown: Some("stall".into()),
        };
        assert_eq!(decode_responses(&encode_responses(&list)).unwrap(), list);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let list = RequestList {
            requests: (0..3).map(sample_request).collect(),
            timeouts: vec![(
                2,
                OpTimeout {
                    timeout: std::time::Duration::from_secs(3),
                    waited: std::time::Duration::from_secs(1),
                },
            )],
        };
        let bytes = encode_requests(&list);
        for cut in 0..bytes.len() {
            assert!(decode_requests(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let resp = encode_responses(&ResponseList {
            responses: vec![Response::from_request(&sample_request(1))],
            ..Default::default()
        });
        for cut in 0..resp.len() {
            assert!(decode_responses(&resp[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn corrupt_fields_are_rejected() {
        let mut bytes = encode_requests(&RequestList {
            requests: vec![sample_request(0)],
            ..Default::default()
        });
        // kind field sits after magic, count and rank.
        bytes[12..16].copy_from_slice(&99i32.to_le_bytes());
        assert!(decode_requests(&bytes).is_err());
        // a huge length prefix must not allocate or panic
        let mut bytes = encode_requests(&RequestList::default());
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_requests(&bytes).is_err());
        let mut extra = encode_requests(&RequestList::default());
        extra.push(0);
        assert!(decode_requests(&extra).is_err());
        // a joined rank beyond i32 (found by the wire fuzz target): refused, not truncated
        let mut joined = encode_responses(&ResponseList {
            joined: vec![5],
            ..Default::default()
        });
        // magic, shutdown flag, joined count, then the rank as an i64
        joined[9..17].copy_from_slice(&(1i64 << 32 | 5).to_le_bytes());
        assert!(decode_responses(&joined).is_err());
    }
}
