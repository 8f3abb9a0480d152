//! Token ids of a JSON lookup body, parsed straight to packed little-endian uint32: a 13k-token prompt
//! otherwise costs ~13k Python ints to decode and pack (most of a token lookup's CPU). Strict: a plain
//! JSON array of non-negative integers below 2**32 and whitespace; anything else is None, and the
//! service decodes the body the ordinary way (so a bad body gets the ordinary error).
//!
//! `split_token_ids` takes the whole body: the array is cut out of the object here, so no JSON
//! decoder walks the tokens at all (a decoder skipping them as raw text costs more than parsing them).
//!
//! Arrays as routers write them ("1,2,3", or Python's "1, 2, 3") are read 64 bytes at a time on
//! x86-64 (`read_blocks`): the block's bytes classed at once, then with AVX-512 (F, BW, VBMI, VBMI2)
//! its numbers gathered and converted together, else each from where it starts. 122k tokens, this
//! host (AMD EPYC): 172 us with AVX-512, 330 us without, 575 us number by number (`read_rest`,
//! which reads every other spacing, every array's last bytes and other CPUs). tests/unit/core/
//! test_maskmap.py holds each reading (`token_reader` pins one) to a JSON decoder, with a fault put
//! at every byte.

use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The 1-7 digit number at `raw[i..]` read 8 bytes at a time (SWAR; most token ids are 3-6 digits):
/// (value, digits), or None where fewer than 8 bytes are left or all 8 are digits (the byte loop
/// reads those).
#[inline(always)]
fn digits8(raw: &[u8], i: usize) -> Option<(u64, usize)> {
    let chunk = u64::from_le_bytes(raw.get(i..i + 8)?.try_into().ok()?);
    let x = chunk ^ 0x3030_3030_3030_3030; // a digit byte becomes its value 0..9
    // the high bit of each byte that is not a digit (a carry out of such a byte can only flag the
    // bytes after it, so the first flagged byte is right)
    let nondigit = (x.wrapping_add(0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
    if nondigit == 0 {
        return None;
    }
    let len = (nondigit.trailing_zeros() / 8) as usize;
    if len == 0 {
        return Some((0, 0));
    }
    Some((eight_digits(x << (8 * (8 - len))), len)) // the digits in the high bytes, zeros below
}

#[inline(always)]
fn ws(b: u8) -> bool {
    b == b' ' || b == b'\n' || b == b'\r' || b == b'\t'
}

#[inline(always)]
fn skip_ws(raw: &[u8], mut i: usize) -> usize {
    while i < raw.len() && ws(raw[i]) {
        i += 1;
    }
    i
}

/// The JSON array of token ids at raw[i] (after whitespace) appended to `out` as little-endian
/// uint32s: the index just past its ']', or None for anything but such an array. Arrays written
/// compactly ("1,2,3") or with Python's default separators ("1, 2, 3") are read 64 bytes at a time
/// (`read_blocks`); everything else, and their last few bytes, number by number (`read_rest`).
fn read_ids(raw: &[u8], i: usize, out: &mut Vec<u8>) -> Option<usize> {
    let mut i = skip_ws(raw, i);
    if raw.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(raw, i + 1);
    if raw.get(i) == Some(&b']') {
        return Some(i + 1); // an empty array
    }
    #[cfg(target_arch = "x86_64")]
    if READER.load(Ordering::Relaxed) >= BLOCKS {
        if let Some(after) = read_blocks(raw, i, out) {
            return read_rest(raw, after, false, out);
        }
    }
    out.clear();
    read_rest(raw, i, true, out)
}

/// The array's numbers from raw[i] on, one by one: at a number (`at_number`) or just past one (at
/// its separator); the index just past the array's ']', or None.
fn read_rest(raw: &[u8], mut i: usize, at_number: bool, out: &mut Vec<u8>) -> Option<usize> {
    let n = raw.len();
    if !at_number && !separator(raw, &mut i)? {
        return Some(i);
    }
    loop {
        // an integer: no sign, no leading zeros (JSON), no fraction or exponent (that is a float)
        let start = i;
        let v = match digits8(raw, i) {
            Some((v, len)) => {
                i += len;
                v
            }
            None => {
                let mut v: u64 = 0;
                while i < n && raw[i].is_ascii_digit() && i - start < 11 {
                    v = v * 10 + (raw[i] - b'0') as u64;
                    i += 1;
                }
                v
            }
        };
        let len = i - start;
        if len == 0 || len > 10 || v > u32::MAX as u64 || (len > 1 && raw[start] == b'0') {
            return None;
        }
        out.extend_from_slice(&(v as u32).to_le_bytes());
        if !separator(raw, &mut i)? {
            return Some(i);
        }
    }
}

/// Past the separator after a number: "," (true: a number follows) or "]" (false: the array ended),
/// with whitespace around; None for anything else.
#[inline(always)]
fn separator(raw: &[u8], i: &mut usize) -> Option<bool> {
    let mut c = *raw.get(*i)?;
    if ws(c) {
        *i = skip_ws(raw, *i);
        c = *raw.get(*i)?;
    }
    match c {
        b',' => {
            *i += 1;
            if raw.get(*i).is_some_and(|&b| ws(b)) {
                *i = skip_ws(raw, *i);
            }
            Some(true)
        }
        b']' => {
            *i += 1;
            Some(false)
        }
        _ => None,
    }
}

/// Bit k set where raw[p + k] is a digit, a comma, a space, a '0' (AVX-512 where `WIDE`, else SSE2,
/// which every x86-64 has); 64 bytes are readable at p.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn classify64<const WIDE: bool>(raw: &[u8], p: usize) -> (u64, u64, u64, u64) {
    use std::arch::x86_64::*;
    let at = raw.as_ptr().add(p);
    if WIDE {
        let x = _mm512_loadu_si512(at as *const _);
        let below_ten = _mm512_sub_epi8(x, _mm512_set1_epi8(b'0' as i8));
        return (
            _mm512_cmplt_epu8_mask(below_ten, _mm512_set1_epi8(10)),
            _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(b',' as i8)),
            _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(b' ' as i8)),
            _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(b'0' as i8)),
        );
    }
    let (mut digit, mut comma, mut space, mut zero) = (0u64, 0u64, 0u64, 0u64);
    let zeros = _mm_set1_epi8(b'0' as i8);
    let nine = _mm_set1_epi8(9);
    let commas = _mm_set1_epi8(b',' as i8);
    let spaces = _mm_set1_epi8(b' ' as i8);
    for k in 0..4 {
        let x = _mm_loadu_si128(at.add(16 * k) as *const __m128i);
        let d = _mm_sub_epi8(x, zeros);
        let is_digit = _mm_cmpeq_epi8(_mm_min_epu8(d, nine), d); // x - '0' <= 9, unsigned
        digit |= (_mm_movemask_epi8(is_digit) as u32 as u64) << (16 * k);
        comma |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, commas)) as u32 as u64) << (16 * k);
        space |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, spaces)) as u32 as u64) << (16 * k);
        zero |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, zeros)) as u32 as u64) << (16 * k);
    }
    (digit, comma, space, zero)
}

