//! Mooncake conductor's msgpack POST /query on the lookup front (front.rs): the body read, the answer
//! made as index_service/conductor_api.py's `ConductorRegistry.answer` makes it (`Reach`), for a model
//! without shared pools. Anything else - a body of another form (an array of token ids, a duplicate
//! or unknown key, a name with control characters), a model with pools - is the handler's (None).

use std::borrow::Cow;
use std::collections::HashMap;

use crate::front::{prompt_hashes, ModelView};
use crate::table::mix;

const MAX_NAME: usize = 256; // index_service/guard.py
const MAX_BLOCK_SIZE: i64 = 1 << 16;
const MAX_QUERY_TOKENS: usize = 1 << 22; // conductor_api.MAX_QUERY_TOKENS

/// One registered prefix context: instance id -> [(DP rank, its service's endpoint)], ranks sorted.
pub struct ConductorContext {
    pub instances: Vec<(String, Vec<(u32, Option<String>)>)>, // ids sorted by their UTF-8 bytes
}

pub struct Query<'a> {
    pub model: String,
    block_size: usize,
    tokens: Cow<'a, [u8]>, // little-endian int32s
    pub key: String, // tenant \0 model \0 lora \0 block size: the context's
    lora: String,
    salt: Option<String>,
    instance: Option<String>,
}

enum Value<'a> {
    Str(&'a str),
    Int(i64),
    Bin(&'a [u8]),
    Ints(Vec<u8>), // an array of int32s, packed little-endian
    Nil,
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.i..self.i.checked_add(n)?)?;
        self.i += n;
        Some(s)
    }

    fn be(&mut self, n: usize) -> Option<u64> {
        Some(self.take(n)?.iter().fold(0u64, |a, &x| a << 8 | x as u64))
    }

    fn map_len(&mut self) -> Option<usize> {
        let t = *self.take(1)?.first()?;
        match t {
            0x80..=0x8f => Some((t & 0x0f) as usize),
            0xde => Some(self.be(2)? as usize),
            0xdf => Some(self.be(4)? as usize),
            _ => None,
        }
    }

    fn str_len(&mut self, t: u8) -> Option<usize> {
        match t {
            0xa0..=0xbf => Some((t & 0x1f) as usize),
            0xd9 => Some(self.be(1)? as usize),
            0xda => Some(self.be(2)? as usize),
            0xdb => Some(self.be(4)? as usize),
            _ => None,
        }
    }

    fn key(&mut self) -> Option<&'a str> {
        let t = *self.take(1)?.first()?;
        let n = self.str_len(t)?;
        std::str::from_utf8(self.take(n)?).ok()
    }

    /// An int, None for any other value.
    fn int(&mut self) -> Option<i64> {
        let t = *self.take(1)?.first()?;
        Some(match t {
            0x00..=0x7f => t as i64,
            0xe0..=0xff => t as i8 as i64,
            0xcc => self.be(1)? as i64,
            0xcd => self.be(2)? as i64,
            0xce => self.be(4)? as i64,
            0xcf => i64::try_from(self.be(8)?).ok()?,
            0xd0 => self.be(1)? as u8 as i8 as i64,
            0xd1 => self.be(2)? as u16 as i16 as i64,
            0xd2 => self.be(4)? as u32 as i32 as i64,
            0xd3 => self.be(8)? as i64,
            _ => return None,
        })
    }

    /// A value of the kinds a plain query has (an array only of ints); None for any other (maps,
    /// floats, nested arrays, ...).
    fn value(&mut self) -> Option<Value<'a>> {
        let t = *self.b.get(self.i)?;
        if matches!(t, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3) {
            return self.int().map(Value::Int);
        }
        self.i += 1;
        Some(match t {
            0xc0 => Value::Nil,
            0xc4 | 0xc5 | 0xc6 => {
                let n = self.be(1 << (t - 0xc4))? as usize;
                Value::Bin(self.take(n)?)
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = match t {
                    0xdc => self.be(2)? as usize,
                    0xdd => self.be(4)? as usize,
                    _ => (t & 0x0f) as usize,
                };
                if n > MAX_QUERY_TOKENS || n > self.b.len() - self.i {
                    return None; // each element is a byte at least: refused before it costs memory
                }
                let mut packed = Vec::with_capacity(4 * n);
                for _ in 0..n {
                    let v = self.int()?; // never a nested value: no recursion a body could deepen
                    packed.extend_from_slice(&i32::try_from(v).ok()?.to_le_bytes());
                }
                Value::Ints(packed)
            }
            _ => {
                let n = self.str_len(t)?;
                Value::Str(std::str::from_utf8(self.take(n)?).ok()?)
            }
        })
    }
}

