//! The byte level of the JSON scanner: where a run of plain string bytes ends (the next `"`,
//! `\` or control byte), whether a byte ≥ 0x80 came before it, and how many characters a run
//! with such bytes holds. The grammar is json_scan.rs's, the field walk body.rs's.
//!
//! A run is found 16 bytes a step where the target has vectors (Wasm SIMD in the filter, SSE2
//! natively, so the tests run the same loop), 64 a step while no stop is in sight, and natively
//! 64 a step in AVX2 where the CPU has it; else two words a step (SWAR). A run of ASCII is
//! counted by its length alone; only a run with other bytes is UTF-8-validated and its
//! characters counted (bytes that are not 0b10xxxxxx continuation bytes, a word at a time).

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Bit 7 of a byte of the result is set where `w` has a byte that ends a run of plain string
/// bytes: `"`, `\` or a control byte (< 0x20). The lowest set bit is exact; bits above it may be
/// false positives (a borrow runs up from the first match), so only the lowest is used.
/// Flipping bit 1 maps `"` (0x22) to 0x20 and keeps control bytes below 0x20, so one
/// "byte < 0x21" test finds both; a second finds `\`.
#[inline(always)]
fn stops(w: u64) -> u64 {
    let ctrl_or_quote = w ^ (ONES * 0x02);
    let backslash = w ^ (ONES * u64::from(b'\\'));
    // Bytes ≥ 0x80 have bit 7 set in all three words: `& !w` drops them.
    (ctrl_or_quote.wrapping_sub(ONES * 0x21) | backslash.wrapping_sub(ONES)) & !w & HIGH
}

/// The index of the first `"`, `\` or control byte at or after `from` (`b.len()` if none), and,
/// when `HIGH_BYTES`, whether a byte ≥ 0x80 came before it.
#[inline(always)]
pub(crate) fn find_stop<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    #[cfg(any(target_arch = "wasm32", target_arch = "x86_64"))]
    return find_stop_vectors::<HIGH_BYTES>(b, from);
    #[cfg(not(any(target_arch = "wasm32", target_arch = "x86_64")))]
    return find_stop_words::<HIGH_BYTES>(b, from);
}

/// `find_stop` with vectors: one 16-byte block first (most strings are keys and short values),
/// then 64 bytes a step while no stop is in them ([`skip_quads`]: one branch per 64 bytes), then
/// 16 bytes a step, per block a bit per byte that is a stop and a bit per byte ≥ 0x80
/// ([`masks16`]); fewer than 16 bytes left go to the word scan.
#[cfg(any(target_arch = "wasm32", target_arch = "x86_64"))]
#[cfg_attr(target_arch = "wasm32", target_feature(enable = "simd128"))]
fn find_stop_vectors<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    let mut at = from;
    let mut high = 0u32;
    if let Some(block) = b.get(from..from + 16) {
        let (stop, block_high) = masks16(block);
        if stop != 0 {
            let k = stop.trailing_zeros();
            return (at + k as usize, HIGH_BYTES && block_high & ((1u32 << k) - 1) != 0);
        }
        high = block_high;
        at += 16;
    }
    let (quads_end, quads_high) = skip_quads::<HIGH_BYTES>(b, at);
    at = quads_end;
    high |= u32::from(quads_high);
    let rest = b.get(at..).unwrap_or(&[]);
    let mut blocks = rest.chunks_exact(16);
    for block in &mut blocks {
        let (stop, block_high) = masks16(block);
        if stop != 0 {
            let k = stop.trailing_zeros();
            // Only the bytes before the stop count.
            return (at + k as usize, HIGH_BYTES && (high | (block_high & ((1u32 << k) - 1))) != 0);
        }
        if HIGH_BYTES {
            high |= block_high;
        }
        at += 16;
    }
    let (end, tail_high) = find_stop_words::<HIGH_BYTES>(b, at);
    (end, HIGH_BYTES && (high != 0 || tail_high))
}

/// From `from`, past every whole 64 bytes that hold no stop: where the first 64 with one (or
/// the last fewer than 64) begin, and, when `HIGH_BYTES`, whether the bytes passed had one ≥ 0x80.
#[cfg(target_arch = "wasm32")]
#[target_feature(enable = "simd128")]
fn skip_quads<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    use core::arch::wasm32::*;
    let (mut at, mut high) = (from, u8x16_splat(0));
    let (flip, below, backslash) = (u8x16_splat(0x02), u8x16_splat(0x21), u8x16_splat(b'\\'));
    for quad in b.get(from..).unwrap_or(&[]).chunks_exact(64) {
        let mut stop = u8x16_splat(0);
        let mut quad_high = u8x16_splat(0);
        for block in quad.chunks_exact(16) {
            // SAFETY: 16 readable bytes (a chunk of a 64-byte chunk); v128_load reads unaligned.
            let v = unsafe { v128_load(block.as_ptr() as *const v128) };
            // `"` ^ 2 = 0x20 and control bytes stay below 0x21 (as in `stops`).
            stop = v128_or(stop, v128_or(u8x16_lt(v128_xor(v, flip), below), u8x16_eq(v, backslash)));
            quad_high = v128_or(quad_high, v);
        }
        if v128_any_true(stop) {
            break;
        }
        if HIGH_BYTES {
            high = v128_or(high, quad_high);
        }
        at += 64;
    }
    (at, HIGH_BYTES && u8x16_bitmask(high) != 0)
}