/// The values of 8-byte numbers written with leading zeros ("00012345"; the zeros may be NUL
/// bytes) appended to `out` as little-endian uint32s.
#[cfg(target_arch = "x86_64")]
fn append_values(padded: &[u64], out: &mut Vec<u8>) {
    if std::is_x86_feature_detected!("avx2") {
        let at = out.len();
        out.reserve(4 * padded.len());
        // SAFETY: the CPU has AVX2 (checked above); the 4 * len bytes after `at` are reserved, all
        // written before the length covers them
        unsafe {
            values_avx2(padded, out.as_mut_ptr().add(at));
            out.set_len(at + 4 * padded.len());
        }
    } else {
        for v in padded {
            out.extend_from_slice(&swar_padded(*v).to_le_bytes());
        }
    }
}

/// An 8-byte number with leading zeros ("00012345", zeros may be NUL) to its value (SWAR).
#[inline(always)]
fn swar_padded(chunk: u64) -> u32 {
    eight_digits(chunk & 0x0F0F_0F0F_0F0F_0F0F) as u32
}

/// Eight digit values (0-9, one a byte, the first in the low byte) to their number: pairs, fours,
/// eights by multiplies (SWAR).
#[inline(always)]
fn eight_digits(mut d: u64) -> u64 {
    d = (d * 10) + (d >> 8);
    (((d & 0x0000_00FF_0000_00FF).wrapping_mul(100 + (1_000_000 << 32)))
        + (((d >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32)))) >> 32
}

