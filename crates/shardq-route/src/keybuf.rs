//! Joins prefixes and one key into byte strings without allocating for short
//! keys and without copying the key again for each prefix. Rendezvous hashes
//! `"{name}:{key}"` once per shard per lookup, so an allocation or a fresh
//! buffer per shard would dominate the cost of routing.

/// Room before the key plus the key up to this many bytes live on the stack
/// in a small buffer (cheap to zero on every lookup: most tenant keys and
/// shard names are short)...
const SMALL_BYTES: usize = 96;
/// ...or in a larger one, before falling back to the heap.
const STACK_BYTES: usize = 320;

/// A key stored after `room` spare bytes, so any prefix of at most `room`
/// bytes is joined in front of it by copying only the prefix.
pub(crate) struct KeyBuf<'a> {
    buf: &'a mut [u8],
    room: usize,
}

impl KeyBuf<'_> {
    /// `prefix ++ key`. `prefix` must fit the room given to [`with_key`].
    #[inline]
    pub(crate) fn joined(&mut self, prefix: &[u8]) -> &[u8] {
        let start = self.room - prefix.len();
        self.buf[start..self.room].copy_from_slice(prefix);
        &self.buf[start..]
    }
}

/// Calls `f` with `key` placed after `room` spare bytes.
#[inline]
pub(crate) fn with_key<R>(room: usize, key: &[u8], f: impl FnOnce(&mut KeyBuf<'_>) -> R) -> R {
    let len = room + key.len();
    if len <= SMALL_BYTES {
        let mut stack = [0u8; SMALL_BYTES];
        stack[room..len].copy_from_slice(key);
        f(&mut KeyBuf {
            buf: &mut stack[..len],
            room,
        })
    } else if len <= STACK_BYTES {
        let mut stack = [0u8; STACK_BYTES];
        stack[room..len].copy_from_slice(key);
        f(&mut KeyBuf {
            buf: &mut stack[..len],
            room,
        })
    } else {
        let mut heap = vec![0u8; len];
        heap[room..].copy_from_slice(key);
        f(&mut KeyBuf {
            buf: &mut heap,
            room,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_short_and_long_keys() {
        for key_len in [0, 1, 90, 91, 92, 200, 314, 315, 316, 1000] {
            let key: Vec<u8> = (0..key_len).map(|i| i as u8).collect();
            with_key(5, &key, |kb| {
                for prefix in [&b""[..], b"a:", b"abcd:"] {
                    let want: Vec<u8> = prefix.iter().chain(&key).copied().collect();
                    assert_eq!(
                        kb.joined(prefix),
                        &want[..],
                        "key_len={key_len} prefix={prefix:?}"
                    );
                }
            });
        }
    }
}
