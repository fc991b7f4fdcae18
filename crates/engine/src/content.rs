//! The content table: each distinct byte string stored once, found by its xxh3-128 key and
//! confirmed by comparing the bytes on every hit (xxh3 collisions can be crafted, so two
//! different strings under one key stay two entries). Entries are reference counted.

use std::collections::HashMap;
use std::mem::size_of;

/// Computes the 128-bit key a byte string is filed under.
pub trait ContentHasher {
    fn key(&self, bytes: &[u8]) -> u128;
}

/// xxh3-128, the table's key.
#[derive(Clone, Copy, Debug, Default)]
pub struct Xxh3;

impl ContentHasher for Xxh3 {
    fn key(&self, bytes: &[u8]) -> u128 {
        xxhash_rust::xxh3::xxh3_128(bytes)
    }
}

/// The xxh3-128 key of `bytes` (what [`ContentTable::intern_keyed`] expects with [`Xxh3`]).
pub fn content_key(bytes: &[u8]) -> u128 {
    Xxh3.key(bytes)
}

/// An entry's index in its table; valid until the entry's last reference is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub u32);

#[derive(Debug)]
struct Entry {
    bytes: Box<[u8]>,
    key: u128,
    refs: u32,
}

/// Why the table refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentError {
    /// no live entry under this handle
    UnknownHandle(Handle),
    /// more entries or references than a `u32` counts
    Full,
}

impl std::fmt::Display for ContentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ContentError::UnknownHandle(h) => write!(f, "no content under handle {}", h.0),
            ContentError::Full => f.write_str("the content table is full"),
        }
    }
}

impl std::error::Error for ContentError {}

/// Distinct byte strings, each stored once.
#[derive(Debug)]
pub struct ContentTable<H = Xxh3> {
    hasher: H,
    /// key -> handles filed under it (more than one only for colliding keys)
    index: HashMap<u128, Vec<u32>>,
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    live: usize,
    content_bytes: usize,
}

impl Default for ContentTable<Xxh3> {
    fn default() -> Self {
        Self::with_hasher(Xxh3)
    }
}

impl ContentTable<Xxh3> {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<H: ContentHasher> ContentTable<H> {
    pub fn with_hasher(hasher: H) -> Self {
        Self {
            hasher,
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            content_bytes: 0,
        }
    }

    /// The key `bytes` is filed under.
    pub fn key(&self, bytes: &[u8]) -> u128 {
        self.hasher.key(bytes)
    }

    /// Store `bytes` (or take one more reference to the equal entry) and return its handle.
    ///
    /// # Errors
    /// [`ContentError::Full`] when a count would overflow; the table is unchanged then.
    pub fn intern(&mut self, bytes: &[u8]) -> Result<Handle, ContentError> {
        let key = self.hasher.key(bytes);
        self.intern_keyed(key, bytes)
    }

    /// [`Self::intern`] with the key already computed (by [`Self::key`]), so hashing a large
    /// body can happen outside a lock. The bytes are compared with every entry under `key`.
    ///
    /// # Errors
    /// [`ContentError::Full`] when a count would overflow; the table is unchanged then.
    pub fn intern_keyed(&mut self, key: u128, bytes: &[u8]) -> Result<Handle, ContentError> {
        if let Some(handle) = self.find_keyed(key, bytes) {
            let entry = self.slots[handle.0 as usize]
                .as_mut()
                .ok_or(ContentError::UnknownHandle(handle))?;
            entry.refs = entry.refs.checked_add(1).ok_or(ContentError::Full)?;
            return Ok(handle);
        }
        let slot = match self.free.last() {
            Some(&slot) => slot,
            None => u32::try_from(self.slots.len()).map_err(|_| ContentError::Full)?,
        };
        // nothing has changed up to here: every fallible step is behind us
        let entry = Entry {
            bytes: bytes.into(),
            key,
            refs: 1,
        };
        if self.free.pop().is_some() {
            self.slots[slot as usize] = Some(entry);
        } else {
            self.slots.push(Some(entry));
        }
        self.index.entry(key).or_default().push(slot);
        self.live += 1;
        self.content_bytes += bytes.len();
        Ok(Handle(slot))
    }

    /// The handle of the entry equal to `bytes`, if any.
    pub fn find(&self, bytes: &[u8]) -> Option<Handle> {
        self.find_keyed(self.hasher.key(bytes), bytes)
    }

    /// [`Self::find`] with the key already computed (by [`Self::key`]).
    pub fn find_keyed(&self, key: u128, bytes: &[u8]) -> Option<Handle> {
        self.index.get(&key)?.iter().copied().find_map(|slot| {
            let entry = self.slots[slot as usize].as_ref()?;
            (*entry.bytes == *bytes).then_some(Handle(slot))
        })
    }

    /// The bytes under `handle`.
    pub fn get(&self, handle: Handle) -> Option<&[u8]> {
        self.entry(handle).map(|e| &*e.bytes)
    }

