//! An insertion-ordered map from 64-bit keys to values, held compactly, and the content
//! tables' index built on it.
//!
//! A content table (a graph's blob table, an in-process store) files each content under a
//! 64-bit key, the first 8 bytes of its digest. Kept in a Python `dict`, each key is an int
//! object of its own (36 bytes) beside the dict's entry (24 bytes and its share of the
//! index); here an entry is the key and the value side by side in one vector, in insertion
//! order, and the hash table holds only a position per slot (2 bytes while positions fit,
//! else 4): about 20 to 30 bytes an entry with the vector's and the table's spare room
//! counted. Replacing a key's value keeps its position, as a `dict` does; removing the key
//! set last (a rolled-back addition) costs constant time, any other key time linear in the
//! entries.
//!
//! [`KeyNumbers`] is such an index of numbers (keys to the numbers of the contents whose
//! digests begin with them), several to a key where contents share one.

use std::collections::HashMap;
use std::mem::size_of;

/// Slots hold an entry's position plus one; 0 marks an empty slot.
const EMPTY: u32 = 0;
/// The table grows when it would be more than 3/4 full (linear probing stays short).
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;
/// The smallest table (a power of two).
const MIN_SLOTS: usize = 8;
/// The fewest entries room is made for at once.
const MIN_ENTRIES: usize = 4;

/// Too many entries for a `u32` position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the key index holds 2**32 - 1 entries, its most")
    }
}

impl std::error::Error for Full {}

/// The hash table's slots: each an entry's position plus one (0: empty), two bytes each
/// while the positions fit, four after.
#[derive(Debug, Clone)]
enum Slots {
    Narrow(Vec<u16>),
    Wide(Vec<u32>),
}

impl Slots {
    /// `size` empty slots, wide enough for positions up to `entries`.
    fn empty(size: usize, entries: usize) -> Self {
        if entries < usize::from(u16::MAX) {
            Slots::Narrow(vec![0; size])
        } else {
            Slots::Wide(vec![EMPTY; size])
        }
    }

    fn len(&self) -> usize {
        match self {
            Slots::Narrow(slots) => slots.len(),
            Slots::Wide(slots) => slots.len(),
        }
    }

    fn get(&self, at: usize) -> u32 {
        match self {
            Slots::Narrow(slots) => u32::from(slots[at]),
            Slots::Wide(slots) => slots[at],
        }
    }

    /// Set slot `at` (the caller made the slots wide enough for `slot`).
    fn set(&mut self, at: usize, slot: u32) {
        match self {
            Slots::Narrow(slots) => slots[at] = slot as u16,
            Slots::Wide(slots) => slots[at] = slot,
        }
    }

    fn nbytes(&self) -> usize {
        match self {
            Slots::Narrow(slots) => slots.capacity() * size_of::<u16>(),
            Slots::Wide(slots) => slots.capacity() * size_of::<u32>(),
        }
    }
}

/// Keys to values, iterated in the order the keys were first inserted.
#[derive(Debug, Clone)]
pub struct KeyIndex<V> {
    entries: Vec<(u64, V)>,
    /// Open addressing with linear probing: a power-of-two number of slots, or none yet.
    slots: Slots,
}

impl<V> Default for KeyIndex<V> {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a key's probe sequence starts. Keys are mostly digest bytes already, but a file
/// may name any key: the multiply spreads keys that differ only in their high bits.
fn home(key: u64, mask: usize) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask
}