/// The SSE2 form of [`skip_quads`], or AVX2 where the CPU has it (checked once; the AVX2 loop
/// is a function of its own, so it is not inlined into SSE2 code).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn skip_quads<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    if b.len().saturating_sub(from) < 64 {
        return (from, false);
    }
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { skip_quads_avx2::<HIGH_BYTES>(b, from) };
    }
    skip_quads_sse2::<HIGH_BYTES>(b, from)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn skip_quads_sse2<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    use core::arch::x86_64::*;
    let (mut at, mut high) = (from, false);
    // SAFETY: 16 readable bytes per chunk (of 64), unaligned loads; SSE2 is baseline on x86_64.
    unsafe {
        let (flip, below, backslash) = (_mm_set1_epi8(0x02), _mm_set1_epi8(0x20), _mm_set1_epi8(b'\\' as i8));
        for quad in b.get(from..).unwrap_or(&[]).chunks_exact(64) {
            let (mut stop, mut quad_high) = (_mm_setzero_si128(), _mm_setzero_si128());
            for block in quad.chunks_exact(16) {
                let v = _mm_loadu_si128(block.as_ptr() as *const __m128i);
                // Unsigned v ^ 2 < 0x21 as min(v ^ 2, 0x20) == v ^ 2: `"` and control bytes.
                let x = _mm_xor_si128(v, flip);
                stop = _mm_or_si128(stop, _mm_or_si128(_mm_cmpeq_epi8(_mm_min_epu8(x, below), x), _mm_cmpeq_epi8(v, backslash)));
                quad_high = _mm_or_si128(quad_high, v);
            }
            if _mm_movemask_epi8(stop) != 0 {
                break;
            }
            high |= HIGH_BYTES && _mm_movemask_epi8(quad_high) != 0;
            at += 64;
        }
    }
    (at, high)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn skip_quads_avx2<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    use core::arch::x86_64::*;
    let (mut at, mut high) = (from, _mm256_setzero_si256());
    let (flip, below, backslash) = (_mm256_set1_epi8(0x02), _mm256_set1_epi8(0x20), _mm256_set1_epi8(b'\\' as i8));
    for quad in b.get(from..).unwrap_or(&[]).chunks_exact(64) {
        // SAFETY: 64 readable bytes; unaligned loads.
        let v0 = _mm256_loadu_si256(quad.as_ptr() as *const __m256i);
        let v1 = _mm256_loadu_si256(quad.as_ptr().add(32) as *const __m256i);
        let (x0, x1) = (_mm256_xor_si256(v0, flip), _mm256_xor_si256(v1, flip));
        let s0 = _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_min_epu8(x0, below), x0), _mm256_cmpeq_epi8(v0, backslash));
        let s1 = _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_min_epu8(x1, below), x1), _mm256_cmpeq_epi8(v1, backslash));
        let stop = _mm256_or_si256(s0, s1);
        if _mm256_testz_si256(stop, stop) == 0 {
            break;
        }
        if HIGH_BYTES {
            high = _mm256_or_si256(high, _mm256_or_si256(v0, v1));
        }
        at += 64;
    }
    (at, HIGH_BYTES && _mm256_movemask_epi8(high) != 0)
}

/// For 16 bytes: (a bit per `"`, `\` or control byte, a bit per byte ≥ 0x80), byte 0 in bit 0.
#[cfg(target_arch = "wasm32")]
#[target_feature(enable = "simd128")]
#[inline]
fn masks16(block: &[u8]) -> (u32, u32) {
    use core::arch::wasm32::*;
    if block.len() < 16 {
        return (0, 0);
    }
    // SAFETY: 16 readable bytes (checked above); v128_load reads unaligned.
    let v = unsafe { v128_load(block.as_ptr() as *const v128) };
    let quote_or_backslash = v128_or(u8x16_eq(v, u8x16_splat(b'"')), u8x16_eq(v, u8x16_splat(b'\\')));
    let stop = v128_or(quote_or_backslash, u8x16_lt(v, u8x16_splat(0x20)));
    (u8x16_bitmask(stop) as u32, u8x16_bitmask(v) as u32)
}