/// `append_values` 8 numbers at a time (digit pairs, fours and eights by multiply-adds), written
/// at `out` (4 * padded.len() bytes writable).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn values_avx2(padded: &[u64], out: *mut u8) {
    use std::arch::x86_64::*;
    let low4 = _mm256_set1_epi8(0x0F);
    let tens = _mm256_set1_epi16(0x010A); // bytes 10, 1: the first digit of a pair times ten
    let hundreds = _mm256_set1_epi32(0x0001_0064); // 16-bit 100, 1
    let ten_thousands = _mm256_set1_epi32(0x0001_2710); // 16-bit 10000, 1
    let mut k = 0;
    while k + 8 <= padded.len() {
        let a = _mm256_loadu_si256(padded.as_ptr().add(k) as *const __m256i);
        let b = _mm256_loadu_si256(padded.as_ptr().add(k + 4) as *const __m256i);
        let a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(a, low4), tens), hundreds);
        let b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(b, low4), tens), hundreds);
        // each number's two 4-digit halves, as 16-bit pairs (lanes interleaved: a0 a1 b0 b1 | a2 a3 b2 b3)
        let v = _mm256_madd_epi16(_mm256_packus_epi32(a, b), ten_thousands);
        let v = _mm256_permute4x64_epi64(v, 0b11_01_10_00);
        _mm256_storeu_si256(out.add(4 * k) as *mut __m256i, v);
        k += 8;
    }
    for (j, v) in padded.iter().enumerate().skip(k) {
        std::ptr::copy_nonoverlapping(swar_padded(*v).to_le_bytes().as_ptr(), out.add(4 * j), 4);
    }
}

/// How split_token_ids reads token arrays: number by number (NUMBERS), 64-byte blocks (BLOCKS), and
/// with AVX-512 the numbers of a block converted at once (WIDE, where the CPU has it). The widest by
/// default; `token_reader` pins a narrower one (tests hold each to a JSON decoder).
static READER: AtomicU8 = AtomicU8::new(WIDE);
const NUMBERS: u8 = 0;
const BLOCKS: u8 = 1;
const WIDE: u8 = 2;

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vbmi")
            && std::is_x86_feature_detected!("avx512vbmi2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The token-array reading split_token_ids uses ("wide", "blocks" or "numbers": what this CPU runs
/// of the one asked for), after pinning `reader` if given (tests; any other name: the widest).
#[pyfunction]
#[pyo3(signature = (reader=None))]
pub fn token_reader(reader: Option<&str>) -> &'static str {
    if let Some(name) = reader {
        let level = match name {
            "numbers" => NUMBERS,
            "blocks" => BLOCKS,
            _ => WIDE,
        };
        READER.store(level, Ordering::Relaxed);
    }
    match READER.load(Ordering::Relaxed) {
        WIDE if has_avx512() => "wide",
        NUMBERS => "numbers",
        _ if cfg!(target_arch = "x86_64") => "blocks",
        _ => "numbers",
    }
}

