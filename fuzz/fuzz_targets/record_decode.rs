//! Fuzz target: the log record decoder and the segment header check must
//! never panic on any bytes, and whatever decodes must encode back to the
//! same record with the same size (a hole's body is zeroed on encode, so it
//! is compared by size only).

#![no_main]

use libfuzzer_sys::fuzz_target;
use shardq_fs::record::{check_segment_header, decode, encode, encode_hole, Record};

fuzz_target!(|data: &[u8]| {
    let _ = check_segment_header(data);
    // Random bytes rarely carry a valid checksum: also frame them as the
    // body of a record with a correct length and checksum, so the field
    // decoder behind the checksum is reached.
    if !data.is_empty() && data.len() <= 1 << 16 {
        let len = (data.len() as u32).to_le_bytes();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&len), data);
        let mut framed = Vec::with_capacity(data.len() + 8);
        framed.extend_from_slice(&len);
        framed.extend_from_slice(&crc.to_le_bytes());
        framed.extend_from_slice(data);
        check_roundtrip(&framed);
    }
    check_roundtrip(data);
});

fn check_roundtrip(data: &[u8]) {
    // Walk the bytes as a reader walks a segment: record after record
    // until the first one that does not decode.
    let mut p = 0usize;
    while p < data.len() {
        let Ok((rec, n)) = decode(&data[p..]) else {
            break;
        };
        assert!(n > 0 && p + n <= data.len(), "a record of {n} bytes at {p}");
        let mut again = Vec::new();
        match rec {
            Record::Hole { bytes } => {
                assert_eq!(bytes as usize, n);
                again = encode_hole(n);
            }
            ref other => encode(&mut again, other),
        }
        assert_eq!(again.len(), n, "re-encoded size of {rec:?}");
        let (back, m) = decode(&again).expect("an encoded record decodes");
        assert_eq!((back, m), (rec, n));
        p += n;
    }
}