impl<V> KeyIndex<V> {
    /// An empty index; it allocates nothing until the first insertion.
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
            slots: Slots::Narrow(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The slot holding `key`'s entry, or the empty slot where it would go.
    fn find_slot(&self, key: u64) -> (usize, Option<usize>) {
        let mask = self.slots.len() - 1;
        let mut at = home(key, mask);
        loop {
            let slot = self.slots.get(at);
            if slot == EMPTY {
                return (at, None);
            }
            let position = (slot - 1) as usize;
            if self.entries[position].0 == key {
                return (at, Some(position));
            }
            at = (at + 1) & mask;
        }
    }

    pub fn get(&self, key: u64) -> Option<&V> {
        if self.slots.len() == 0 {
            return None;
        }
        self.find_slot(key)
            .1
            .map(|position| &self.entries[position].1)
    }

    /// The value under `key`, to change in place.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if self.slots.len() == 0 {
            return None;
        }
        self.find_slot(key)
            .1
            .map(|position| &mut self.entries[position].1)
    }

    pub fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// Set `key`'s value, returning the one it replaces (the key keeps its position) or None
    /// (the key goes last). Nothing changes when it fails.
    ///
    /// # Errors
    /// [`Full`] when the index already holds `u32::MAX - 1` entries.
    pub fn insert(&mut self, key: u64, value: V) -> Result<Option<V>, Full> {
        if self.slots.len() != 0 {
            if let (_, Some(position)) = self.find_slot(key) {
                return Ok(Some(std::mem::replace(
                    &mut self.entries[position].1,
                    value,
                )));
            }
        }
        if self.entries.len() >= (u32::MAX - 1) as usize {
            return Err(Full);
        }
        if (self.entries.len() + 1) * LOAD_DEN > self.slots.len() * LOAD_NUM {
            self.grow();
        } else if self.entries.len() + 1 >= usize::from(u16::MAX) {
            if let Slots::Narrow(_) = self.slots {
                self.place_all(self.slots.len()); // its position needs wide slots
            }
        }
        if self.entries.len() == self.entries.capacity() {
            // by a quarter, not double: a graph's index of a few dozen turns keeps less
            // spare room (one per capture session, thousands in a server)
            let more = (self.entries.len() / 4).max(MIN_ENTRIES);
            self.entries.reserve_exact(more);
        }
        self.entries.push((key, value));
        let (at, _) = self.find_slot(key);
        // the position plus one fits: checked against u32::MAX - 1 above
        self.slots.set(at, self.entries.len() as u32);
        Ok(None)
    }

    /// Take `key` out, returning its value. The key set last (the one a rollback takes
    /// out first) goes in constant time; any other in time linear in the entries (the
    /// entries after it move up one place, keeping their order).
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if self.slots.len() == 0 {
            return None;
        }
        let (at, position) = self.find_slot(key);
        let position = position?;
        if position + 1 == self.entries.len() {
            self.clear_slot(at);
            return self.entries.pop().map(|(_, value)| value);
        }
        let (_, value) = self.entries.remove(position);
        self.place_all(self.slots.len());
        Some(value)
    }

    /// Empty slot `at` and move up the entries of its probe run that would no longer be
    /// found past the gap (deletion without tombstones under linear probing).
    fn clear_slot(&mut self, mut at: usize) {
        let mask = self.slots.len() - 1;
        self.slots.set(at, EMPTY);
        let mut next = (at + 1) & mask;
        while self.slots.get(next) != EMPTY {
            let slot = self.slots.get(next);
            let want = home(self.entries[(slot - 1) as usize].0, mask);
            // the entry at `next` may fill the gap unless its home lies cyclically in
            // (at, next]: then the gap does not break its probe run
            let stays = if at <= next {
                at < want && want <= next
            } else {
                at < want || want <= next
            };
            if !stays {
                self.slots.set(at, slot);
                self.slots.set(next, EMPTY);
                at = next;
            }
            next = (next + 1) & mask;
        }
    }

    /// Double the table (or make the first one) and place every entry again.
    fn grow(&mut self) {
        self.place_all((self.slots.len() * 2).max(MIN_SLOTS));
    }

    /// A table of `size` slots (a power of two) with every entry placed again.
    fn place_all(&mut self, size: usize) {
        // wide enough for one more entry than now (the one `insert` is about to add)
        self.slots = Slots::empty(size, self.entries.len() + 1);
        let mask = size - 1;
        for (position, (key, _)) in self.entries.iter().enumerate() {
            let mut at = home(*key, mask);
            while self.slots.get(at) != EMPTY {
                at = (at + 1) & mask;
            }
            self.slots.set(at, position as u32 + 1);
        }
    }

    /// The value inserted last (a replaced value keeps its key's place).
    pub fn last(&self) -> Option<&V> {
        self.entries.last().map(|(_, value)| value)
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (u64, &V)> + ExactSizeIterator {
        self.entries.iter().map(|(key, value)| (*key, value))
    }

    /// Values in insertion order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator {
        self.entries.iter().map(|(_, value)| value)
    }

    /// Bytes of heap the index holds (the values' own heap, if any, not counted).
    pub fn nbytes(&self) -> usize {
        self.entries.capacity() * size_of::<(u64, V)>() + self.slots.nbytes()
    }
}

