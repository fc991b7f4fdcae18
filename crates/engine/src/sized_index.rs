//! A graph's token indexes: turns filed under 64-bit keys, each with a length, found by a
//! range of lengths.
//!
//! Linking files each token turn under the digest of its tokens' last whole block (with the
//! length of its prompt and sampled tokens), and each token root under its prompt's heads and
//! blocks (with its prompt's length). Every lookup wants a range of lengths under one key: a
//! parent's tokens are at most the new prompt's, a root a new turn adopts has a prompt at
//! least as long as the new turn's tokens. One prompt sampled thousands of times files every
//! turn under one key, so a key holding more than `small` turns holds them grouped by length,
//! and a lookup visits only the groups in its range.
//!
//! A length group can itself grow large (a group of a thousand rollouts sampled from one
//! prompt, a thousand turns of one length under one key), and a continuation looks among
//! them for the one whose tokens start its prompt. A group of more than `small` turns, when
//! the caller can say what a turn's content digest is, holds them by that digest, and such a
//! lookup asks for the one digest its own tokens have at that length ([`SizedIndex::exact`]).
//! A digest found this way only narrows the search: the caller compares the tokens.
//!
//! Items are turn numbers. Everything is kept in the order it was filed (groups in the order
//! their first turn came, digests likewise), so lookups hand candidates back in the same
//! order whatever the grouping.

use std::collections::HashMap;
use std::hash::Hash;
use std::mem::size_of;

/// Keys to values in the order keys first came, found by key in constant time (a large key's
/// length groups, a large group's digests).
#[derive(Debug, Clone)]
struct Ordered<K, V> {
    order: Vec<(K, V)>,
    at: HashMap<K, usize>,
}

impl<K: Copy + Eq + Hash, V> Ordered<K, V> {
    fn new() -> Self {
        Ordered {
            order: Vec::new(),
            at: HashMap::new(),
        }
    }

    fn get(&self, key: K) -> Option<&V> {
        self.at.get(&key).map(|&at| &self.order[at].1)
    }

    fn get_mut(&mut self, key: K) -> Option<&mut V> {
        self.at.get(&key).map(|&at| &mut self.order[at].1)
    }

    fn push(&mut self, key: K, value: V) {
        self.at.insert(key, self.order.len());
        self.order.push((key, value));
    }