/// The SSE2 twin of the Wasm `masks16` (SSE2 is part of x86_64): what `cargo test` runs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn masks16(block: &[u8]) -> (u32, u32) {
    use core::arch::x86_64::*;
    if block.len() < 16 {
        return (0, 0);
    }
    // SAFETY: 16 readable bytes (checked above), an unaligned load; SSE2 is baseline on x86_64.
    unsafe {
        let v = _mm_loadu_si128(block.as_ptr() as *const __m128i);
        let quote_or_backslash = _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)), _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8)));
        // Unsigned v < 0x20 as min(v, 0x1f) == v.
        let control = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x1f)), v);
        let stop = _mm_or_si128(quote_or_backslash, control);
        (_mm_movemask_epi8(stop) as u32, _mm_movemask_epi8(v) as u32)
    }
}

/// `find_stop` two words per step (SWAR); also the tail of the vector scan.
#[inline(always)]
fn find_stop_words<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    let rest = b.get(from..).unwrap_or(&[]);
    let mut high = 0u64;
    let mut at = from;
    let mut pairs = rest.chunks_exact(16);
    for pair in &mut pairs {
        let (lo, hi) = pair.split_at(8);
        let w0 = u64::from_le_bytes(lo.try_into().unwrap_or([0; 8]));
        let w1 = u64::from_le_bytes(hi.try_into().unwrap_or([0; 8]));
        let (m0, m1) = (stops(w0), stops(w1));
        if m0 | m1 != 0 {
            let (w, m, at) = if m0 != 0 { (w0, m0, at) } else { (w1, m1, at + 8) };
            if HIGH_BYTES && m0 == 0 {
                high |= w0;
            }
            return stop_in(w, m, at, high);
        }
        if HIGH_BYTES {
            high |= w0 | w1;
        }
        at += 16;
    }
    let tail = pairs.remainder();
    if tail.len() >= 8 {
        let w = u64::from_le_bytes(tail.get(..8).and_then(|x| x.try_into().ok()).unwrap_or([0; 8]));
        let m = stops(w);
        if m != 0 {
            return stop_in(w, m, at, high);
        }
        high |= w;
        at += 8;
    }
    for &c in tail.get(8..).unwrap_or(tail) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        high |= u64::from(c);
        at += 1;
    }
    (at, high & HIGH != 0)
}

/// The stop in word `w` (at `at`, `m = stops(w) != 0`), with the bytes ≥ 0x80 seen before it.
#[inline(always)]
fn stop_in(w: u64, m: u64, at: usize, high: u64) -> (usize, bool) {
    let k = m.trailing_zeros() as usize / 8;
    // Only the k bytes before the stop count (little-endian: the low ones).
    let before = w & (1u64 << (8 * k)).wrapping_sub(1);
    (at + k, (high | before) & HIGH != 0)
}

/// Characters of a run of string bytes that has bytes ≥ 0x80, and how many bytes at its end
/// (0-3) begin a character that the run's end cuts: `None` if it is not UTF-8. A cut is only
/// valid where a segment of a body ends inside a string (json_scan.rs checks the character
/// whole there); a cut character counts as one.
pub(crate) fn utf8_chars(run: &[u8]) -> Option<(u64, usize)> {
    let cut = match std::str::from_utf8(run) {
        Ok(_) => 0,
        Err(e) if e.error_len().is_none() => run.len() - e.valid_up_to(),
        Err(_) => return None,
    };
    let mut continuation = 0u64;
    let mut words = run.chunks_exact(8);
    for chunk in &mut words {
        let w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        // 0b10xxxxxx: bit 7 set and bit 6 (shifted up into bit 7's place) clear.
        continuation += u64::from((w & !(w << 1) & HIGH).count_ones());
    }
    continuation += words.remainder().iter().filter(|&&c| c & 0xC0 == 0x80).count() as u64;
    Some(((run.len() as u64).saturating_sub(continuation), cut))
}