/// A name the handler would take as it is: no control character (guard.name_error), at most MAX_NAME.
fn plain_name(s: &str) -> bool {
    s.chars().count() <= MAX_NAME
        && !s.chars().any(|c| c < ' ' || ('\u{7f}'..='\u{9f}').contains(&c) || c == '\u{2028}' || c == '\u{2029}')
}

/// A conductor query body the handler would take without an error, read; None for the handler.
pub fn parse(body: &[u8]) -> Option<Query<'_>> {
    let mut r = Reader { b: body, i: 0 };
    let n = r.map_len()?;
    let (mut model, mut bs, mut tokens) = (None, None, None);
    let (mut tenant, mut lora, mut salt, mut instance) = ("default".to_string(), String::new(), None, None);
    let mut seen: Vec<&str> = Vec::with_capacity(n);
    for _ in 0..n {
        let k = r.key()?;
        if seen.contains(&k) {
            return None; // the handler reads the last one, in the first one's place
        }
        seen.push(k);
        match (k, r.value()?) {
            ("model", Value::Str(v)) if !v.is_empty() && plain_name(v) => model = Some(v.to_string()),
            ("block_size", Value::Int(v)) if (1..=MAX_BLOCK_SIZE).contains(&v) => bs = Some(v as usize),
            ("token_ids", Value::Bin(v)) if v.len() % 4 == 0 && v.len() <= 4 * MAX_QUERY_TOKENS => {
                tokens = Some(Cow::Borrowed(v))
            }
            ("token_ids", Value::Ints(v)) => tokens = Some(Cow::Owned(v)),
            ("tenant_id", Value::Str(v)) => tenant = if v.is_empty() { "default".into() } else { v.to_string() },
            ("lora_name", Value::Str(v)) => lora = v.to_string(),
            ("instance_id", Value::Str(v)) => instance = Some(v.to_string()),
            ("cache_salt", Value::Str(v)) => salt = (!v.is_empty()).then(|| v.to_string()),
            ("cache_salt", Value::Nil) => salt = None,
            _ => return None,
        }
    }
    if r.i != body.len() {
        return None;
    }
    let (model, block_size, tokens) = (model?, bs?, tokens?);
    let key = context_key(&tenant, &model, &lora, block_size as i64);
    Some(Query { model, block_size, tokens, key, lora, salt, instance })
}

pub fn context_key(tenant: &str, model: &str, lora: &str, block_size: i64) -> String {
    format!("{tenant}\0{model}\0{lora}\0{block_size}")
}

