//! The mask map's representation: canonical block hash (mixed, table::mix) -> the set of slots
//! (replicas) holding it, in hash tables of 16-byte (key, word) slots (table.rs).
//!
//! Narrow (no slot >= 64 was ever set: fleets of up to 64 replicas): one table, the value of a key
//! is its mask's only word. One probe a lookup, one slot an entry.
//!
//! Wide (a slot >= 64 was set once): the value of a key in `lo` is its holder set, encoded so that
//! an entry few replicas hold costs one slot and one probe, whatever the fleet's size:
//! - FEW12 (tag 1): up to 5 slots below 4,095, 12 bits each (bits 0..59, ascending, 0xFFF unused);
//! - FEW20 (tag 3): else up to 3 slots below 2**20 - 1, 20 bits each (0xFFFFF unused);
//! - WORDS (tag 2): else bits 0..60 say which 64-bit words of the mask are non-zero (bit 61: one of
//!   the words 61 and beyond), and word w is the value of the key in `words[w]`.
//!
//! The form is a function of the set (the first that fits), so equal sets are equal values, and a
//! set that shrinks back to 5 holders leaves the word tables. Measured on the Mooncake trace at
//! 2,048 replicas (bench/peers --workers), where most blocks have a handful of holders: before,
//! word 0 stayed in `lo` and word w >= 1 went to a table of its own, so an entry of one replica
//! above slot 63 cost two slots, and a removal or the walk's first hash probed every word's table.
//! Invariants: every key of a word table is a WORDS key of `lo` with that word's bit set (bit 61
//! for words >= 61), its word is never 0, and the last word table is never empty.

use crate::table::Table;

pub const FEW12: u64 = 1;
pub const WORDS: u64 = 2;
pub const FEW20: u64 = 3;
const TAG: u32 = 62;
const OVER: usize = 61; // the bitmap bit of words 61 and beyond
const BITMAP: u64 = (1 << TAG) - 1;
const NONE12: u64 = 0xFFF;
const NONE20: u64 = 0xFFFFF;
pub const MAX_FEW: usize = 5;

/// The slots of a FEW value, ascending: (slots, count).
#[inline(always)]
pub fn few_slots(v: u64) -> ([usize; MAX_FEW], usize) {
    let (bits, n, none) = if v >> TAG == FEW12 { (12, 5, NONE12) } else { (20, 3, NONE20) };
    let mut out = [0usize; MAX_FEW];
    let mut k = 0;
    while k < n {
        let s = (v >> (bits * k)) & none;
        if s == none {
            break;
        }
        out[k] = s as usize;
        k += 1;
    }
    (out, k)
}

/// The FEW value of `slots` (ascending, not empty), if one fits.
#[inline]
fn encode_few(slots: &[usize]) -> Option<u64> {
    let max = *slots.last()? as u64;
    let pack = |bits: usize, n: usize, none: u64, tag: u64| {
        let mut v = tag << TAG;
        for i in 0..n {
            v |= slots.get(i).map_or(none, |&s| s as u64) << (bits * i);
        }
        v
    };
    if slots.len() <= 5 && max < NONE12 {
        Some(pack(12, 5, NONE12, FEW12))
    } else if slots.len() <= 3 && max < NONE20 {
        Some(pack(20, 3, NONE20, FEW20))
    } else {
        None
    }
}

#[inline(always)]
fn word_bit(w: usize) -> u64 {
    1 << w.min(OVER)
}

#[inline(always)]
fn is_words(v: u64) -> bool {
    v >> TAG == WORDS
}

/// The slots of `words` (a mask), up to `limit` of them (None past it).
fn slots_of(words: &[u64], limit: usize) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for (w, &x) in words.iter().enumerate() {
        let mut x = x;
        while x != 0 {
            if out.len() == limit {
                return None;
            }
            out.push(64 * w + x.trailing_zeros() as usize);
            x &= x - 1;
        }
    }
    Some(out)
}

fn trim(mut v: Vec<u64>) -> Vec<u64> {
    while v.len() > 1 && v.last() == Some(&0) {
        v.pop();
    }
    v
}

#[derive(Clone, Default)]
pub struct Masks {
    lo: Table,
    wide: bool,
    words: Vec<Table>, // wide: words[w] = word w of the WORDS entries with a bit in it
}

impl Masks {
    pub fn len(&self) -> usize {
        self.lo.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lo.is_empty()
    }

