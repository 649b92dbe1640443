//! proxy-wasm's serialized header map, read as bytes.
//!
//! The SDK (proxy-wasm 0.2.2) turns every header name and value into a `String` with
//! `from_utf8(..).unwrap()`: one request header whose value is not UTF-8 (HTTP allows obs-text,
//! and Envoy passes it on) would panic the filter, and a panic aborts the VM. The glue reads the
//! map itself through this instead; it never panics, on any bytes.
//!
//! The format: a u32 count N, then N pairs of u32 (name length, value length), then each name
//! and each value followed by a NUL byte. All integers little-endian.

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

/// The (name, value) pairs of a serialized map; a map that does not parse (the host never sends
/// one) yields the pairs read before the fault.
pub fn deserialize(bytes: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    let n = match u32_at(bytes, 0) {
        Some(n) => n,
        None => return out,
    };
    // Each pair takes at least 8 bytes of sizes and 2 NULs: a count past that is a lie.
    let n = n.min(bytes.len() / 10);
    let mut p = match n.checked_mul(8).and_then(|x| x.checked_add(4)) {
        Some(p) => p,
        None => return out,
    };
    for i in 0..n {
        let (nlen, vlen) = match (u32_at(bytes, 4 + i * 8), u32_at(bytes, 8 + i * 8)) {
            (Some(a), Some(b)) => (a, b),
            _ => break,
        };
        let name = match p.checked_add(nlen).and_then(|end| bytes.get(p..end)) {
            Some(s) => s,
            None => break,
        };
        p += nlen + 1;
        let value = match p.checked_add(vlen).and_then(|end| bytes.get(p..end)) {
            Some(s) => s,
            None => break,
        };
        p += vlen + 1;
        out.push((name.to_vec(), value.to_vec()));
    }
    out
}

#[cfg(test)]
pub fn serialize(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_host_writes_whatever_the_bytes() {
        let pairs: Vec<(&[u8], &[u8])> = vec![(b":path", b"/v1/chat/completions"), (b"x-odd", b"\xff\xfe"), (b"x-infermesh-\xc0", b""), (b"", b"\x00")];
        let got = deserialize(&serialize(&pairs));
        assert_eq!(got, pairs.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect::<Vec<_>>());
        assert!(deserialize(&serialize(&[])).is_empty());
    }

    #[test]
    fn never_panics_on_a_broken_map() {
        let good = serialize(&[(b"a", b"b"), (b"content-type", b"application/json")]);
        for cut in 0..good.len() {
            let got = deserialize(&good[..cut]);
            assert!(got.len() <= 2);
        }
        for bad in [&b""[..], b"\x01", b"\xff\xff\xff\xff", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00"] {
            assert!(deserialize(bad).is_empty(), "{bad:?}");
        }
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut b = good.clone();
            let i = (x as usize) % b.len();
            b[i] = (x >> 32) as u8;
            let _ = deserialize(&b);
        }
    }
}
