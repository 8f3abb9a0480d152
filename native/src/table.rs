//! The mask map's hash table: u64 key -> u64 word, open addressing designed for keys that are
//! already uniformly random (canonical block hashes: xxh3-64 output).
//!
//! - Keys are stored *mixed*: `m = mix(k)`, a bijection of u64 (`(k ^ k >> 32) * φ64`), so the table
//!   never hashes again: the home bucket of `m` among `cap` is its top bits, `m * cap >> 64` (= `m >>
//!   shift` when cap is a power of two), and small keys (1, 2, 3 ... as tests use) spread as well as
//!   random ones (Fibonacci hashing). `unmix` gives `k` back.
//! - Slots are interleaved (mixed key, word) pairs of 16 bytes in a 64-byte aligned array: 4 a cache
//!   line, a probe one or two lines (both prefetched by the batched operations). A slot is empty iff
//!   its key is 0 (mix(0) = 0: the one key 0, which would be ambiguous, is kept apart in `zero`); the
//!   word of a present key may be anything, 0 included.
//! - Linear probing, kept *ordered* (Amble & Knuth's ordered hash table, i.e. Robin Hood with ties
//!   broken by key): there is no wrap-around (the array is `cap` buckets plus `slack` overflow slots
//!   past the last bucket, the very last slot always empty), so the occupied slots are sorted by
//!   mixed key over the whole array and each sits at or after its home with no empty slot between.
//!   A lookup counts the slots before its key in a window of 4 without a branch, then checks one
//!   slot: a miss costs no more than a hit. An insertion shifts the rest of its run one slot on; a
//!   deletion shifts back the displaced slots after it (backward-shift deletion: no tombstones);
//!   both without a branch when the run ends within the window.
//! - Growth: 1.5x the buckets past a load of 3/5, so the load stays within 2/5..3/5 (runs short: at
//!   4/5 an insertion or deletion moves ~10 slots, at 3/5 ~2) for the same memory bound as doubling
//!   at 4/5: 16 bytes a bucket, 27 to 40 bytes an entry (+ the slack: 64 slots at most unless a run
//!   ever reaches the end of the array). As the order of keys is the order of homes at every size, a
//!   growth, like `retain`, is one sequential pass (no random access).
//! - Arrays of 2 MiB or more are anonymous mappings of their own, aligned to 2 MiB (where the system
//!   gives every mapping transparent huge pages, theirs stay whole); such an array grows in place
//!   (mremap moves its pages to a bigger mapping: only the new ones are fresh, no copy), which also
//!   keeps the peak of a growth at the new array (plus 4 bytes a key), not old + new. They are not
//!   advised as huge pages (MADV_HUGEPAGE): measured on the 2,048-replica fleet (bench/peers w2048),
//!   the kernel zeroing fresh 2 MiB pages as a growing table touched them took a quarter of the
//!   ingest, and without the advice ingest was 16-38 % faster with lookups no slower (at 64 replicas
//!   both the same).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr;

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
const PHI_INV: u64 = inverse(PHI);

const fn inverse(a: u64) -> u64 {
    // Newton's iteration for the inverse of an odd number modulo 2**64
    let mut x = a; // correct to 3 bits (a * a = 1 mod 8)
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(a.wrapping_mul(x)));
        i += 1;
    }
    x
}

/// The stored form of a key (a bijection; 0 -> 0).
#[inline(always)]
pub fn mix(k: u64) -> u64 {
    (k ^ (k >> 32)).wrapping_mul(PHI)
}