    /// The value of `h` (its mask in a narrow map; read it with `words_of`).
    #[inline(always)]
    pub fn value(&self, h: u64) -> Option<u64> {
        self.lo.get(h)
    }

    pub fn contains(&self, h: u64) -> bool {
        self.lo.contains(h)
    }

    /// The table of a narrow map (value = the mask): the fast paths read it directly.
    #[inline(always)]
    pub fn narrow(&self) -> Option<&Table> {
        (!self.wide).then_some(&self.lo)
    }

    /// (key, value) of every entry, in stored order; a value is read with `words_of`.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.lo.iter()
    }

    /// `entries` with lo <= key < hi (table::Table::range).
    pub fn range(&self, lo: u64, hi: Option<u64>) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.lo.range(lo, hi)
    }

    pub fn reserve(&mut self, n: usize) {
        self.lo.reserve(n.saturating_sub(self.lo.len()));
    }

    /// Word `w` of the mask of `h`, whose value is `v`.
    #[inline(always)]
    pub fn word_of(&self, h: u64, v: u64, w: usize) -> u64 {
        if !self.wide {
            return if w == 0 { v } else { 0 };
        }
        if is_words(v) {
            if v & word_bit(w) == 0 {
                return 0;
            }
            return self.words.get(w).and_then(|t| t.get(h)).unwrap_or(0);
        }
        let (s, n) = few_slots(v);
        s[..n].iter().filter(|&&s| s / 64 == w).fold(0, |x, &s| x | 1 << (s % 64))
    }

    #[inline]
    pub fn word(&self, h: u64, w: usize) -> u64 {
        self.lo.get(h).map_or(0, |v| self.word_of(h, v, w))
    }

    /// The words of the mask of `h` whose value is `v` (no trailing 0 word past the first).
    pub fn words_of(&self, h: u64, v: u64) -> Vec<u64> {
        if !self.wide {
            return vec![v];
        }
        if !is_words(v) {
            let (s, n) = few_slots(v);
            let mut out = vec![0u64; s[n - 1] / 64 + 1];
            for &s in &s[..n] {
                out[s / 64] |= 1 << (s % 64);
            }
            return out;
        }
        let top = if v & word_bit(OVER) != 0 { self.words.len() } else { 64 - (v & BITMAP).leading_zeros() as usize };
        let mut out = vec![0u64; top.max(1)];
        for (w, x) in out.iter_mut().enumerate() {
            if v & word_bit(w) != 0 {
                *x = self.words[w].get(h).unwrap_or(0);
            }
        }
        trim(out)
    }

    pub fn words(&self, h: u64) -> Option<Vec<u64>> {
        self.lo.get(h).map(|v| self.words_of(h, v))
    }

    #[inline]
    pub fn has_bit(&self, h: u64, slot: usize) -> bool {
        self.word(h, slot / 64) >> (slot % 64) & 1 != 0
    }

    /// Starts loading what `set_bit`/`clear_bit` of `slot` will read for `h`.
    #[inline(always)]
    pub fn prefetch(&self, h: u64, slot: usize) {
        self.lo.prefetch(h);
        if self.wide {
            if let Some(t) = self.words.get(slot / 64) {
                t.prefetch(h);
            }
        }
    }

    /// Starts loading what an AND-walk step with `alive` will read for `h`.
    #[inline(always)]
    pub fn prefetch_alive(&self, h: u64, alive: &[u64]) {
        self.lo.prefetch(h);
        for (t, &a) in self.words.iter().zip(alive) {
            if a != 0 {
                t.prefetch(h);
            }
        }
    }

    /// `alive[w] &= word w of h's mask` for every word (a wide map's walk step); whether any is left.
    #[inline(always)]
    pub fn and_into(&self, h: u64, alive: &mut [u64]) -> bool {
        let Some(v) = self.lo.get(h) else {
            alive.fill(0);
            return false;
        };
        let mut any = false;
        if !self.wide {
            alive[0] &= v;
            alive[1..].fill(0);
            return alive[0] != 0;
        }
        if is_words(v) {
            for (w, a) in alive.iter_mut().enumerate() {
                if *a != 0 {
                    *a &= if v & word_bit(w) != 0 { self.words[w].get(h).unwrap_or(0) } else { 0 };
                    any |= *a != 0;
                }
            }
            return any;
        }
        let (s, n) = few_slots(v);
        let mut x = [0u64; MAX_FEW]; // (word index, bits) of the held slots still alive
        let mut kept = 0;
        for &s in &s[..n] {
            let (w, b) = (s / 64, 1u64 << (s % 64));
            if alive.get(w).is_some_and(|a| a & b != 0) {
                x[kept] = (w as u64) << 6 | (s % 64) as u64;
                kept += 1;
            }
        }
        alive.fill(0);
        for &e in &x[..kept] {
            alive[(e >> 6) as usize] |= 1 << (e & 63);
            any = true;
        }
        any
    }

    /// Every entry re-encoded for slots >= 64 (once, when the first such slot is set).
    fn widen(&mut self) {
        self.wide = true;
        let mut dense = Vec::new();
        self.lo.retain(|k, v| {
            match slots_of(&[*v], MAX_FEW).and_then(|s| encode_few(&s)) {
                Some(e) => *v = e,
                None => {
                    dense.push((k, *v));
                    *v = WORDS << TAG | 1;
                }
            }
            true
        });
        if !dense.is_empty() {
            let mut t = Table::default();
            t.reserve(dense.len());
            for (k, x) in dense {
                t.insert(k, x);
            }
            self.words.push(t);
        }
    }

    fn word_table(&mut self, w: usize) -> &mut Table {
        if self.words.len() <= w {
            self.words.resize_with(w + 1, Table::default);
        }
        &mut self.words[w]
    }

    fn trim_words(&mut self) {
        while self.words.last().is_some_and(Table::is_empty) {
            self.words.pop();
        }
    }

    /// Writes the set `slots` (ascending, not empty) as `h`'s value, in the tables it needs (`h`
    /// must be in no word table).
    fn put_slots(&mut self, h: u64, slots: &[usize]) -> u64 {
        if let Some(e) = encode_few(slots) {
            return e;
        }
        let mut bitmap = 0;
        for &s in slots {
            let t = self.word_table(s / 64);
            let (pos, _) = t.get_or_insert(h, 0);
            *t.value_mut(pos) |= 1 << (s % 64);
            bitmap |= word_bit(s / 64);
        }
        WORDS << TAG | bitmap
    }

    /// Writes the mask `words` (not all 0) as `h`'s value (`h` must be in no word table).
    fn put_words(&mut self, h: u64, words: &[u64]) -> u64 {
        if let Some(e) = slots_of(words, MAX_FEW).and_then(|s| encode_few(&s)) {
            return e;
        }
        let mut bitmap = 0;
        for (w, &x) in words.iter().enumerate() {
            if x != 0 {
                self.word_table(w).insert(h, x);
                bitmap |= word_bit(w);
            }
        }
        WORDS << TAG | bitmap
    }

    /// Sets bit `slot` of `h`'s mask; true if it was not set.
    #[inline(always)]
    pub fn set_bit(&mut self, h: u64, slot: usize) -> bool {
        if !self.wide {
            if slot < 64 {
                let b = 1u64 << slot;
                let (pos, new) = self.lo.get_or_insert(h, b);
                if new {
                    return true;
                }
                let v = self.lo.value_mut(pos);
                let new = *v & b == 0;
                *v |= b;
                return new;
            }
            self.widen();
        }
        let (w, b) = (slot / 64, 1u64 << (slot % 64));
        let single = encode_few(&[slot]);
        let (pos, new) = self.lo.get_or_insert(h, single.unwrap_or(WORDS << TAG | word_bit(w)));
        if new {
            if single.is_none() {
                self.word_table(w).insert(h, b);
            }
            return true;
        }
        let v = *self.lo.value_mut(pos);
        if is_words(v) {
            let t = self.word_table(w);
            let (p, fresh) = t.get_or_insert(h, b);
            if !fresh {
                let x = t.value_mut(p);
                if *x & b != 0 {
                    return false;
                }
                *x |= b;
            }
            *self.lo.value_mut(pos) = v | word_bit(w);
            return true;
        }
        let (s, n) = few_slots(v);
        let Err(at) = s[..n].binary_search(&slot) else { return false };
        let mut all = [0usize; MAX_FEW + 1];
        all[..at].copy_from_slice(&s[..at]);
        all[at] = slot;
        all[at + 1..=n].copy_from_slice(&s[at..n]);
        let e = self.put_slots(h, &all[..=n]);
        *self.lo.value_mut(pos) = e;
        true
    }

    /// Clears bit `slot` of `h`'s mask, deleting the entry when nothing is left; true if it was set.
    #[inline(always)]
    pub fn clear_bit(&mut self, h: u64, slot: usize) -> bool {
        let Some(pos) = self.lo.find(h) else { return false }; // one probe
        let v = *self.lo.value_mut(pos);
        if !self.wide {
            if slot >= 64 || v & 1 << slot == 0 {
                return false;
            }
            let x = v & !(1 << slot);
            if x == 0 {
                self.lo.remove_at(pos);
            } else {
                *self.lo.value_mut(pos) = x;
            }
            return true;
        }
        if !is_words(v) {
            let (s, n) = few_slots(v);
            let Ok(at) = s[..n].binary_search(&slot) else { return false };
            if n == 1 {
                self.lo.remove_at(pos);
                return true;
            }
            let mut rest = [0usize; MAX_FEW];
            rest[..at].copy_from_slice(&s[..at]);
            rest[at..n - 1].copy_from_slice(&s[at + 1..n]);
            *self.lo.value_mut(pos) = encode_few(&rest[..n - 1]).expect("a subset of a FEW set is one");
            return true;
        }
        let (w, b) = (slot / 64, 1u64 << (slot % 64));
        if v & word_bit(w) == 0 {
            return false;
        }
        let Some(t) = self.words.get_mut(w) else { return false };
        let Some(p) = t.find(h) else { return false };
        let x = t.value_mut(p);
        if *x & b == 0 {
            return false;
        }
        *x &= !b;
        let mut v = v;
        if *x == 0 {
            t.remove_at(p);
            if w < OVER || !self.words[OVER..].iter().any(|t| t.contains(h)) {
                v &= !word_bit(w);
            }
        }
        self.settle(h, pos, v);
        true
    }

    /// After a clear in the word tables: `h` (at `pos` in `lo`, bitmap `v`) leaves them if its set
    /// now fits a FEW value, and the map if it is empty.
    fn settle(&mut self, h: u64, pos: usize, v: u64) {
        let mut slots = Vec::with_capacity(MAX_FEW);
        let mut few = true;
        'count: for w in 0..self.words.len() {
            if v & word_bit(w) == 0 {
                continue;
            }
            let mut x = self.words[w].get(h).unwrap_or(0);
            while x != 0 {
                if slots.len() == MAX_FEW {
                    few = false;
                    break 'count;
                }
                slots.push(64 * w + x.trailing_zeros() as usize);
                x &= x - 1;
            }
        }
        // None: leave the word tables (still more than a FEW value holds); Some(None): the set is empty
        let leave = match (few, slots.is_empty()) {
            (false, _) => None,
            (true, true) => Some(None),
            (true, false) => encode_few(&slots).map(Some),
        };
        if let Some(e) = leave {
            for w in 0..self.words.len() {
                if v & word_bit(w) != 0 {
                    self.words[w].remove(h);
                }
            }
            self.trim_words();
            match e {
                Some(e) => *self.lo.value_mut(pos) = e,
                None => {
                    self.lo.remove_at(pos);
                }
            }
        } else {
            *self.lo.value_mut(pos) = v;
            self.trim_words();
        }
    }

    /// Sets (replaces) `h`'s mask; `words` must not be all 0.
    pub fn insert(&mut self, h: u64, words: &[u64]) {
        if !self.wide {
            if words[1..].iter().all(|&x| x == 0) {
                self.lo.insert(h, words[0]);
                return;
            }
            self.widen();
        }
        self.remove(h);
        let e = self.put_words(h, words);
        self.lo.insert(h, e);
    }

    /// ORs `words` into `h`'s mask; nothing for an all-zero mask.
    pub fn or_in(&mut self, h: u64, words: &[u64]) {
        if words.iter().all(|&x| x == 0) {
            return;
        }
        if !self.wide && words[1..].iter().all(|&x| x == 0) {
            let (pos, _) = self.lo.get_or_insert(h, 0);
            *self.lo.value_mut(pos) |= words[0];
            return;
        }
        let mut have = self.remove(h).unwrap_or_default();
        if have.len() < words.len() {
            have.resize(words.len(), 0);
        }
        for (a, &b) in have.iter_mut().zip(words) {
            *a |= b;
        }
        self.insert(h, &have);
    }

    pub fn remove(&mut self, h: u64) -> Option<Vec<u64>> {
        let v = self.lo.remove(h)?;
        if !self.wide || !is_words(v) {
            return Some(self.words_of(h, v));
        }
        let mut out = Vec::new();
        for w in 0..self.words.len() {
            if v & word_bit(w) != 0 {
                if let Some(x) = self.words[w].remove(h) {
                    out.resize(w + 1, 0);
                    out[w] = x;
                }
            }
        }
        self.trim_words();
        Some(out)
    }

    /// Clears bit `slot` everywhere; how many entries had it.
    pub fn clear_slot(&mut self, slot: usize) -> usize {
        if !self.wide {
            if slot >= 64 {
                return 0;
            }
            let b = 1u64 << slot;
            let mut n = 0;
            self.lo.retain(|_, v| {
                if *v & b == 0 {
                    return true;
                }
                n += 1;
                *v &= !b;
                *v != 0
            });
            return n;
        }
        let held: Vec<u64> = self.lo.iter().filter(|&(k, v)| self.word_of(k, v, slot / 64) >> (slot % 64) & 1 != 0)
            .map(|(k, _)| k).collect();
        for &h in &held {
            self.clear_bit(h, slot);
        }
        held.len()
    }

    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.lo.allocation_size()
            + self.words.capacity() * std::mem::size_of::<Table>()
            + self.words.iter().map(Table::allocation_size).sum::<usize>()
    }

    /// Checks the invariants (tests).
    #[cfg(test)]
    pub fn check(&self) {
        if !self.wide {
            assert!(self.words.is_empty());
            assert!(self.lo.iter().all(|(_, v)| v != 0));
            return;
        }
        assert!(self.words.last().is_none_or(|t| !t.is_empty()), "no empty last word table");
        for (k, v) in self.lo.iter() {
            let words = self.words_of(k, v);
            assert!(words.iter().any(|&x| x != 0), "no empty mask");
            let slots = slots_of(&words, usize::MAX).unwrap();
            match encode_few(&slots) {
                Some(e) => assert_eq!(v, e, "the FEW form where one fits"),
                None => assert!(is_words(v), "WORDS only where no FEW form fits"),
            }
        }
        for (w, t) in self.words.iter().enumerate() {
            for (k, x) in t.iter() {
                assert!(x != 0, "no 0 word");
                let v = self.lo.get(k).expect("a word's key is in lo");
                assert!(is_words(v) && v & word_bit(w) != 0, "its bitmap has the word");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn few_forms_round_trip() {
        for slots in [vec![0], vec![4094], vec![1, 2, 3, 4, 5], vec![4095], vec![7, 9000, 1_048_574]] {
            let e = encode_few(&slots).unwrap();
            let (s, n) = few_slots(e);
            assert_eq!(&s[..n], &slots[..]);
        }
        assert!(encode_few(&[1, 2, 3, 4, 5, 6]).is_none());
        assert!(encode_few(&[1, 2, 3, 4095]).is_none());
        assert!(encode_few(&[1_048_575]).is_none());
    }

    /// Random sets and clears against a BTreeMap of slot sets, the invariants checked throughout.
    #[test]
    fn agrees_with_sets() {
        let slot_pool = [0usize, 1, 5, 62, 63, 64, 65, 130, 4000, 4094, 4095, 5000, 1_048_574, 1_048_575, 2_000_000];
        for seed0 in 1..40u64 {
            let mut seed = seed0 * 0x9E37_79B9;
            let mut m = Masks::default();
            let mut want: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
            for step in 0..3000 {
                let h = rng(&mut seed) % 16;
                let slot = if seed0 < 10 { (rng(&mut seed) % 60) as usize } else {
                    slot_pool[(rng(&mut seed) % slot_pool.len() as u64) as usize] };
                match rng(&mut seed) % 7 {
                    0..=3 => assert_eq!(m.set_bit(h, slot), want.entry(h).or_default().insert(slot)),
                    4 | 5 => {
                        let had = want.get_mut(&h).is_some_and(|s| s.remove(&slot));
                        assert_eq!(m.clear_bit(h, slot), had);
                    }
                    _ => {
                        let got = m.clear_slot(slot);
                        let had = want.values_mut().map(|s| s.remove(&slot)).filter(|&r| r).count();
                        assert_eq!(got, had);
                    }
                }
                want.retain(|_, s| !s.is_empty());
                if step % 50 == 0 {
                    m.check();
                }
                assert_eq!(m.len(), want.len());
            }
            m.check();
            for (&h, s) in &want {
                let got = slots_of(&m.words(h).unwrap(), usize::MAX).unwrap();
                assert_eq!(got, s.iter().copied().collect::<Vec<_>>());
            }
        }
    }
}
