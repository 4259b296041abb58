//! A thread's last few packings of activation rows, for kernels that read a block of rows in
//! another layout than the forward prepared them in (AMX's tile steps, the AVX2 token lanes
//! of the 4-bit group formats). Gathering scattered rows costs about as much as the kernel's
//! work on one panel, so a packing pays only when the next panels of the same rows reuse it:
//! each is keyed by the caller's reuse key ([`crate::formats::RowBlock::reuse`]), the layout
//! and the row addresses.
use super::MAX_ROWS;
use crate::pack::AlignedBuf;
use std::cell::RefCell;

/// Packings a thread keeps: the row blocks of an expert with up to 128 rows.
pub const CACHED_PACKINGS: usize = 4;

/// What names one packing: the caller's reuse key (one state of the rows), the layout (the
/// packer and its parameters) and the row addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackingKey {
    reuse: u64,
    layout: [u64; 3],
    rows: [usize; MAX_ROWS],
}

impl PackingKey {
    /// The key of `rows` (1 to [`MAX_ROWS`]) packed in `layout` under reuse key `reuse`.
    pub fn new(reuse: u64, layout: [u64; 3], rows: &[*const u8]) -> PackingKey {
        assert!(
            (1..=MAX_ROWS).contains(&rows.len()),
            "a packing holds 1 to {MAX_ROWS} rows, got {}",
            rows.len()
        );
        let mut addrs = [0usize; MAX_ROWS];
        for (a, &r) in addrs.iter_mut().zip(rows) {
            *a = r as usize;
        }
        PackingKey {
            reuse,
            layout,
            rows: addrs,
        }
    }
}

struct Packing {
    key: Option<PackingKey>,
    buf: AlignedBuf<u8>,
    /// When it was last used (a per-thread counter).
    used: u64,
}

thread_local! {
    static PACKINGS: RefCell<(u64, Vec<Packing>)> = const { RefCell::new((0, Vec::new())) };
}

/// `f(packing)`: this thread's packing of `key` (`len` bytes, 64-byte aligned), made by
/// `pack` into the least recently used slot when the thread holds none under `key`.
///
/// The caller promises that the bytes behind the key's row addresses do not change while its
/// reuse key is in use (rows changed under the same key give the old packing), and that
/// `pack` writes every byte `f` reads. Neither `pack` nor `f` may call this function.
pub fn with_packing<R>(
    key: PackingKey,
    len: usize,
    pack: impl FnOnce(&mut [u8]),
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    PACKINGS.with(|cell| {
        let (clock, cache) = &mut *cell.borrow_mut();
        *clock += 1;
        let slot = match cache.iter().position(|p| p.key == Some(key)) {
            Some(hit) => hit,
            None => {
                let slot = if cache.len() < CACHED_PACKINGS {
                    cache.push(Packing {
                        key: None,
                        buf: AlignedBuf::zeroed(0).expect("an empty buffer"),
                        used: 0,
                    });
                    cache.len() - 1
                } else {
                    (0..cache.len())
                        .min_by_key(|&i| cache[i].used)
                        .expect("a full cache")
                };
                let entry = &mut cache[slot];
                if entry.buf.len() < len {
                    entry.buf = AlignedBuf::zeroed(len).expect("a packed-rows buffer");
                }
                // Forget the old key first: a panicking packer leaves no half-made packing.
                entry.key = None;
                pack(&mut entry.buf.as_mut_slice()[..len]);
                entry.key = Some(key);
                slot
            }
        };
        cache[slot].used = *clock;
        f(&cache[slot].buf.as_slice()[..len])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packing is reused only for the same key, layout and row addresses; the least
    /// recently used one makes room.
    #[test]
    fn packings_are_reused_only_under_the_same_key_layout_and_rows() {
        let (a, b) = ([1u8; 4], [2u8; 4]);
        let rows = [a.as_ptr(), b.as_ptr()];
        let packs = std::cell::Cell::new(0);
        let get = |reuse, layout, rows: &[*const u8], byte: u8| {
            let key = PackingKey::new(reuse, layout, rows);
            with_packing(
                key,
                8,
                |dst| {
                    packs.set(packs.get() + 1);
                    dst.fill(byte);
                },
                |buf| buf[7],
            )
        };
        let key = 1 << 41;
        assert_eq!(get(key, [1, 0, 0], &rows, 10), 10);
        assert_eq!(
            get(key, [1, 0, 0], &rows, 11),
            10,
            "same key: the packing is kept"
        );
        assert_eq!(get(key + 1, [1, 0, 0], &rows, 12), 12, "a new reuse key");
        assert_eq!(get(key, [2, 0, 0], &rows, 13), 13, "another layout");
        assert_eq!(get(key, [1, 0, 0], &rows[..1], 14), 14, "other rows");
        assert_eq!(packs.get(), 4);
        // Four slots: the fifth packing evicts the least recently used, key + 1.
        assert_eq!(get(key, [1, 0, 0], &rows, 15), 10);
        assert_eq!(get(key, [3, 0, 0], &rows, 16), 16);
        assert_eq!(get(key, [1, 0, 0], &rows, 17), 10, "used recently: kept");
        assert_eq!(
            get(key + 1, [1, 0, 0], &rows, 18),
            18,
            "evicted: packed again"
        );
    }

    #[test]
    #[should_panic(expected = "a packing holds 1 to")]
    fn an_empty_block_has_no_key() {
        PackingKey::new(1, [0; 3], &[]);
    }
}