/// The numbers of the 64-byte block at raw[p..] (first digits `starts`, last digits `ends`, each
/// number whole in the block) appended to `out` as little-endian uint32s, 8 at a time: each
/// number's digits gathered right-aligned into 8 bytes by one byte permutation, then pairs, fours
/// and eights by multiply-adds. False (nothing appended) if a number has more than 8 digits.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn numbers_avx512(raw: &[u8], p: usize, starts: u64, ends: u64, out: &mut Vec<u8>) -> bool {
    use std::arch::x86_64::*;
    static IOTA: [u8; 64] = {
        let mut a = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            a[k] = k as u8;
            k += 1;
        }
        a
    };
    static LANE: [u8; 64] = {
        let mut a = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            a[k] = (k / 8) as u8; // byte k of the result belongs to number k / 8 of the group
            k += 1;
        }
        a
    };
    static BACK: [i8; 64] = {
        let mut a = [0i8; 64];
        let mut k = 0;
        while k < 64 {
            a[k] = (k % 8) as i8 - 7; // byte b of a number's 8 is its last digit's position - 7 + b
            k += 1;
        }
        a
    };
    let n = ends.count_ones() as usize;
    let iota = _mm512_loadu_si512(IOTA.as_ptr() as *const _);
    // the numbers' first and last positions, packed in order (zeros past the n-th)
    let first = _mm512_maskz_compress_epi8(starts, iota);
    let last = _mm512_maskz_compress_epi8(ends, iota);
    let live = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    if _mm512_mask_cmpgt_epu8_mask(live, _mm512_sub_epi8(last, first), _mm512_set1_epi8(7)) != 0 {
        return false;
    }
    let block = _mm512_loadu_si512(raw.as_ptr().add(p) as *const _);
    let back = _mm512_loadu_si512(BACK.as_ptr() as *const _);
    let eight = _mm512_set1_epi8(8);
    let low4 = _mm512_set1_epi8(0x0F);
    let tens = _mm512_set1_epi16(0x010A); // bytes 10, 1: the first digit of a pair times ten
    let hundreds = _mm512_set1_epi32(0x0001_0064); // 16-bit 100, 1
    let ten_thousands = _mm512_set1_epi64(10_000);
    // 8 numbers a round; the rounds write whole 32 bytes, past the n-th number too (reserved, and
    // not counted in the length)
    out.reserve(4 * n + 32);
    let at = out.len();
    let dst = out.as_mut_ptr().add(at);
    let mut lane = _mm512_loadu_si512(LANE.as_ptr() as *const _);
    let mut k = 0;
    while k < n {
        let from = _mm512_permutexvar_epi8(lane, first);
        let to = _mm512_add_epi8(_mm512_permutexvar_epi8(lane, last), back);
        // leading bytes before the number's first digit are zero (signed: `to` may be below 0)
        let digits = _mm512_maskz_permutexvar_epi8(_mm512_cmpge_epi8_mask(to, from), to, block);
        let fours = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(digits, low4), tens), hundreds);
        // each number: its high four digits (low 32 bits) times 10,000 plus its low four
        let v = _mm512_add_epi64(_mm512_mul_epu32(fours, ten_thousands), _mm512_srli_epi64(fours, 32));
        _mm256_storeu_si256(dst.add(4 * k) as *mut __m256i, _mm512_cvtepi64_epi32(v));
        lane = _mm512_add_epi8(lane, eight);
        k += 8;
    }
    out.set_len(at + 4 * n);
    true
}

/// The array's numbers read 64 bytes at a time from raw[i] (its first digit): the bytes are classed
/// at once (digits, commas, spaces) and the block checked to be "1,2" or "1, 2" as a whole, then
/// each number is read from where it starts; the numbers do not wait for each other (a number at a
/// time waits for the previous one's length: ~13 cycles a token). Stops before the last 72 bytes
/// (a number's 8-byte read stays in bounds) and before any other byte (the array's ']', other
/// whitespace): the index just past the last number read, for `read_rest`; None where a block is
/// not of that form, a number has a leading zero or more than 8 digits (7 across a block's edge),
/// or nothing was read (`read_rest` reads the whole array).
#[cfg(target_arch = "x86_64")]
fn read_blocks(raw: &[u8], i: usize, out: &mut Vec<u8>) -> Option<usize> {
    if READER.load(Ordering::Relaxed) >= WIDE && has_avx512() {
        // SAFETY: the CPU has AVX-512 F, BW, VBMI and VBMI2 (checked above)
        unsafe { read_blocks_wide(raw, i, out) }
    } else {
        // SAFETY: WIDE is false: SSE2 only, which every x86-64 has
        unsafe { read_blocks_with::<false>(raw, i, out) }
    }
}

