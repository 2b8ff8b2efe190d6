//! The negotiation wire format and the offline plan file, on arbitrary bytes: decoding never
//! panics, and whatever decodes re-encodes to exactly the same bytes (the format is canonical,
//! so nothing a peer or a plan file sends is read two ways). Each input is also tried behind
//! each format's magic tag, so that the fuzzer reaches past the tag checks at once.
#![no_main]

use ferrovod::negotiate::plan::Plan;
use ferrovod::negotiate::wire;
use libfuzzer_sys::fuzz_target;

const REQUESTS: [u8; 4] = 0x4656_5251u32.to_le_bytes();
const RESPONSES: [u8; 4] = 0x4656_5253u32.to_le_bytes();
const PLAN: &[u8] = b"FVPLAN01";

fn check(data: &[u8]) {
    if let Ok(list) = wire::decode_requests(data) {
        assert_eq!(wire::encode_requests(&list), data);
    }
    if let Ok(list) = wire::decode_responses(data) {
        assert_eq!(wire::encode_responses(&list), data);
    }
    if let Ok(plan) = Plan::decode(data) {
        assert_eq!(plan.encode(), data);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    for magic in [&REQUESTS[..], &RESPONSES[..], PLAN] {
        check(&[magic, data].concat());
    }
});
