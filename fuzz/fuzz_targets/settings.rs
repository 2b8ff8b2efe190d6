//! Past init, on arbitrary inputs: the settings parser (every variable, any value: never a
//! panic, every value inside its range, and the deadlines the runtime derives from them
//! computable), the u8 codec (finite values give finite values back and finite residuals,
//! and what came back plus the residual is the input), the 16-bit codecs (no panic), and the
//! negotiation's vote words (two ranks' votes, ANDed, decode to the common hits and every
//! rank's invalid bits, in both vote forms).
#![no_main]

use std::time::{Duration, Instant};

use ferrovod::DataType;
use ferrovod::compress::quantize;
use ferrovod::config::{Config, MAX_CYCLE_MS, MAX_SECONDS, MIN_MPI_COUNT};
use ferrovod::elementwise;
use ferrovod::negotiate::ready_bitmap::{self, Vote};
use libfuzzer_sys::fuzz_target;

/// The variables the parser reads.
const KEYS: &[&str] = &[
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "FERROVOD_FUSION_DIRECT_BYTES",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "FERROVOD_LOCAL_SIZE",
    "FERROVOD_MPI_MAX_COUNT",
    "FERROVOD_NEGOTIATION",
    "FERROVOD_PLAN_WARMUP_STEPS",
    "FERROVOD_PLAN_ESCAPE_MS",
    "FERROVOD_CHANNELS",
    "PERSEUS_ALLREDUCE_STREAMS",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "FERROVOD_AUTOTUNE_WINDOW_CYCLES",
    "HOROVOD_NUM_NCCL_STREAMS",
    "FERROVOD_ALGORITHM",
    "FERROVOD_RING_MIN_BYTES",
    "FERROVOD_COMPRESSION",
    "PERSEUS_ALLREDUCE_DTYPE",
    "FERROVOD_COMPRESSION_MIN_BYTES",
    "FERROVOD_MULTISTEP",
    "FERROVOD_GOSSIP_SYNC_EVERY",
    "FERROVOD_GOSSIP_EXACT_INSIDE_NODE",
];

/// Values worth trying besides the fuzzer's own strings.
const EDGES: &[&str] = &[
    "1e22",
    "1e19",
    "-1",
    "nan",
    "inf",
    "0",
    "1",
    "18446744073709551616",
    "4294967296",
    "1e-300",
    "2.5",
    " 7 ",
];

fn settings(data: &[u8]) {
    let mut vars: Vec<(&str, String)> = Vec::new();
    for chunk in data.chunks(6) {
        let key = KEYS[chunk[0] as usize % KEYS.len()];
        let value = match chunk.get(1) {
            Some(v) if (*v as usize) < EDGES.len() => EDGES[*v as usize].to_string(),
            _ => String::from_utf8_lossy(&chunk[1.min(chunk.len())..]).into_owned(),
        };
        vars.push((key, value));
    }
    let cfg = Config::from_lookup(&|key| {
        vars.iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    });
    assert!(cfg.cycle_time <= Duration::from_secs_f64(MAX_CYCLE_MS / 1e3));
    for d in [cfg.stall_warn, cfg.stall_shutdown, cfg.plan_escape] {
        assert!(d <= Duration::from_secs_f64(MAX_SECONDS));
        let _ = Instant::now() + d * 4;
    }
    let _ = cfg.cycle_time * 5;
    assert!((1..=64).contains(&cfg.channels));
    assert!((1..=8).contains(&cfg.nccl_streams));
    assert!(cfg.mpi_max_count >= MIN_MPI_COUNT);
    assert!(cfg.multistep >= 1);
}

fn codecs(data: &[u8]) {
    let x: Vec<f32> = (data.chunks_exact(4))
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut out = vec![0u8; quantize::encoded_len(x.len())];
    let mut lost = vec![0f32; x.len()];
    quantize::encode(&x, &mut out, &mut lost);
    let mut back = vec![0f32; x.len()];
    quantize::decode(&out, &mut back, false);
    if x.iter().all(|v| v.is_finite()) {
        for ((v, b), l) in x.iter().zip(&back).zip(&lost) {
            assert!(
                b.is_finite() && l.is_finite(),
                "{v} came back {b}, lost {l}"
            );
            let err = (*b as f64 + *l as f64 - *v as f64).abs();
            let scale = v.abs() as f64 + b.abs() as f64;
            // a residual saturates at f32::MAX where the range exceeds what an f32 holds
            let saturated = l.abs() == f32::MAX;
            assert!(saturated || err <= 1e-6 * scale + 1e-30, "{v}: {b} + {l}");
        }
    }
    let bytes = &data[..data.len() / 4 * 4];
    for wire in [DataType::F16, DataType::BF16] {
        let mut narrow = vec![0u8; bytes.len() / 2];
        let _ = elementwise::encode_half(&mut narrow, bytes, wire, 1.0);
        let mut wide = vec![0u8; bytes.len()];
        let _ = elementwise::decode_half(&mut wide, &narrow, wire, 0.5);
    }
}

fn votes(data: &[u8]) {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let num_bits = rest.len().min(512);
    let gpu = head & 1 != 0;
    // two ranks' votes: bits of `rest` say hit / invalid per rank
    let vote = |shift: u8| Vote {
        shutdown: head & (2 << shift) != 0,
        uncached: head & (8 << shift) != 0,
        gpu_moved: gpu.then_some(head & (32 << shift) != 0),
        hits: (0..num_bits)
            .filter(|b| rest[*b] & (1 << shift) != 0)
            .collect(),
        invalid: (0..num_bits)
            .filter(|b| rest[*b] & (4 << shift) != 0)
            .collect(),
        ..Vote::default()
    };
    let (a, b) = (vote(0), vote(1));
    let and = ready_bitmap::and_all(&[
        ready_bitmap::encode(&a, num_bits),
        ready_bitmap::encode(&b, num_bits),
    ]);
    let t = ready_bitmap::decode(&and, num_bits, gpu);
    let common: Vec<usize> = (a.hits.iter())
        .filter(|h| b.hits.contains(h))
        .copied()
        .collect();
    let mut invalid: Vec<usize> = a.invalid.iter().chain(&b.invalid).copied().collect();
    invalid.sort_unstable();
    invalid.dedup();
    assert_eq!(t.common_hits, common);
    assert_eq!(t.invalid, invalid);
    assert_eq!(t.any_shutdown, a.shutdown || b.shutdown);
    assert_eq!(t.any_uncached, a.uncached || b.uncached);
    let (ha, fa) = ready_bitmap::encode_split(&a, num_bits);
    let (hb, fb) = ready_bitmap::encode_split(&b, num_bits);
    let hits: Vec<u64> = ha.iter().zip(&hb).map(|(x, y)| x & y).collect();
    let flags: Vec<u64> = fa.iter().zip(&fb).map(|(x, y)| x | y).collect();
    let s = ready_bitmap::decode_split(&hits, &flags, num_bits, gpu);
    assert_eq!(s.common_hits, common);
    assert_eq!(s.invalid, invalid);
}

fuzz_target!(|data: &[u8]| {
    match data.first().map(|b| b % 3) {
        Some(0) => settings(&data[1..]),
        Some(1) => codecs(&data[1..]),
        Some(_) => votes(&data[1..]),
        None => {}
    }
});