/// `read_blocks` compiled for AVX-512: the bytes classed and the numbers converted 64 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2")]
unsafe fn read_blocks_wide(raw: &[u8], i: usize, out: &mut Vec<u8>) -> Option<usize> {
    read_blocks_with::<true>(raw, i, out)
}

/// `read_blocks` with AVX-512 (`WIDE`: the caller has checked the CPU has it) or SSE2. Every raw
/// read is in bounds: p + 72 <= raw.len() for the block at p and a number's 8 bytes from p + 64.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn read_blocks_with<const WIDE: bool>(raw: &[u8], i: usize, out: &mut Vec<u8>) -> Option<usize> {
    let mut p = i;
    let mut last_end = None;
    // the byte before the block: a digit, a comma (bit 63 of the last block)
    let (mut prev_digit, mut prev_comma) = (0u64, 0u64);
    // the numbers read so far, each as its 8 bytes with its digits moved to the end ("00012345"):
    // converted 8 at a time once STAGED are in
    const STAGED: usize = 256;
    let mut padded = [0u64; STAGED + 64];
    let mut count = 0;
    while p + 72 <= raw.len() {
        let (mut digit, mut comma, mut space, zero) = classify64::<WIDE>(raw, p);
        let other = !(digit | comma | space);
        let keep = if other == 0 { u64::MAX } else { (1u64 << other.trailing_zeros()) - 1 };
        digit &= keep;
        comma &= keep;
        space &= keep;
        let after_digit = (digit << 1) | prev_digit;
        // every comma follows a digit and every space a comma: "1,2" and "1, 2" only (",," and
        // ", ," are a comma after a non-digit, ",  " a space after a space); the byte before the
        // array's first number is '[' (not a digit), so a leading comma is refused too
        if comma & !after_digit != 0 || space & !((comma << 1) | prev_comma) != 0 {
            return None;
        }
        // each number's first and last digit; a number begun in the block before was read there
        let next_is_digit = (other == 0 && raw[p + 64].is_ascii_digit()) as u64;
        let mut starts = digit & !after_digit;
        let mut ends = digit & !((digit >> 1) | (next_is_digit << 63));
        if digit & prev_digit != 0 {
            ends &= ends - 1;
        }
        if starts & zero & !ends != 0 {
            return None; // a leading zero
        }
        if WIDE {
            // the block's numbers at once; the one going on into the next block is read below
            let last_start = 1u64 << (63 - starts.leading_zeros().min(63));
            let spanning = starts.count_ones() > ends.count_ones();
            let whole = if spanning { starts & !last_start } else { starts };
            if !numbers_avx512(raw, p, whole, ends, out) {
                return None; // 9 digits or more
            }
            starts = if spanning { last_start } else { 0 };
            ends = 0;
        }
        while ends != 0 {
            let s = starts.trailing_zeros() as usize;
            // (wrapping: an end before its start would be a bug, read as too long a number)
            let len = (ends.trailing_zeros() as usize + 1).wrapping_sub(s);
            starts &= starts - 1;
            ends &= ends - 1;
            if len > 8 {
                return None; // 9 digits or more
            }
            padded[count] = padded8(raw, p + s, len);
            count += 1;
        }
        if starts != 0 {
            // the last number goes on into the next block
            let s = p + starts.trailing_zeros() as usize;
            let (v, len) = digits8(raw, s)?; // None: 8 digits or more
            if WIDE {
                out.extend_from_slice(&(v as u32).to_le_bytes());
            } else {
                padded[count] = padded8(raw, s, len);
                count += 1;
            }
            last_end = Some(s + len);
        } else if digit != 0 {
            last_end = Some(p + 64 - digit.leading_zeros() as usize);
        }
        if count >= STAGED {
            append_values(&padded[..count], out);
            count = 0;
        }
        if other != 0 {
            break; // the array's end, or a byte read_rest judges
        }
        prev_digit = digit >> 63;
        prev_comma = comma >> 63;
        p += 64;
    }
    append_values(&padded[..count], out);
    last_end
}