/// 64-bit keys to the numbers filed under them, each key's in filing order: a content
/// table's index, a key being the first 8 bytes of a content's digest. Keys are shared
/// rarely (two contents whose digests begin alike, which a caller of a non-cryptographic
/// digest must expect to be crafted): every number under a key is a candidate the caller
/// confirms. A key's first number is an entry of a [`KeyIndex`] (about 20 bytes); the
/// numbers after it are kept apart, in a map that allocates nothing while no key is shared.
#[derive(Debug, Default)]
pub struct KeyNumbers {
    first: KeyIndex<u32>,
    more: HashMap<u64, Vec<u32>>,
}

impl KeyNumbers {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// File `number` under `key`, after the numbers filed there before. Nothing changes
    /// when it fails.
    ///
    /// # Errors
    /// [`Full`] when the index already holds `u32::MAX - 1` keys.
    pub fn add(&mut self, key: u64, number: u32) -> Result<(), Full> {
        if self.first.contains_key(key) {
            self.more.entry(key).or_default().push(number);
            return Ok(());
        }
        self.first.insert(key, number).map(drop)
    }

    /// The first number filed under `key`, and the numbers filed after it.
    #[must_use]
    pub fn get(&self, key: u64) -> Option<(u32, &[u32])> {
        let first = *self.first.get(key)?;
        Some((first, self.more.get(&key).map_or(&[][..], Vec::as_slice)))
    }

    /// Take `number` out from under `key` if it is the number filed there last (a rolled-back
    /// addition), and say whether it was.
    pub fn pop_last(&mut self, key: u64, number: u32) -> bool {
        if let Some(more) = self.more.get_mut(&key) {
            if more.last() != Some(&number) {
                return false;
            }
            more.pop();
            if more.is_empty() {
                self.more.remove(&key);
            }
            return true;
        }
        if self.first.get(key) == Some(&number) {
            self.first.remove(key);
            return true;
        }
        false
    }