    /// Take `key` out, keeping the others' order (rare: a key's positions are renumbered).
    fn remove(&mut self, key: K) {
        if let Some(at) = self.at.remove(&key) {
            self.order.remove(at);
            for (position, (key, _)) in self.order.iter().enumerate().skip(at) {
                self.at.insert(*key, position);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = &(K, V)> {
        self.order.iter()
    }

    fn nbytes(&self) -> usize {
        self.order.capacity() * size_of::<(K, V)>()
            + self.at.capacity() * (size_of::<(K, usize)>() + 1)
    }
}

/// One length group's turns: as filed, or by content digest once large (digests in the
/// order their first turn came, each with its turns in order).
#[derive(Debug, Clone)]
enum Group {
    Items(Vec<u32>),
    ByContent(Ordered<u64, Vec<u32>>),
}

impl Group {
    fn extend_into(&self, out: &mut Vec<u32>) {
        match self {
            Group::Items(items) => out.extend_from_slice(items),
            Group::ByContent(digests) => {
                for (_, items) in digests.iter() {
                    out.extend_from_slice(items);
                }
            }
        }
    }

    /// Take `item` out; whether it was there.
    fn remove(&mut self, item: u32) -> bool {
        match self {
            Group::Items(items) => remove_item(items, item),
            Group::ByContent(digests) => {
                let Some(digest) = digests
                    .iter()
                    .find(|(_, items)| items.contains(&item))
                    .map(|&(digest, _)| digest)
                else {
                    return false;
                };
                let items = digests.get_mut(digest).expect("a digest just found");
                remove_item(items, item);
                if items.is_empty() {
                    digests.remove(digest);
                }
                true
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Group::Items(items) => items.is_empty(),
            Group::ByContent(digests) => digests.is_empty(),
        }
    }

    fn nbytes(&self) -> usize {
        match self {
            Group::Items(items) => items.capacity() * size_of::<u32>(),
            Group::ByContent(digests) => {
                digests.nbytes()
                    + digests
                        .iter()
                        .map(|(_, items)| items.capacity() * size_of::<u32>())
                        .sum::<usize>()
            }
        }
    }
}

fn remove_item(items: &mut Vec<u32>, item: u32) -> bool {
    match items.iter().position(|&found| found == item) {
        Some(at) => {
            items.remove(at);
            true
        }
        None => false,
    }
}

/// What one key holds.
#[derive(Debug, Clone)]
enum Entry {
    /// A single turn and its length (most keys).
    One(u32, u32),
    /// Up to `small` turns with their lengths, as filed.
    Few(Vec<(u32, u32)>),
    /// More: groups by length, in the order each length first came.
    ByLength(Box<Ordered<u32, Group>>),
}

/// Turn numbers under 64-bit keys, each with a length (see the module's documentation).
#[derive(Debug, Clone)]
pub struct SizedIndex {
    small: usize,
    keys: HashMap<u64, Entry>,
    /// Turns handed out by lookups so far (what tests hold to bounds).
    visited: u64,
}

impl SizedIndex {
    /// An empty index whose keys group their turns by length beyond `small` turns (at
    /// least 1).
    #[must_use]
    pub fn new(small: usize) -> Self {
        SizedIndex {
            small: small.max(1),
            keys: HashMap::new(),
            visited: 0,
        }
    }

    /// Keys that hold a turn.
    #[must_use]
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `key` holds a turn.
    #[must_use]
    pub fn contains_key(&self, key: u64) -> bool {
        self.keys.contains_key(&key)
    }

    /// Turns handed out by [`Self::members`] and [`Self::exact`] so far.
    #[must_use]
    pub fn visited(&self) -> u64 {
        self.visited
    }

    /// The content digests filing a turn under `key` with `length` needs: none, the new
    /// turn's, or (a group about to be held by content) those of the turns listed and then
    /// the new turn's. Asked first, so that what computes them runs with nothing held.
    #[must_use]
    pub fn content_needed(&self, key: u64, length: u32) -> Needed {
        match self.group(key, length) {
            Some(Group::ByContent(_)) => Needed::New,
            Some(Group::Items(items)) if items.len() > self.small => Needed::Members(items.clone()),
            _ => Needed::Nothing,
        }
    }

    /// The length group `length` of a large key.
    fn group(&self, key: u64, length: u32) -> Option<&Group> {
        match self.keys.get(&key) {
            Some(Entry::ByLength(groups)) => groups.get(length),
            _ => None,
        }
    }

    /// File `item` under `key` with `length` (which never changes while it is filed).
    /// `digests`: what [`Self::content_needed`] asked for, in its order, or empty when the
    /// caller has no content digests (a large length group then stays as filed).
    ///
    /// # Errors
    /// [`Stale`] when `digests` are not what filing it needs now (the index changed since
    /// they were asked for): nothing is changed; ask again.
    pub fn add(&mut self, key: u64, item: u32, length: u32, digests: &[u64]) -> Result<(), Stale> {
        // (what `content_needed` asks, counted: a group filed without digests grows on)
        let fits = digests.is_empty()
            || match self.group(key, length) {
                Some(Group::ByContent(_)) => digests.len() == 1,
                Some(Group::Items(items)) if items.len() > self.small => {
                    digests.len() == items.len() + 1
                }
                _ => false,
            };
        if !fits {
            return Err(Stale);
        }
        let small = self.small;
        let Some(entry) = self.keys.get_mut(&key) else {
            self.keys.insert(key, Entry::One(item, length));
            return Ok(());
        };
        match entry {
            Entry::One(first, first_length) => {
                let few = vec![(*first, *first_length), (item, length)];
                *entry = if small < 2 {
                    Entry::ByLength(Box::new(grouped(&few)))
                } else {
                    Entry::Few(few)
                };
            }
            Entry::Few(few) if few.len() < small => few.push((item, length)),
            Entry::Few(few) => {
                few.push((item, length));
                *entry = Entry::ByLength(Box::new(grouped(few)));
            }
            Entry::ByLength(groups) => {
                let Some(group) = groups.get_mut(length) else {
                    groups.push(length, Group::Items(vec![item]));
                    return Ok(());
                };
                match group {
                    Group::ByContent(held) => {
                        // filed without a digest: under none a caller's content has, so
                        // every lookup by content still sees it
                        let digest = digests.first().copied().unwrap_or(NO_DIGEST);
                        add_by_digest(held, digest, item);
                    }
                    Group::Items(items) if !digests.is_empty() => {
                        let mut by_content = Ordered::new();
                        for (&member, &digest) in items.iter().chain([&item]).zip(digests) {
                            add_by_digest(&mut by_content, digest, member);
                        }
                        *group = Group::ByContent(by_content);
                    }
                    Group::Items(items) => items.push(item),
                }
            }
        }
        Ok(())
    }

    /// Take `item`, filed with `length`, from under `key`; whether it was there.
    pub fn remove(&mut self, key: u64, item: u32, length: u32) -> bool {
        let Some(entry) = self.keys.get_mut(&key) else {
            return false;
        };
        let (removed, empty) = match entry {
            Entry::One(found, _) => (*found == item, *found == item),
            Entry::Few(few) => {
                let at = few.iter().position(|&(found, _)| found == item);
                if let Some(at) = at {
                    few.remove(at);
                }
                match few.as_slice() {
                    [(only, only_length)] => {
                        *entry = Entry::One(*only, *only_length);
                        (at.is_some(), false)
                    }
                    rest => (at.is_some(), rest.is_empty()),
                }
            }
            Entry::ByLength(groups) => {
                let removed = groups
                    .get_mut(length)
                    .is_some_and(|group| group.remove(item));
                if groups.get(length).is_some_and(Group::is_empty) {
                    groups.remove(length);
                }
                (removed, groups.is_empty())
            }
        };
        if empty {
            self.keys.remove(&key);
        }
        removed
    }

    /// The turns under `key` that may have a length in `[low, high)`, appended to `out`:
    /// every turn of a key of few (the caller checks each), the groups in range of a large
    /// one.
    pub fn members(&mut self, key: u64, low: u32, high: u64, out: &mut Vec<u32>) {
        let start = out.len();
        match self.keys.get(&key) {
            None => {}
            Some(Entry::One(item, _)) => out.push(*item),
            Some(Entry::Few(few)) => out.extend(few.iter().map(|&(item, _)| item)),
            Some(Entry::ByLength(groups)) => {
                for (length, group) in groups.iter() {
                    if in_range(*length, low, high) {
                        group.extend_into(out);
                    }
                }
            }
        }
        self.visited += (out.len() - start) as u64;
    }

    /// The lengths in `[low, high)` whose groups under `key` are held by content: those
    /// [`Self::exact`] asks the digest of.
    #[must_use]
    pub fn content_lengths(&self, key: u64, low: u32, high: u64) -> Vec<u32> {
        let Some(Entry::ByLength(groups)) = self.keys.get(&key) else {
            return Vec::new();
        };
        groups
            .iter()
            .filter(|(length, group)| {
                matches!(group, Group::ByContent(_)) && in_range(*length, low, high)
            })
            .map(|(length, _)| *length)
            .collect()
    }

    /// [`Self::members`], but of a group held by content only the turns whose digest is
    /// `digest_at(length)` (the caller still checks each; a length it gives no digest for
    /// hands back its whole group).
    pub fn exact(
        &mut self,
        key: u64,
        low: u32,
        high: u64,
        digest_at: &dyn Fn(u32) -> Option<u64>,
        out: &mut Vec<u32>,
    ) {
        let Some(Entry::ByLength(groups)) = self.keys.get(&key) else {
            self.members(key, low, high, out);
            return;
        };
        let start = out.len();
        for (length, group) in groups.iter() {
            if !in_range(*length, low, high) {
                continue;
            }
            match (group, digest_at(*length)) {
                (Group::ByContent(held), Some(digest)) => {
                    for found in [digest, NO_DIGEST] {
                        if let Some(items) = held.get(found) {
                            out.extend_from_slice(items);
                        }
                    }
                }
                _ => group.extend_into(out),
            }
        }
        self.visited += (out.len() - start) as u64;
    }

    /// Every key with its turns (in the order [`Self::members`] gives them).
    pub fn iter(&self) -> impl Iterator<Item = (u64, Vec<u32>)> + '_ {
        self.keys.iter().map(|(&key, entry)| {
            let mut items = Vec::new();
            match entry {
                Entry::One(item, _) => items.push(*item),
                Entry::Few(few) => items.extend(few.iter().map(|&(item, _)| item)),
                Entry::ByLength(groups) => {
                    for (_, group) in groups.iter() {
                        group.extend_into(&mut items);
                    }
                }
            }
            (key, items)
        })
    }

    /// The heap the index holds (its table and what each key holds beyond its slot).
    #[must_use]
    pub fn nbytes(&self) -> usize {
        let table = self.keys.capacity() * (size_of::<(u64, Entry)>() + 1);
        let held: usize = self
            .keys
            .values()
            .map(|entry| match entry {
                Entry::One(..) => 0,
                Entry::Few(few) => few.capacity() * size_of::<(u32, u32)>(),
                Entry::ByLength(groups) => {
                    size_of::<Ordered<u32, Group>>()
                        + groups.nbytes()
                        + groups
                            .iter()
                            .map(|(_, group)| group.nbytes())
                            .sum::<usize>()
                }
            })
            .sum();
        table + held
    }
}

/// What filing a turn needs of the caller first (see [`SizedIndex::content_needed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Needed {
    Nothing,
    /// The new turn's digest.
    New,
    /// These turns' digests, then the new turn's.
    Members(Vec<u32>),
}

/// The index changed since the digests given were asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale;

/// Where a turn filed without a digest is held in a group held by content (handed back to
/// every lookup by content).
const NO_DIGEST: u64 = u64::MAX;

fn in_range(length: u32, low: u32, high: u64) -> bool {
    low <= length && u64::from(length) < high
}

/// Turns with their lengths grouped by length, each length where it first came.
fn grouped(few: &[(u32, u32)]) -> Ordered<u32, Group> {
    let mut groups = Ordered::new();
    for &(item, length) in few {
        match groups.get_mut(length) {
            Some(Group::Items(items)) => items.push(item),
            _ => groups.push(length, Group::Items(vec![item])),
        }
    }
    groups
}

fn add_by_digest(digests: &mut Ordered<u64, Vec<u32>>, digest: u64, item: u32) {
    match digests.get_mut(digest) {
        Some(items) => items.push(item),
        None => digests.push(digest, vec![item]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(index: &mut SizedIndex, key: u64, item: u32, length: u32) {
        index.add(key, item, length, &[]).unwrap();
    }

    /// Filed as a caller with content digests files it: asked for, then given.
    fn add_with(index: &mut SizedIndex, key: u64, item: u32, length: u32, content: fn(u32) -> u64) {
        let digests: Vec<u64> = match index.content_needed(key, length) {
            Needed::Nothing => vec![],
            Needed::New => vec![content(item)],
            Needed::Members(members) => {
                members.iter().chain([&item]).map(|&m| content(m)).collect()
            }
        };
        index.add(key, item, length, &digests).unwrap();
    }

    fn members(index: &mut SizedIndex, key: u64, low: u32, high: u64) -> Vec<u32> {
        let mut out = Vec::new();
        index.members(key, low, high, &mut out);
        out
    }

    #[test]
    fn few_turns_are_handed_back_whole_and_many_by_length() {
        let mut index = SizedIndex::new(2);
        add(&mut index, 7, 0, 10);
        add(&mut index, 7, 1, 20);
        assert_eq!(members(&mut index, 7, 100, 200), vec![0, 1]); // few: the caller checks
        add(&mut index, 7, 2, 10);
        add(&mut index, 7, 3, 30);
        assert_eq!(members(&mut index, 7, 100, 200), Vec::<u32>::new());
        assert_eq!(members(&mut index, 7, 10, 21), vec![0, 2, 1]);
        assert_eq!(members(&mut index, 7, 0, u64::MAX), vec![0, 2, 1, 3]);
        assert_eq!(index.visited(), 2 + 3 + 4);
        assert_eq!(members(&mut index, 8, 0, u64::MAX), Vec::<u32>::new());
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn a_large_group_is_held_by_content_and_found_by_it() {
        let mut index = SizedIndex::new(2);
        for item in 0..6 {
            add_with(&mut index, 1, item, 50, |item| u64::from(item % 2));
        }
        assert_eq!(index.content_lengths(1, 0, 100), vec![50]);
        assert_eq!(index.content_lengths(1, 51, 100), Vec::<u32>::new());
        let mut out = Vec::new();
        index.exact(1, 0, 100, &|length| Some(u64::from(length) - 49), &mut out);
        assert_eq!(out, vec![1, 3, 5]);
        out.clear();
        index.exact(1, 0, 100, &|_| None, &mut out);
        assert_eq!(out, vec![0, 2, 4, 1, 3, 5]);
        assert_eq!(members(&mut index, 1, 0, 100), vec![0, 2, 4, 1, 3, 5]);
        assert!(index.remove(1, 3, 50));
        assert!(!index.remove(1, 3, 50));
        assert_eq!(members(&mut index, 1, 0, 100), vec![0, 2, 4, 1, 5]);
        add(&mut index, 1, 6, 50); // no digest: every lookup by content sees it
        out.clear();
        index.exact(1, 0, 100, &|_| Some(0), &mut out);
        assert_eq!(out, vec![0, 2, 4, 6]);
    }

    #[test]
    fn digests_that_are_not_what_filing_needs_change_nothing() {
        let mut index = SizedIndex::new(2);
        for item in 0..3 {
            add(&mut index, 1, item, 50);
        }
        let before = members(&mut index, 1, 0, 100);
        assert_eq!(index.content_needed(1, 50), Needed::Members(vec![0, 1, 2]));
        assert_eq!(index.add(1, 3, 50, &[1, 2]), Err(Stale));
        assert_eq!(index.add(2, 3, 50, &[1]), Err(Stale)); // a new key needs none
        assert_eq!(members(&mut index, 1, 0, 100), before);
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn removing_every_turn_forgets_the_key() {
        let mut index = SizedIndex::new(2);
        for (item, length) in [(0, 5), (1, 6), (2, 5), (3, 7)] {
            add(&mut index, 9, item, length);
        }
        for (item, length) in [(2, 5), (0, 5), (3, 7)] {
            assert!(!index.remove(9, item, 6)); // not under that length
            assert!(index.remove(9, item, length));
            assert!(index.contains_key(9));
        }
        assert_eq!(members(&mut index, 9, 0, 9), vec![1]);
        assert!(index.remove(9, 1, 6));
        assert!(!index.contains_key(9));
        assert!(index.is_empty());
        add(&mut index, 4, 1, 1);
        add(&mut index, 4, 2, 1);
        assert!(index.remove(4, 1, 1));
        assert_eq!(members(&mut index, 4, 0, 9), vec![2]);
        assert!(index.remove(4, 2, 1));
        assert!(index.is_empty());
    }

    #[test]
    fn iter_gives_each_key_its_turns() {
        let mut index = SizedIndex::new(8);
        for item in 0..20 {
            add(&mut index, u64::from(item % 3), item, item);
        }
        let mut keys: Vec<(u64, Vec<u32>)> = index.iter().collect();
        keys.sort_unstable();
        assert_eq!(keys[0], (0, (0..20).filter(|i| i % 3 == 0).collect()));
        assert_eq!(keys.len(), 3);
        assert!(index.nbytes() > 0);
    }
}