/// The `len` (1-8) digits at raw[i..] as 8 bytes with the digits at the end ("00012345", the zeros
/// NUL bytes); 8 bytes are readable there.
#[inline(always)]
fn padded8(raw: &[u8], i: usize, len: usize) -> u64 {
    u64::from_le_bytes(raw[i..i + 8].try_into().unwrap()) << (8 * (8 - len))
}

/// Past the JSON string starting at raw[i] (its opening quote), or None if it does not end.
fn skip_string(raw: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < raw.len() {
        match raw[i] {
            b'"' => return Some(i + 1),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
    None
}

/// Past the JSON value at raw[i], loosely: where it ends, not whether it is valid (the decoder that
/// reads the rest of the body checks that).
fn skip_value(raw: &[u8], mut i: usize) -> Option<usize> {
    match *raw.get(i)? {
        b'"' => skip_string(raw, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            while i < raw.len() {
                match raw[i] {
                    b'"' => {
                        i = skip_string(raw, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let start = i;
            while i < raw.len() && !matches!(raw[i], b',' | b'}' | b']') && !ws(raw[i]) {
                i += 1;
            }
            (i > start).then_some(i)
        }
    }
}

/// A JSON object body with a "token_ids" array of uint32s, split in two: (the object without that
/// member, the ids packed as little-endian uint32), or None (no such member, given twice, null, not
/// such an array, a key with an escape, or not an object) for the ordinary decode. The other members are copied as they
/// are; the caller decodes them (so a bad member still gets the ordinary error).
#[pyfunction]
pub fn split_token_ids<'py>(py: Python<'py>, raw: &[u8]) -> Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let (rest, ids) = split_ids(raw)?;
    Some((PyBytes::new(py, &rest), PyBytes::new(py, &ids)))
}

/// `split_token_ids` without Python: (the object without "token_ids", the ids packed).
pub fn split_ids(raw: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    const KEY: &[u8] = b"\"token_ids\"";
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'{') {
        return None;
    }
    let mut rest: Vec<u8> = Vec::with_capacity(256);
    rest.push(b'{');
    let mut ids: Option<Vec<u8>> = None;
    i = skip_ws(raw, i + 1);
    if raw.get(i) != Some(&b'}') {
        loop {
            let key = i;
            if raw.get(i) != Some(&b'"') {
                return None;
            }
            let key_end = skip_string(raw, i)?;
            if raw[key..key_end].contains(&b'\\') {
                return None; // an escaped key may spell token_ids: the decoder reads such bodies whole
            }
            i = skip_ws(raw, key_end);
            if raw.get(i) != Some(&b':') {
                return None;
            }
            if &raw[key..key_end] == KEY {
                if ids.is_some() {
                    return None;
                }
                // 4 bytes a token: no more than its text for ids of 3+ digits (and separators): no regrowth
                let mut out = Vec::with_capacity(raw.len());
                i = read_ids(raw, i + 1, &mut out)?;
                ids = Some(out);
            } else {
                i = skip_value(raw, skip_ws(raw, i + 1))?;
                if rest.len() > 1 {
                    rest.push(b',');
                }
                rest.extend_from_slice(&raw[key..i]);
            }
            i = skip_ws(raw, i);
            match raw.get(i) {
                Some(b',') => i = skip_ws(raw, i + 1),
                Some(b'}') => break,
                _ => return None,
            }
        }
    }
    if skip_ws(raw, i + 1) != raw.len() {
        return None;
    }
    rest.push(b'}');
    Some((rest, ids?))
}