    /// The numbers of each key under which several are filed (the first, then the rest), in
    /// no set order: a table's contents that share a key, without a walk of every key.
    pub fn shared(&self) -> impl Iterator<Item = (u32, &[u32])> + '_ {
        self.more.iter().filter_map(|(key, more)| {
            let first = *self.first.get(*key)?;
            Some((first, more.as_slice()))
        })
    }

    /// How many keys.
    #[must_use]
    pub fn len(&self) -> usize {
        self.first.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Bytes of heap held (the map's entries counted at their size, beside its control bytes).
    #[must_use]
    pub fn nbytes(&self) -> usize {
        let more: usize = self
            .more
            .values()
            .map(|numbers| numbers.capacity() * 4)
            .sum();
        self.first.nbytes() + self.more.capacity() * (size_of::<(u64, Vec<u32>)>() + 1) + more
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A small deterministic generator (xorshift), so the tests need no crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
    }

    #[test]
    fn empty_index_finds_nothing_and_holds_no_heap() {
        let index: KeyIndex<u32> = KeyIndex::new();
        assert!(index.is_empty());
        assert_eq!(index.get(0), None);
        assert_eq!(index.get(u64::MAX), None);
        assert_eq!(index.last(), None);
        assert_eq!(index.nbytes(), 0);
    }

    #[test]
    fn agrees_with_a_hash_map_and_keeps_insertion_order() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let mut index = KeyIndex::new();
        let mut reference = HashMap::new();
        let mut order = Vec::new();
        for i in 0..20_000u32 {
            // a quarter of the insertions replace the value of a key seen before
            let key = if i % 4 == 3 && !order.is_empty() {
                order[(rng.next() % order.len() as u64) as usize]
            } else {
                rng.next()
            };
            let replaced = index.insert(key, i).unwrap();
            let before = reference.insert(key, i);
            assert_eq!(replaced, before);
            if before.is_none() {
                order.push(key);
            }
        }
        assert_eq!(index.len(), reference.len());
        for (key, value) in &reference {
            assert_eq!(index.get(*key), Some(value));
        }
        let keys: Vec<u64> = index.iter().map(|(key, _)| key).collect();
        assert_eq!(keys, order);
        assert_eq!(index.last(), Some(&reference[order.last().unwrap()]));
        for _ in 0..1000 {
            let key = rng.next();
            assert_eq!(index.get(key), reference.get(&key));
        }
    }

    #[test]
    fn keys_that_share_their_low_or_high_bits_are_kept_apart() {
        let mut index = KeyIndex::new();
        for i in 1..5000u64 {
            index.insert(i << 40, i).unwrap(); // the low 40 bits all zero
            index.insert(i, i + 1_000_000).unwrap(); // the high 51 bits all zero
        }
        assert_eq!(index.len(), 2 * 4999);
        for i in 1..5000u64 {
            assert_eq!(index.get(i << 40), Some(&i));
            assert_eq!(index.get(i), Some(&(i + 1_000_000)));
        }
        assert_eq!(index.get(0), None);
        assert_eq!(index.get(5000 << 40), None);
    }

    #[test]
    fn a_value_changed_in_place_keeps_its_place() {
        let mut index = KeyIndex::new();
        assert!(index.get_mut(1).is_none());
        index.insert(1, vec![10]).unwrap();
        index.insert(2, vec![20]).unwrap();
        index.get_mut(1).unwrap().push(11);
        assert!(index.get_mut(3).is_none());
        let items: Vec<(u64, Vec<i32>)> = index.iter().map(|(k, v)| (k, v.clone())).collect();
        assert_eq!(items, vec![(1, vec![10, 11]), (2, vec![20])]);
    }

    #[test]
    fn replacing_keeps_the_place_and_last_is_the_newest_key() {
        let mut index = KeyIndex::new();
        index.insert(7, "a").unwrap();
        index.insert(9, "b").unwrap();
        assert_eq!(index.insert(7, "c").unwrap(), Some("a"));
        assert_eq!(index.last(), Some(&"b"));
        let items: Vec<(u64, &str)> = index.iter().map(|(k, v)| (k, *v)).collect();
        assert_eq!(items, vec![(7, "c"), (9, "b")]);
        let reversed: Vec<&str> = index.values().rev().copied().collect();
        assert_eq!(reversed, vec!["b", "c"]);
    }

    #[test]
    fn removals_agree_with_a_hash_map_and_keep_the_order() {
        let mut rng = Rng(0xfeed_beef);
        let mut index = KeyIndex::new();
        let mut reference: Vec<(u64, u64)> = Vec::new();
        for step in 0..6000u64 {
            // keys from a small range (their homes crowd together) and, now and then, the
            // key set last or one from the middle taken out
            let choice = rng.next() % 10;
            if choice < 2 && !reference.is_empty() {
                let (key, value) = reference.pop().unwrap();
                assert_eq!(index.remove(key), Some(value));
            } else if choice == 2 && !reference.is_empty() {
                let at = (rng.next() % reference.len() as u64) as usize;
                let (key, value) = reference.remove(at);
                assert_eq!(index.remove(key), Some(value));
            } else {
                let key = rng.next() % 4096;
                let replaced = index.insert(key, step).unwrap();
                if let Some(entry) = reference.iter_mut().find(|(k, _)| *k == key) {
                    assert_eq!(replaced, Some(std::mem::replace(&mut entry.1, step)));
                } else {
                    assert_eq!(replaced, None);
                    reference.push((key, step));
                }
            }
            assert_eq!(index.remove(u64::MAX), None);
        }
        let items: Vec<(u64, u64)> = index.iter().map(|(k, v)| (k, *v)).collect();
        assert_eq!(items, reference);
        for key in 0..4096 {
            let expected = reference.iter().find(|(k, _)| *k == key).map(|(_, v)| v);
            assert_eq!(index.get(key), expected);
        }
    }

    #[test]
    fn slots_widen_when_positions_outgrow_two_bytes() {
        let mut index = KeyIndex::new();
        let n = u64::from(u16::MAX) + 100;
        for key in 0..n {
            index
                .insert(key.wrapping_mul(0x2545_F491_4F6C_DD1D), key)
                .unwrap();
            if key == 1000 {
                assert!(matches!(index.slots, Slots::Narrow(_)));
            }
        }
        assert!(matches!(index.slots, Slots::Wide(_)));
        for key in 0..n {
            assert_eq!(
                index.get(key.wrapping_mul(0x2545_F491_4F6C_DD1D)),
                Some(&key)
            );
        }
        // the last one out and one from the middle, past the two-byte positions
        let last = (n - 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
        assert_eq!(index.remove(last), Some(n - 1));
        assert_eq!(
            index.remove(5u64.wrapping_mul(0x2545_F491_4F6C_DD1D)),
            Some(5)
        );
        assert_eq!(index.len() as u64, n - 2);
        assert_eq!(
            index.get(70_000u64.wrapping_mul(0x2545_F491_4F6C_DD1D)),
            None
        );
        assert_eq!(
            index.get(65_600u64.wrapping_mul(0x2545_F491_4F6C_DD1D)),
            Some(&65_600)
        );
    }

    #[test]
    fn stays_compact() {
        let mut rng = Rng(99);
        let mut index = KeyIndex::new();
        for i in 0..100_000u64 {
            index.insert(rng.next(), i).unwrap();
        }
        // entries of 16 bytes with at most a quarter spare, (wide) slots at least three
        // eighths used
        assert!(index.nbytes() <= 100_000 * (16 * 5 / 4 + 4 * 8 / 3 + 1));
        assert!(matches!(index.slots, Slots::Wide(_)));
        assert!(index.slots.len() * LOAD_NUM >= index.len() * LOAD_DEN);
    }

    #[test]
    fn numbers_under_a_key_come_back_in_filing_order_and_pop_from_the_last() {
        let mut index = KeyNumbers::new();
        assert!(index.get(7).is_none() && index.is_empty() && index.nbytes() == 0);
        for (key, number) in [(7, 0), (9, 1), (7, 2), (7, 3), (u64::MAX, 4)] {
            index.add(key, number).unwrap();
        }
        assert_eq!(index.len(), 3);
        assert_eq!(index.get(7), Some((0, &[2, 3][..])));
        assert_eq!(index.get(9), Some((1, &[][..])));
        assert_eq!(index.get(u64::MAX), Some((4, &[][..])));
        assert_eq!(index.shared().collect::<Vec<_>>(), vec![(0, &[2, 3][..])]);
        assert!(!index.pop_last(7, 2), "2 is not the last under 7");
        assert!(index.pop_last(7, 3) && index.pop_last(7, 2));
        assert_eq!(index.get(7), Some((0, &[][..])));
        assert!(
            index.more.is_empty(),
            "a key no longer shared keeps no list"
        );
        assert!(index.pop_last(7, 0) && !index.pop_last(7, 0));
        assert!(index.get(7).is_none());
        assert_eq!(index.len(), 2);
        assert!(index.nbytes() > 0);
    }

    #[test]
    fn numbers_match_a_map_of_lists_through_adds_and_rollbacks() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let mut index = KeyNumbers::new();
        let mut model: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut filed: Vec<(u64, u32)> = Vec::new();
        for number in 0..4000_u32 {
            if rng.next() % 5 == 0 && !filed.is_empty() {
                let (key, last) = filed.pop().unwrap();
                assert!(index.pop_last(key, last));
                let numbers = model.get_mut(&key).unwrap();
                numbers.pop();
                if numbers.is_empty() {
                    model.remove(&key);
                }
                continue;
            }
            let key = rng.next() % 300; // keys shared often
            index.add(key, number).unwrap();
            model.entry(key).or_default().push(number);
            filed.push((key, number));
        }
        assert_eq!(index.len(), model.len());
        for (key, numbers) in &model {
            let (first, more) = index.get(*key).unwrap();
            assert_eq!(first, numbers[0]);
            assert_eq!(more, &numbers[1..]);
        }
    }
}
