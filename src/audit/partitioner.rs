//! The partition a record key belongs on: Kafka's Java producer's default partitioner for keyed records,
//! which librdkafka's `murmur2_random` (outboxd's producer setting) reproduces. Pure.

/// Kafka's `Utils.murmur2` (seed 0x9747b28c), as a signed 32-bit value.
pub fn murmur2(key: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ key.len() as u32;
    let mut chunks = key.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `partitions` a record keyed `key` is written to (`partitions` > 0).
pub fn partition_of(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_kafkas_own_test_vectors() {
        // org.apache.kafka.common.utils.UtilsTest#testMurmur2
        for (key, hash) in [
            (&b"21"[..], -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ] {
            assert_eq!(murmur2(key), hash, "{}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn a_partition_is_never_negative() {
        for key in [&b"21"[..], b"foobar", b"abc", b""] {
            let partition = partition_of(key, 3);
            assert!((0..3).contains(&partition), "{partition}");
        }
    }
}
