//! Joins a prefix and a key into one byte string without allocating for
//! short keys. Rendezvous hashes `"{name}:{key}"` once per shard per lookup,
//! so an allocation here would dominate the cost of routing.

/// Keys plus prefix up to this many bytes are joined on the stack.
const STACK_BYTES: usize = 256;

/// Calls `f` with `prefix ++ key`.
#[inline]
pub(crate) fn with_joined<R>(prefix: &[u8], key: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    let len = prefix.len() + key.len();
    if len <= STACK_BYTES {
        let mut buf = [0u8; STACK_BYTES];
        buf[..prefix.len()].copy_from_slice(prefix);
        buf[prefix.len()..len].copy_from_slice(key);
        f(&buf[..len])
    } else {
        let mut buf = Vec::with_capacity(len);
        buf.extend_from_slice(prefix);
        buf.extend_from_slice(key);
        f(&buf)
    }
}