/// The length of the UTF-8 character a lead byte begins (1 for any other byte).
pub(crate) fn utf8_width(lead: u8) -> usize {
    match lead {
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_scan_finds_the_first_stop_byte_as_a_byte_loop_does() {
        let mut x = 0x9e3779b97f4a7c15u64;
        let alphabet = [b'a', b' ', b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xa2, 0xdc, 0xc3, 0xff];
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 200) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|j| {
                    let r = x.rotate_left(j as u32 * 5);
                    if r % 3 == 0 { alphabet[(r >> 8) as usize % alphabet.len()] } else { b'a' }
                })
                .collect();
            let from = (x >> 32) as usize % (len + 1);
            let stop = (from..len).find(|&j| matches!(bytes[j], b'"' | b'\\' | 0..=0x1f)).unwrap_or(len);
            let high = bytes[from..stop].iter().any(|&c| c >= 0x80);
            assert_eq!(find_stop::<true>(&bytes, from), (stop, high), "{:?} from {}", bytes, from);
            assert_eq!(find_stop::<false>(&bytes, from).0, stop);
            assert_eq!(find_stop_words::<true>(&bytes, from), (stop, high), "{:?} from {}", bytes, from);
            assert_eq!(find_stop_words::<false>(&bytes, from).0, stop);
        }
        // Long plain runs (the 64-byte steps): one stop and one byte ≥ 0x80 anywhere.
        for len in [63usize, 64, 65, 80, 127, 128, 129, 200] {
            for stop_at in (0..=len).step_by(3) {
                for high_at in [None, Some(0), Some(stop_at.saturating_sub(1)), Some(stop_at + 1), Some(len / 2)] {
                    let mut bytes = vec![b'a'; len];
                    if let Some(h) = high_at.filter(|&h| h < len) {
                        bytes[h] = 0xc3;
                    }
                    if stop_at < len {
                        bytes[stop_at] = if stop_at % 2 == 0 { b'"' } else { 0x1f };
                    }
                    for from in [0, 1, 17].into_iter().filter(|&f| f <= len) {
                        let stop = (from..len).find(|&j| matches!(bytes[j], b'"' | b'\\' | 0..=0x1f)).unwrap_or(len);
                        let high = bytes[from..stop].iter().any(|&c| c >= 0x80);
                        assert_eq!(find_stop::<true>(&bytes, from), (stop, high), "len {len} stop {stop_at} high {high_at:?} from {from}");
                        assert_eq!(find_stop::<false>(&bytes, from).0, stop);
                    }
                }
            }
        }
        for c in 0..=255u8 {
            for k in 0..8 {
                let mut w = *b"aaaaaaaa";
                w[k] = c;
                let m = stops(u64::from_le_bytes(w));
                let want = matches!(c, b'"' | b'\\' | 0..=0x1f);
                assert_eq!(m != 0 && m.trailing_zeros() as usize / 8 == k, want, "byte {c:#x} at {k}");
            }
        }
    }

    #[test]
    fn every_byte_value_stops_the_wide_steps_or_not_as_a_byte_loop_does() {
        // Each byte value at each position of a 64-byte step, after a first block and before a tail.
        for c in 0..=255u8 {
            for at in [16usize, 17, 47, 48, 79, 80, 143] {
                let mut bytes = vec![b'a'; 160];
                bytes[at] = c;
                let stops = matches!(c, b'"' | b'\\' | 0..=0x1f);
                let want = if stops { (at, false) } else { (160, c >= 0x80) };
                assert_eq!(find_stop::<true>(&bytes, 0), want, "byte {c:#x} at {at}");
                assert_eq!(find_stop::<false>(&bytes, 0).0, want.0, "byte {c:#x} at {at}");
                // Both native forms of the 64-byte steps, whichever this CPU runs.
                #[cfg(target_arch = "x86_64")]
                for from in [0usize, 16, 17] {
                    let sse2 = (skip_quads_sse2::<true>(&bytes, from), skip_quads_sse2::<false>(&bytes, from).0);
                    let full_end = from + (160 - from) / 64 * 64;
                    let quads_end = if stops && at >= from { full_end.min(from + (at - from) / 64 * 64) } else { full_end };
                    let passed_high = !stops && c >= 0x80 && at >= from && at < quads_end;
                    assert_eq!(sse2, ((quads_end, passed_high), quads_end), "sse2: byte {c:#x} at {at} from {from}");
                    if std::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU has AVX2 (checked).
                        let avx2 = unsafe { (skip_quads_avx2::<true>(&bytes, from), skip_quads_avx2::<false>(&bytes, from).0) };
                        assert_eq!(avx2, sse2, "avx2: byte {c:#x} at {at} from {from}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_character_cut_at_the_end_of_a_run_is_told_apart_from_invalid_bytes() {
        let e_acute = "é".as_bytes();
        let grin = "😀".as_bytes();
        assert_eq!(utf8_chars(b"ab\xc3\xa9"), Some((3, 0)));
        assert_eq!(utf8_chars(&[b'a', e_acute[0]]), Some((2, 1)));
        assert_eq!(utf8_chars(&grin[..3]), Some((1, 3)));
        assert_eq!(utf8_chars(b"a\xff"), None);
        assert_eq!(utf8_chars(b"\xc3a"), None);
        assert_eq!((utf8_width(e_acute[0]), utf8_width(grin[0]), utf8_width("中".as_bytes()[0]), utf8_width(b'a')), (2, 4, 3, 1));
    }
}