/// `ConductorRegistry.answer` without parts: per instance and DP rank, the GPU cursor, then through
/// blocks any replica holds in host memory, then on disk, in tokens of whole registered blocks; None
/// where the model has pools (the handler's). `mv`: None where the model has no blocks.
pub fn answer(q: &Query<'_>, ctx: Option<&ConductorContext>, mv: Option<&ModelView>) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(256);
    let Some(ctx) = ctx else {
        out.extend_from_slice(b"\x81\xa9instances\x80");
        return Some(out);
    };
    if mv.is_some_and(|m| m.pools) {
        return None;
    }
    let bs = q.block_size;
    // (index block size, whole registered blocks, index blocks per registered one)
    let (n, k) = match mv {
        Some(m) if m.block_size > 0 && bs % m.block_size == 0 => (q.tokens.len() / 4 / bs, bs / m.block_size),
        _ => (0, 1),
    };
    let mut gpu: HashMap<(&str, u32), usize> = HashMap::new();
    let mut lower = [Vec::new(), Vec::new()]; // per index block: some replica holds it there
    if let (Some(mv), true) = (mv, n > 0) {
        let hashes = prompt_hashes(&q.tokens[..4 * n * bs], mv.block_size, Some(q.lora.as_str()), q.salt.as_deref());
        let keys: Vec<u64> = hashes.iter().map(|&h| mix(h)).collect();
        let mut depth = vec![0u32; mv.slots.len()];
        if let Some(g) = &mv.gpu {
            crate::front::walk_into(&g.read(), &keys, &mut depth);
        }
        for (slot, st) in mv.slots.iter().enumerate() {
            if let (Some((replica, rank)), d) = (st, depth[slot]) {
                if d > 0 {
                    gpu.insert((replica.as_str(), *rank), d as usize);
                }
            }
        }
        for (level, maps) in lower.iter_mut().zip(&mv.conductor_levels) {
            *level = vec![false; keys.len()];
            for m in maps {
                let m = m.read();
                for (i, &key) in keys.iter().enumerate() {
                    level[i] |= m.contains(key);
                }
            }
        }
    }
    let ids: Vec<&(String, Vec<(u32, Option<String>)>)> = match &q.instance {
        None => ctx.instances.iter().collect(),
        Some(i) => ctx.instances.iter().filter(|(id, _)| id == i).collect(),
    };
    out.extend_from_slice(b"\x81\xa9instances");
    map_header(&mut out, ids.len());
    for (iid, ranks) in ids {
        let per: Vec<(u32, [usize; 3])> = ranks.iter().map(|(r, endpoint)| {
            let mut pos = endpoint.as_deref().and_then(|e| gpu.get(&(e, *r))).copied().unwrap_or(0) / k;
            pos = pos.min(n);
            let mut c = [pos * bs, 0, 0];
            for (t, held) in lower.iter().enumerate() {
                while pos < n && !held.is_empty() && held[pos * k..pos * k + k].iter().all(|&h| h) {
                    pos += 1;
                }
                c[t + 1] = pos * bs;
            }
            (*r, c)
        }).collect();
        let max = |t: usize| per.iter().map(|(_, c)| c[t]).max().unwrap_or(0);
        put_str(&mut out, iid);
        out.push(0x86);
        put_str(&mut out, "longest_matched");
        put_uint(&mut out, max(2));
        put_str(&mut out, "dp");
        map_header(&mut out, per.len());
        for (r, c) in &per {
            put_str(&mut out, &r.to_string());
            put_uint(&mut out, c[0]);
        }
        put_str(&mut out, "rank_matches");
        map_header(&mut out, per.len());
        for (r, c) in &per {
            put_str(&mut out, &r.to_string());
            out.push(0x83);
            for (name, v) in ["gpu", "cpu", "disk"].iter().zip(c) {
                put_str(&mut out, name);
                put_uint(&mut out, *v);
            }
        }
        for (t, name) in ["gpu", "cpu", "disk"].iter().enumerate() {
            put_str(&mut out, name);
            put_uint(&mut out, max(t));
        }
    }
    Some(out)
}

fn map_header(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=15 => out.push(0x80 | n as u8),
        16..=0xffff => {
            out.push(0xde);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdf);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    match n {
        0..=31 => out.push(0xa0 | n as u8),
        32..=0xff => out.extend_from_slice(&[0xd9, n as u8]),
        0x100..=0xffff => {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
}

fn put_uint(out: &mut Vec<u8>, v: usize) {
    let v = v as u64;
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}