    /// References held on `handle` (0 when it names no entry).
    pub fn refcount(&self, handle: Handle) -> u32 {
        self.entry(handle).map_or(0, |e| e.refs)
    }

    fn entry(&self, handle: Handle) -> Option<&Entry> {
        self.slots.get(handle.0 as usize)?.as_ref()
    }

    /// Drop one reference; the entry goes when its last one does.
    ///
    /// # Errors
    /// [`ContentError::UnknownHandle`] for a handle naming no entry (nothing changes).
    pub fn release(&mut self, handle: Handle) -> Result<(), ContentError> {
        let slot = self
            .slots
            .get_mut(handle.0 as usize)
            .ok_or(ContentError::UnknownHandle(handle))?;
        let entry = slot.as_mut().ok_or(ContentError::UnknownHandle(handle))?;
        if entry.refs > 1 {
            entry.refs -= 1;
            return Ok(());
        }
        let key = entry.key;
        let size = entry.bytes.len();
        *slot = None;
        if let Some(bucket) = self.index.get_mut(&key) {
            bucket.retain(|&s| s != handle.0);
            if bucket.is_empty() {
                self.index.remove(&key);
            }
        }
        self.free.push(handle.0);
        self.live -= 1;
        self.content_bytes -= size;
        Ok(())
    }

    /// Distinct entries held.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Bytes of content held (each distinct string once).
    pub fn content_bytes(&self) -> usize {
        self.content_bytes
    }

    /// Bytes the table holds on the heap: content plus its own slots and index (the engine's
    /// figure for memory accounting; allocator overhead not included).
    pub fn nbytes(&self) -> usize {
        let slots = self.slots.capacity() * size_of::<Option<Entry>>();
        let free = self.free.capacity() * size_of::<u32>();
        // a hashbrown table: one control byte per bucket beside each (key, bucket) pair
        let index = self.index.capacity() * (size_of::<(u128, Vec<u32>)>() + 1);
        let buckets: usize = self
            .index
            .values()
            .map(|b| b.capacity() * size_of::<u32>())
            .sum();
        self.content_bytes + slots + free + index + buckets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files everything under one key: every lookup is a collision.
    struct Colliding;

    impl ContentHasher for Colliding {
        fn key(&self, _bytes: &[u8]) -> u128 {
            7
        }
    }

    #[test]
    fn equal_bytes_share_one_entry() {
        let mut table = ContentTable::new();
        let a = table.intern(b"hello").unwrap();
        let b = table.intern(b"hello").unwrap();
        let c = table.intern(b"world").unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(table.len(), 2);
        assert_eq!(table.content_bytes(), 10);
        assert_eq!(table.refcount(a), 2);
        assert_eq!(table.get(c), Some(&b"world"[..]));
        assert_eq!(table.find(b"hello"), Some(a));
        assert_eq!(table.find(b"nope"), None);
        assert!(table.nbytes() >= table.content_bytes());
    }

    #[test]
    fn colliding_keys_never_merge_different_bytes() {
        let mut table = ContentTable::with_hasher(Colliding);
        let a = table.intern(b"first").unwrap();
        let b = table.intern(b"second").unwrap();
        assert_ne!(a, b);
        assert_eq!(table.get(a), Some(&b"first"[..]));
        assert_eq!(table.get(b), Some(&b"second"[..]));
        assert_eq!(table.intern(b"second").unwrap(), b);
        assert_eq!(table.len(), 2);
        table.release(a).unwrap();
        assert_eq!(table.find(b"second"), Some(b));
        assert_eq!(table.find(b"first"), None);
    }

    #[test]
    fn a_forced_key_is_confirmed_by_the_bytes() {
        let mut table = ContentTable::new();
        let key = table.key(b"original");
        let a = table.intern_keyed(key, b"original").unwrap();
        // different bytes presented under the same key are a new entry
        let b = table.intern_keyed(key, b"impostor").unwrap();
        assert_ne!(a, b);
        assert_eq!(table.get(a), Some(&b"original"[..]));
        assert_eq!(table.get(b), Some(&b"impostor"[..]));
    }

    #[test]
    fn release_frees_on_the_last_reference_and_reuses_the_slot() {
        let mut table = ContentTable::new();
        let a = table.intern(b"x").unwrap();
        table.intern(b"x").unwrap();
        table.release(a).unwrap();
        assert_eq!(table.get(a), Some(&b"x"[..]));
        table.release(a).unwrap();
        assert_eq!(table.get(a), None);
        assert_eq!(table.len(), 0);
        assert_eq!(table.content_bytes(), 0);
        assert_eq!(
            table.release(a),
            Err(ContentError::UnknownHandle(a)),
            "a released handle stays released"
        );
        let b = table.intern(b"yy").unwrap();
        assert_eq!(b, a, "the free slot is reused");
        assert_eq!(
            table.release(Handle(99)),
            Err(ContentError::UnknownHandle(Handle(99)))
        );
    }
}
