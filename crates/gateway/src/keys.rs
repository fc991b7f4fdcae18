//! The session keys the data plane checks a call's key against, kept current by the control
//! plane (sessions created, reopened, deleted).
//!
//! A key is found by a hash under a per-table random seed (so a lookup's timing says nothing
//! the caller can steer about the stored keys' text) and confirmed by a constant-time
//! comparison of the bytes, as `hmac.compare_digest` does in the Python server.

use std::any::Any;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// What the control plane attaches to a key, opaque here: the session object itself, which
/// a call of the direct lane holds from its arrival to its answer (a session deleted
/// meanwhile is still the one the call was made in), and whether the session is still
/// there (`alive`: one flag per key, whatever handle it was given last; cleared when the
/// key is removed, see `ledger::Ledger::retire`).
#[derive(Clone)]
pub struct Handle {
    pub object: Arc<dyn Any + Send + Sync>,
    pub alive: Arc<AtomicBool>,
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Handle")
    }
}

/// The session a key opens: its id, and the control plane's handle of it (none: its calls
/// are prepared by the control plane, never sent by the direct lane); `alive` is the flag
/// every handle of the key shares.
#[derive(Clone, Debug)]
pub struct Opened {
    pub session: Arc<str>,
    pub handle: Option<Handle>,
    alive: Arc<AtomicBool>,
}

/// The keys under one hash, each with the session it opens.
type Bucket = Vec<(Box<[u8]>, Opened)>;

/// Keys (UTF-8 bytes, as the Python server encodes them) to the session each opens.
#[derive(Default)]
pub struct KeyTable {
    seed: RandomState,
    buckets: HashMap<u64, Bucket>,
    len: usize,
}

/// Whether `a` equals `b`, in a time that depends on their lengths only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl KeyTable {
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&self, key: &[u8]) -> u64 {
        self.seed.hash_one(key)
    }

    /// Let `key` open `session`, with the control plane's `object` of it (a key already
    /// there now opens this session, its `alive` flag kept).
    pub fn insert(
        &mut self,
        key: &[u8],
        session: &str,
        object: Option<Arc<dyn Any + Send + Sync>>,
    ) {
        let slot = self.slot(key);
        let bucket = self.buckets.entry(slot).or_default();
        let found = bucket.iter_mut().find(|(k, _)| constant_time_eq(k, key));
        let alive = found.as_ref().map_or_else(
            || Arc::new(AtomicBool::new(true)),
            |(_, opened)| opened.alive.clone(),
        );
        let opened = Opened {
            session: session.into(),
            handle: object.map(|object| Handle {
                object,
                alive: alive.clone(),
            }),
            alive,
        };
        if let Some(entry) = found {
            entry.1 = opened;
            return;
        }
        bucket.push((key.into(), opened));
        self.len += 1;
    }

    /// Forget `key`: the `alive` flag of the session it opened, to be cleared (none: the
    /// key was not there).
    pub fn remove(&mut self, key: &[u8]) -> Option<Arc<AtomicBool>> {
        let slot = self.slot(key);
        let bucket = self.buckets.get_mut(&slot)?;
        let at = bucket.iter().position(|(k, _)| constant_time_eq(k, key));
        let removed = at.map(|at| bucket.remove(at).1.alive);
        if bucket.is_empty() {
            self.buckets.remove(&slot);
        }
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    /// The session `key` opens.
    pub fn lookup(&self, key: &[u8]) -> Option<Opened> {
        let bucket = self.buckets.get(&self.slot(key))?;
        let mut found = None;
        // every key of the bucket is compared: which one matched does not show in the time
        for (k, session) in bucket {
            if constant_time_eq(k, key) {
                found = Some(session.clone());
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_opens_its_session_only() {
        let mut table = KeyTable::new();
        table.insert(b"key-a", "a", None);
        table.insert(b"key-b", "b", None);
        assert_eq!(
            table.lookup(b"key-a").map(|o| o.session).as_deref(),
            Some("a")
        );
        assert_eq!(
            table.lookup(b"key-b").map(|o| o.session).as_deref(),
            Some("b")
        );
        assert_eq!(table.lookup(b"key-").map(|o| o.session), None);
        assert_eq!(table.lookup(b"key-a ").map(|o| o.session), None);
        assert_eq!(table.lookup(b"a").map(|o| o.session), None);
        assert_eq!(table.lookup(b"").map(|o| o.session), None);
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn removed_keys_open_nothing_and_reinserted_keys_move() {
        let mut table = KeyTable::new();
        table.insert(b"k", "a", None);
        table.insert(b"k", "b", None);
        assert_eq!(table.len(), 1);
        assert_eq!(table.lookup(b"k").map(|o| o.session).as_deref(), Some("b"));
        assert!(table.remove(b"k").is_some());
        assert!(table.remove(b"k").is_none());
        assert_eq!(table.lookup(b"k").map(|o| o.session), None);
        assert!(table.is_empty());
    }

    #[test]
    fn constant_time_comparison_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"\x00", b"\x01"));
    }

    #[test]
    fn many_keys_stay_apart() {
        let mut table = KeyTable::new();
        for i in 0..2000 {
            table.insert(format!("key-{i}").as_bytes(), &format!("s{i}"), None);
        }
        for i in 0..2000 {
            let found = table
                .lookup(format!("key-{i}").as_bytes())
                .map(|o| o.session);
            assert_eq!(found.as_deref(), Some(format!("s{i}").as_str()));
        }
        assert_eq!(table.lookup(b"key-2000").map(|o| o.session), None);
    }
}