/// The key of a stored form.
#[inline(always)]
pub fn unmix(m: u64) -> u64 {
    let x = m.wrapping_mul(PHI_INV);
    x ^ (x >> 32)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Slot {
    k: u64, // mixed key; 0 = empty
    v: u64,
}

const EMPTY: Slot = Slot { k: 0, v: 0 };

/// `if c { a } else { b }` without a branch.
#[inline(always)]
fn sel(c: bool, a: Slot, b: Slot) -> Slot {
    let m = 0u64.wrapping_sub(c as u64);
    Slot { k: (a.k & m) | (b.k & !m), v: (a.v & m) | (b.v & !m) }
}
const MIN_CAP: usize = 8;
const MAX_SLACK: usize = 64;
const HUGE: usize = 2 << 20;

/// Where a present key is: a slot index, or `ZERO` for the key 0.
pub const ZERO: usize = usize::MAX;

/// Prefetches the cache line holding `p` into all cache levels (no-op off x86_64).
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults, whatever the address
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn bytes_of(total: usize) -> usize {
    total.checked_mul(std::mem::size_of::<Slot>()).expect("table size overflows")
}

fn layout(total: usize) -> Layout {
    Layout::from_size_align(bytes_of(total), 64).expect("table layout")
}

/// Whether an array of `total` slots is an anonymous mapping of its own (else from the allocator).
#[inline]
fn mapped(total: usize) -> bool {
    cfg!(target_os = "linux") && bytes_of(total) >= HUGE
}

/// A zero-filled (= all empty) array of `total` slots, 64-byte aligned. From 2 MiB on, an anonymous
/// mapping of its own, aligned to 2 MiB, which the kernel zero-fills as it is touched and
/// `grow_slots` extends without a copy.
fn alloc_slots(total: usize) -> *mut Slot {
    #[cfg(target_os = "linux")]
    if mapped(total) {
        if let Some(p) = map_aligned(bytes_of(total)) {
            return p as *mut Slot;
        }
        handle_alloc_error(layout(total));
    }
    let l = layout(total);
    // SAFETY: the layout has a non-zero size (total >= MIN_CAP + 1)
    let p = unsafe { alloc_zeroed(l) };
    if p.is_null() {
        handle_alloc_error(l);
    }
    p as *mut Slot
}

/// SAFETY: `p` from alloc_slots(total) or grow_slots(.., total), not freed yet.
unsafe fn free_slots(p: *mut Slot, total: usize) {
    #[cfg(target_os = "linux")]
    if mapped(total) {
        libc::munmap(p as *mut libc::c_void, bytes_of(total));
        return;
    }
    dealloc(p as *mut u8, layout(total));
}

/// A fresh anonymous mapping of `bytes`, aligned to 2 MiB.
#[cfg(target_os = "linux")]
fn map_aligned(bytes: usize) -> Option<*mut u8> {
    // SAFETY: a new private anonymous mapping; its unaligned ends are unmapped again
    unsafe {
        let span = bytes + HUGE;
        let p = libc::mmap(ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE,
                           libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = (base + HUGE - 1) & !(HUGE - 1);
        let end = (start + bytes + 4095) & !4095;
        if start > base {
            libc::munmap(p, start - base);
        }
        if base + span > end {
            libc::munmap(end as *mut libc::c_void, base + span - end);
        }
        Some(start as *mut u8)
    }
}

/// The array `p` of `old` slots moved (its pages, not copied) to a mapping of `new` slots, the new
/// ones empty; None where that cannot be done (then `p` is unchanged).
/// SAFETY: `p` from alloc_slots(old) or grow_slots(.., old), not freed; new > old.
#[allow(unused_variables)]
unsafe fn grow_slots(p: *mut Slot, old: usize, new: usize) -> Option<*mut Slot> {
    #[cfg(target_os = "linux")]
    if mapped(old) {
        // onto a fresh 2 MiB-aligned range (so huge pages stay whole), replacing it
        let dst = map_aligned(bytes_of(new))?;
        let q = libc::mremap(p as *mut libc::c_void, bytes_of(old), bytes_of(new),
                             libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, dst as *mut libc::c_void);
        if q == libc::MAP_FAILED {
            libc::munmap(dst as *mut libc::c_void, bytes_of(new));
            return None;
        }
        return Some(q as *mut Slot);
    }
    None
}

pub struct Table {
    slots: *mut Slot, // `total` slots, or null when cap == 0 (nothing allocated)
    cap: usize,       // buckets (>= MIN_CAP, a multiple of 8), or 0
    total: usize,     // cap + slack
    len: usize,       // keys in the slots (the key 0 not counted)
    grow_at: usize,   // most keys in the slots before a growth
    zero: Option<u64>, // the key 0's word
}

// SAFETY: the table owns its array exclusively (no aliasing, no interior mutability)
unsafe impl Send for Table {}
unsafe impl Sync for Table {}

impl Default for Table {
    fn default() -> Self {
        Table { slots: ptr::null_mut(), cap: 0, total: 0, len: 0, grow_at: 0, zero: None }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if !self.slots.is_null() {
            // SAFETY: allocated by alloc_slots(self.total)
            unsafe { free_slots(self.slots, self.total) };
        }
    }
}

impl Clone for Table {
    fn clone(&self) -> Self {
        let mut t = Table { slots: ptr::null_mut(), ..*self };
        if !self.slots.is_null() {
            t.slots = alloc_slots(self.total);  // (zero-filled: a little more work, but simple)
            // SAFETY: both arrays hold `total` slots, all initialized in self
            unsafe { ptr::copy_nonoverlapping(self.slots, t.slots, self.total) };
        }
        t
    }
}

/// Max load LOAD.0 / LOAD.1: a growth (by GROWTH.0 / GROWTH.1) is due past it.
const LOAD: (usize, usize) = (3, 5);
const GROWTH: (usize, usize) = (3, 2);

#[inline(always)]
fn grow_at(cap: usize) -> usize {
    cap * LOAD.0 / LOAD.1
}

/// The buckets after a growth from `cap`.
fn grown(cap: usize) -> usize {
    (cap * GROWTH.0 / GROWTH.1 + 7) & !7
}

/// The home bucket of `m` among `cap`: its top bits (the high word of m * cap, "fastrange"), so
/// that the order of homes is the order of keys, at any size.
#[inline(always)]
fn bucket(m: u64, cap: usize) -> usize {
    ((m as u128 * cap as u128) >> 64) as usize
}

fn slack_for(cap: usize) -> usize {
    cap.min(MAX_SLACK)
}

impl Table {
    #[inline]
    pub fn len(&self) -> usize {
        self.len + self.zero.is_some() as usize
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes held (the whole array, whatever its load).
    pub fn allocation_size(&self) -> usize {
        if self.slots.is_null() { 0 } else { bytes_of(self.total) }
    }

    #[inline(always)]
    fn at(&self, i: usize) -> Slot {
        debug_assert!(i < self.total);
        // SAFETY: i < total (callers' invariant), all slots initialized
        unsafe { *self.slots.add(i) }
    }

    #[inline(always)]
    fn at_mut(&mut self, i: usize) -> &mut Slot {
        debug_assert!(i < self.total);
        // SAFETY: as `at`
        unsafe { &mut *self.slots.add(i) }
    }

    /// Starts loading the cache line of `m`'s home bucket.
    #[inline(always)]
    pub fn prefetch(&self, m: u64) {
        if self.cap != 0 {
            let p = self.slots.wrapping_add(bucket(m, self.cap));
            prefetch(p);
            prefetch(p.wrapping_add(4));  // the next line: runs cross it (and shifts go on in it)
        }
    }

    /// The first slot at or after `m`'s home whose key is >= m (empty: +inf), and whether it is m.
    /// m != 0, cap != 0.
    #[inline(always)]
    fn probe(&self, m: u64) -> (usize, bool) {
        let mut i = bucket(m, self.cap);
        let want = m - 1;
        // the keys before m's slot are a prefix of the run (sorted): count them in a window of 4
        // slots without a branch (home + 3 < total: the slack is >= 8 slots)
        // SAFETY: i + 3 < total
        let c = unsafe {
            let p = self.slots.add(i);
            ((*p).k.wrapping_sub(1) < want) as usize
                + ((*p.add(1)).k.wrapping_sub(1) < want) as usize
                + ((*p.add(2)).k.wrapping_sub(1) < want) as usize
                + ((*p.add(3)).k.wrapping_sub(1) < want) as usize
        };
        i += c;
        if c == 4 {
            loop {
                let k = self.at(i).k;
                if k.wrapping_sub(1) >= want {
                    break;
                }
                i += 1; // the last slot is empty: the scan ends in the array
            }
        }
        (i, self.at(i).k == m)
    }

    /// Where `m` is, if present.
    #[inline(always)]
    pub fn find(&self, m: u64) -> Option<usize> {
        if m == 0 {
            return self.zero.map(|_| ZERO);
        }
        if self.cap == 0 {
            return None;
        }
        match self.probe(m) {
            (i, true) => Some(i),
            _ => None,
        }
    }

    #[inline(always)]
    pub fn get(&self, m: u64) -> Option<u64> {
        if m == 0 {
            return self.zero;
        }
        if self.cap == 0 {
            return None;
        }
        match self.probe(m) {
            (i, true) => Some(self.at(i).v),
            _ => None,
        }
    }

    #[inline(always)]
    pub fn contains(&self, m: u64) -> bool {
        self.find(m).is_some()
    }

    #[inline(always)]
    pub fn value_mut(&mut self, pos: usize) -> &mut u64 {
        if pos == ZERO {
            self.zero.get_or_insert(0)
        } else {
            &mut self.at_mut(pos).v
        }
    }

    /// `m`'s position, inserting it with word `v` if absent (then true). Positions of other keys
    /// move.
    #[inline(always)]
    pub fn get_or_insert(&mut self, m: u64, v: u64) -> (usize, bool) {
        if m == 0 || self.cap == 0 {
            return self.get_or_insert_slow(m, v);
        }
        let (i, found) = self.probe(m);
        if found {
            return (i, false);
        }
        if self.len >= self.grow_at || i + 4 >= self.total {
            return self.get_or_insert_slow(m, v);
        }
        // SAFETY: i + 4 < total
        unsafe {
            let p = self.slots.add(i);
            let (s0, s1, s2, s3) = (*p, *p.add(1), *p.add(2), *p.add(3));
            // the run's end: the first empty slot of the 4, e = 3 meaning s3
            let e = (s0.k != 0) as usize + (s0.k != 0 && s1.k != 0) as usize
                + (s0.k != 0 && s1.k != 0 && s2.k != 0) as usize;
            if e == 3 && s3.k != 0 {
                return self.get_or_insert_slow(m, v);  // a longer run
            }
            // without a branch: slots i..e move one on (those after e are rewritten as they are)
            *p.add(3) = sel(e >= 3, s2, s3);
            *p.add(2) = sel(e >= 2, s1, s2);
            *p.add(1) = sel(e >= 1, s0, s1);
            *p = Slot { k: m, v };
        }
        self.len += 1;
        (i, true)
    }

    #[inline(never)]
    fn get_or_insert_slow(&mut self, m: u64, v: u64) -> (usize, bool) {
        if m == 0 {
            let new = self.zero.is_none();
            if new {
                self.zero = Some(v);
            }
            return (ZERO, new);
        }
        if self.cap == 0 {
            self.rebuild(MIN_CAP, slack_for(MIN_CAP));
        }
        let (mut i, found) = self.probe(m);
        if found {
            return (i, false);
        }
        if self.len >= self.grow_at {
            self.rebuild(grown(self.cap), slack_for(grown(self.cap)));
            i = self.probe(m).0;
        }
        let mut e = i;
        while self.at(e).k != 0 {
            e += 1;
        }
        if e == self.total - 1 {
            // the run reaches the end of the array: more slack (never hit with random keys)
            self.rebuild(self.cap, (self.total - self.cap) * 2);
            return self.get_or_insert_slow(m, v);
        }
        // SAFETY: i <= e < total - 1: slots i..e shift to i+1..=e (e was empty)
        unsafe {
            let p = self.slots.add(i);
            let mut j = e;
            while j > i {
                *p.add(j - i) = *p.add(j - i - 1);
                j -= 1;
            }
            *p = Slot { k: m, v };
        }
        self.len += 1;
        (i, true)
    }

    /// Sets `m`'s word; the old one if it was present.
    pub fn insert(&mut self, m: u64, v: u64) -> Option<u64> {
        let (pos, new) = self.get_or_insert(m, v);
        if new {
            return None;
        }
        Some(std::mem::replace(self.value_mut(pos), v))
    }

    /// Deletes the key at `pos` (of `find`); its word.
    #[inline(always)]
    pub fn remove_at(&mut self, pos: usize) -> u64 {
        if pos == ZERO || pos + 5 > self.total {
            return self.remove_at_slow(pos);
        }
        let cap = self.cap;
        // SAFETY: pos + 4 < total
        unsafe {
            let p = self.slots.add(pos);
            let v = (*p).v;
            let (s1, s2, s3) = (*p.add(1), *p.add(2), *p.add(3));
            // slot pos + j moves back iff it holds a key away from its home (and all before it move)
            let d1 = s1.k != 0 && bucket(s1.k, cap) <= pos;
            let d2 = d1 && s2.k != 0 && bucket(s2.k, cap) <= pos + 1;
            let d3 = d2 && s3.k != 0 && bucket(s3.k, cap) <= pos + 2;
            if d3 {
                return self.remove_at_slow(pos);  // a longer shift
            }
            // without a branch: slots after pos move back up to the first that stays, which empties
            *p = sel(d1, s1, EMPTY);
            *p.add(1) = sel(d2, s2, sel(d1, EMPTY, s1));
            *p.add(2) = sel(d2, EMPTY, s2);
            self.len -= 1;
            v
        }
    }

    #[inline(never)]
    fn remove_at_slow(&mut self, pos: usize) -> u64 {
        if pos == ZERO {
            return self.zero.take().unwrap_or(0);
        }
        let v = self.at(pos).v;
        let cap = self.cap;
        let mut j = pos + 1;
        loop {
            let s = self.at(j);
            if s.k == 0 || bucket(s.k, cap) >= j {
                break; // the end of the run, or a key at its home: nothing after it moves
            }
            *self.at_mut(j - 1) = s;
            j += 1;
        }
        *self.at_mut(j - 1) = EMPTY;
        self.len -= 1;
        v
    }

    #[inline]
    pub fn remove(&mut self, m: u64) -> Option<u64> {
        let pos = self.find(m)?;
        Some(self.remove_at(pos))
    }

    /// Makes room for `n` more keys without growing.
    pub fn reserve(&mut self, n: usize) {
        let want = self.len + n;
        if want <= self.grow_at {
            return;
        }
        let cap = ((want * LOAD.1).div_ceil(LOAD.0) + 7) & !7;
        self.rebuild(cap, slack_for(cap).max(self.total - self.cap));
    }

    /// Moves the keys to a new array of `cap` buckets and `slack` overflow slots (more slack if a
    /// run would reach its end): one pass, in key order.
    fn rebuild(&mut self, cap: usize, slack: usize) {
        debug_assert!(cap.is_multiple_of(8) && cap >= MIN_CAP && slack >= 1);
        if cap > self.cap && !self.slots.is_null() && self.grow_in_place(cap, slack) {
            return;
        }
        let total = cap + slack;
        let dst = alloc_slots(total);  // all empty
        let mut next = 0;
        for i in 0..if self.slots.is_null() { 0 } else { self.total } {
            // without a branch on the slot: an empty one is written (empty) where the next key
            // would go
            let s = self.at(i);
            let pos = bucket(s.k, cap).max(next);
            if s.k != 0 && pos >= total - 1 {
                // SAFETY: dst was allocated so
                unsafe { free_slots(dst, total) };
                return self.rebuild(cap, slack * 2);
            }
            // SAFETY: pos < total - 1 for a key, pos = next <= total - 1 for an empty slot
            unsafe { dst.add(pos).write(s) };
            next = if s.k != 0 { pos + 1 } else { next };
        }
        if !self.slots.is_null() {
            // SAFETY: allocated by alloc_slots(self.total)
            unsafe { free_slots(self.slots, self.total) };
        }
        self.slots = dst;
        self.cap = cap;
        self.total = total;
        self.grow_at = grow_at(cap);
    }

    /// Grows to `cap` buckets and `slack` (or more) overflow slots in the same pages (a mapped
    /// array: the kernel moves them to a bigger mapping, only the new ones are fresh): the new
    /// slot of every key is computed in key order, then the keys move on from the last one. False
    /// if the array cannot grow in place.
    fn grow_in_place(&mut self, cap: usize, slack: usize) -> bool {
        let (old_total, n) = (self.total, self.len);
        let mut total = cap + slack;
        if total > u32::MAX as usize || !mapped(old_total) {
            return false;
        }
        let mut to = vec![0u32; n + 1];  // new slot of each key in order (+ one written past)
        loop {
            // without a branch on the slot (about as many are empty as not)
            let (mut next, mut j) = (0, 0);
            for i in 0..old_total {
                let k = self.at(i).k;
                let pos = bucket(k, cap).max(next);
                // SAFETY: j <= n (n keys in the array), `to` has n + 1 entries
                unsafe { *to.get_unchecked_mut(j) = pos as u32 };
                let occupied = k != 0;
                j += occupied as usize;
                next = if occupied { pos + 1 } else { next };
            }
            debug_assert_eq!(j, n);
            if next < total {
                break;  // the last slot stays empty
            }
            total = cap + (total - cap) * 2;  // a run past the end: more slack
        }
        // SAFETY: the array is this table's; total > old_total
        let Some(p) = (unsafe { grow_slots(self.slots, old_total, total) }) else { return false };
        self.slots = p;
        self.total = total;
        let mut j = n;
        for i in (0..old_total).rev() {
            // old slots past i are done, none below i written yet: a key's new slot is at or after
            // its old one (by induction in key order: new home >= old home, and so new slot =
            // max(new home, previous new slot + 1) >= max(old home, previous old slot + 1)), so it
            // lands past every key not moved yet
            let s = self.at(i);
            let occupied = s.k != 0;
            j -= occupied as usize;
            // (without a branch: about as many slots are empty as not)
            // SAFETY: j <= n, `to` has n + 1 entries
            let tj = unsafe { *to.get_unchecked(j) } as usize;
            let keep = 0usize.wrapping_sub(occupied as usize);
            let t = (tj & keep) | (i & !keep);
            debug_assert!(t >= i);
            *self.at_mut(i) = EMPTY;
            *self.at_mut(t) = s;
        }
        self.cap = cap;
        self.grow_at = grow_at(cap);
        true
    }

    /// Keeps the keys for which `f(m, &mut word)` is true (it may change the word): one pass.
    pub fn retain(&mut self, mut f: impl FnMut(u64, &mut u64) -> bool) {
        if let Some(mut v) = self.zero {
            self.zero = if f(0, &mut v) { Some(v) } else { None };
        }
        if self.slots.is_null() {
            return;
        }
        let cap = self.cap;
        let mut next = 0;
        let mut len = 0;
        for i in 0..self.total {
            let mut s = self.at(i);
            if s.k == 0 {
                continue;
            }
            *self.at_mut(i) = EMPTY;
            if f(s.k, &mut s.v) {
                // a kept key only moves back (to its home at the latest): i >= pos
                let pos = bucket(s.k, cap).max(next);
                *self.at_mut(pos) = s;
                next = pos + 1;
                len += 1;
            }
        }
        self.len = len;
    }

    /// The (mixed key, word) pairs: the key 0 first, then in mixed-key order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let slots: &[Slot] = if self.slots.is_null() {
            &[]
        } else {
            // SAFETY: `total` initialized slots, borrowed with self
            unsafe { std::slice::from_raw_parts(self.slots, self.total) }
        };
        self.zero.map(|v| (0, v)).into_iter().chain(slots.iter().filter(|s| s.k != 0).map(|s| (s.k, s.v)))
    }

    /// The (mixed key, word) pairs with lo <= key < hi (hi None: to the end), in key order, read from
    /// lo's home bucket on: the array is sorted by key and no key sits before its home.
    pub fn range(&self, lo: u64, hi: Option<u64>) -> impl Iterator<Item = (u64, u64)> + '_ {
        let slots: &[Slot] = if self.slots.is_null() {
            &[]
        } else {
            // SAFETY: as `iter`
            unsafe { std::slice::from_raw_parts(self.slots, self.total) }
        };
        let start = if self.cap == 0 { 0 } else { bucket(lo, self.cap) };
        let zero = if lo == 0 { self.zero.map(|v| (0, v)) } else { None };
        zero.into_iter().chain(
            slots[start..]
                .iter()
                .filter(|s| s.k != 0)
                .skip_while(move |s| s.k < lo)
                .take_while(move |s| hi.is_none_or(|h| s.k < h))
                .map(|s| (s.k, s.v)),
        )
    }

    /// Checks the invariants (tests).
    #[cfg(test)]
    fn check(&self) {
        let mut n = 0;
        let mut prev = 0u64;
        for i in 0..self.total {
            let k = self.at(i).k;
            if k == 0 {
                continue;
            }
            n += 1;
            assert!(k > prev, "sorted");
            prev = k;
            let home = bucket(k, self.cap);
            assert!(home <= i);
            assert!((home..i).all(|j| self.at(j).k != 0), "no gap between home and slot");
        }
        assert_eq!(n, self.len);
        assert!(self.total == 0 || self.at(self.total - 1).k == 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mix_is_a_bijection() {
        for k in [0u64, 1, 2, 3, 1 << 32, u64::MAX, u64::MAX - 1, PHI, 12345678901234567] {
            assert_eq!(unmix(mix(k)), k);
            assert_eq!(mix(unmix(k)), k);
        }
        assert_eq!(PHI.wrapping_mul(PHI_INV), 1);
        assert_eq!(mix(0), 0);
    }

    fn run(keys: &[u64], ops: usize, seed: u64) {
        let mut t = Table::default();
        let mut r: HashMap<u64, u64> = HashMap::new();
        let mut x = seed | 1;
        for step in 0..ops {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = keys[(x % keys.len() as u64) as usize];
            let m = mix(k);
            match (x >> 32) % 4 {
                0 | 1 => {
                    let (pos, new) = t.get_or_insert(m, step as u64);
                    assert_eq!(new, !r.contains_key(&k));
                    *t.value_mut(pos) += 1;
                    *r.entry(k).or_insert(step as u64) += 1;
                }
                2 => assert_eq!(t.remove(m), r.remove(&k)),
                _ => assert_eq!(t.get(m), r.get(&k).copied()),
            }
            if step % 97 == 0 {
                t.check();
                assert_eq!(t.len(), r.len());
            }
        }
        t.check();
        let mut got: Vec<(u64, u64)> = t.iter().map(|(m, v)| (unmix(m), v)).collect();
        got.sort();
        let mut want: Vec<(u64, u64)> = r.into_iter().collect();
        want.sort();
        assert_eq!(got, want);
        // ranges of stored keys: each the sorted keys in it, together all of them
        let all: Vec<(u64, u64)> = t.iter().collect();
        for bits in [1u32, 3, 8] {
            let step = 1u64 << (64 - bits);
            let mut joined = Vec::new();
            for i in 0..(1u64 << bits) {
                let hi = if i + 1 == 1 << bits { None } else { Some((i + 1) * step) };
                let part: Vec<(u64, u64)> = t.range(i * step, hi).collect();
                assert!(part.iter().all(|&(m, _)| m >= i * step && hi.is_none_or(|h| m < h)));
                joined.extend(part);
            }
            assert_eq!(joined, all);
        }
        let c = t.clone();
        c.check();
        t.retain(|m, v| {
            *v += 1;
            m % 3 != 0
        });
        t.check();
        assert_eq!(t.len(), c.iter().filter(|(m, _)| m % 3 != 0).count());
    }

    #[test]
    fn random_keys() {
        let mut x = 7u64;
        let keys: Vec<u64> = (0..5000)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                x
            })
            .collect();
        run(&keys, 100_000, 3);
    }

    #[test]
    fn small_and_edge_keys() {
        let mut keys: Vec<u64> = (0..300).collect();
        keys.extend([u64::MAX, u64::MAX - 1, 1 << 63, 1 << 32, unmix(u64::MAX), unmix(1)]);
        run(&keys, 50_000, 5);
        run(&keys[..3], 2_000, 9);
    }

    #[test]
    fn large_tables_grow_in_place() {
        // past 2 MiB the array is a mapping of its own, grown by moving its pages
        let mut t = Table::default();
        let mut r: HashMap<u64, u64> = HashMap::new();
        let mut x = 99u64;
        let mut mapped_growths = 0;
        for step in 0..600_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let k = if step % 7 == 0 { x % 5000 } else { x >> 3 };
            let m = mix(k);
            if step % 5 == 4 {
                assert_eq!(t.remove(m), r.remove(&k));
            } else {
                let (pos, new) = t.get_or_insert(m, step);
                assert_eq!(new, !r.contains_key(&k));
                *t.value_mut(pos) ^= 1;
                *r.entry(k).or_insert(step) ^= 1;
            }
            if t.total != 0 && mapped(t.total) && t.len + 1 == t.grow_at {
                t.check();
                mapped_growths += 1;
            }
        }
        t.check();
        assert!(mapped_growths >= 2, "{mapped_growths}");
        assert_eq!(t.len(), r.len());
        for (k, v) in &r {
            assert_eq!(t.get(mix(*k)), Some(*v));
        }
        let c = t.clone();
        c.check();
        assert_eq!(c.iter().count(), r.len());
        t.reserve(3 * t.len());  // a big step at once, in place too
        t.check();
        assert_eq!(t.iter().map(|(m, v)| (unmix(m), v)).collect::<HashMap<_, _>>(), r);
    }

    #[test]
    fn keys_that_crowd_the_end_get_slack() {
        // stored forms all in the last bucket of any size: runs past the end of the array
        let keys: Vec<u64> = (0..500u64).map(|i| unmix(u64::MAX - i)).collect();
        run(&keys, 20_000, 11);
        let keys: Vec<u64> = (1..500u64).map(unmix).collect(); // all in bucket 0
        run(&keys, 20_000, 13);
    }
}
