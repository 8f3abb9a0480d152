//! The lookup front (`kvidx serve --lookup-port`): Dynamo's POST /query and /query_by_hash, and Mooncake
//! conductor's msgpack POST /query (conductor.rs), answered by Rust threads that read the index's mask maps without the GIL, one thread per connection, so a
//! deployment unit answers from all its cores (index_service/lookup_front.py wires it; docs/scaling.md).
//!
//! The index is the service's own: the maps are shared with the fold (lib.rs `Shared`: a readers-writer
//! lock per map), and Python pushes what else a query reads when it changes: per model its block size,
//! its lookup group's tier maps and its slots' (replica, DP rank); per (model, routing group) Dynamo's
//! block size and replica -> instance id; the conductor's prefix contexts; the tokens of scope `read`. A request this front does not
//! answer itself - an error, a body of another form, a model or group it has not been told of, a
//! token it does not know, any other path - goes to `fallback`, the service's own Python handler (with
//! the GIL), so every answer and error is the ordinary one. The fast answer is held byte for byte to
//! the Python one (tests/unit/index_service/test_lookup_front.py).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use parking_lot::RwLock;
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use serde::Deserialize;
use twox_hash::XxHash3_64;

use crate::conductor::{self, ConductorContext};
use crate::masks::Masks;
use crate::table::mix;
use crate::tokens::split_ids;
use crate::{chain_blocks, MaskMap, Shared};

// kvidx/core/hashing.py
const ROOT_SEED: u64 = 0x6B76_6964_7831;
const DYNAMO_ROOT: u64 = 0x6479_6E61_6D6F;
const DYNAMO_CHAIN_SEED: u64 = 0x6B76_6964_7844;

const MAX_HEAD: usize = 16 << 10; // request line and headers
const IDLE: Duration = Duration::from_secs(5); // keep-alive timeout (uvicorn's default)
const STACK: usize = 256 << 10;
const EMPTY: &[u8] = br#"{"frequencies":[],"instances":{},"scores":{}}"#;
const JSON: &str = "application/json";
const MSGPACK: &str = "application/msgpack";

pub struct ModelView {
    pub block_size: usize,
    pub gpu: Option<Shared>,
    levels: Vec<Vec<Shared>>, // Dynamo's: each lower level continues where the faster ones stopped
    pub conductor_levels: Vec<Vec<Shared>>, // the conductor's: host memory, then disk
    pub pools: bool,                        // the model has shared pools (the conductor's are Python's)
    pub slots: Vec<Option<(String, u32)>>,  // slot -> (replica, DP rank)
}

struct GroupView {
    block_size: i64,
    names: HashMap<String, u64>, // replica -> Dynamo instance id
}

struct State {
    models: RwLock<HashMap<String, Arc<ModelView>>>,
    groups: RwLock<HashMap<String, Arc<GroupView>>>, // "model\0routing_group"
    contexts: RwLock<HashMap<String, Arc<ConductorContext>>>, // conductor.rs context_key
    tokens: RwLock<Option<Vec<Vec<u8>>>>,            // accepted Authorization values; None: open
    fallback: Py<PyAny>,
    max_body: usize,
    max_connections: usize,
    open: AtomicUsize,
    stop: AtomicBool,
    fast: [AtomicU64; 3], // answered here: /query, /query_by_hash, the conductor's /query
    fallen: AtomicU64,    // answered by the Python handler
    refused: AtomicU64,   // connections over max_connections
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryRest {
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default = "default_name")]
    #[allow(dead_code)]
    tenant_id: String,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ByHash {
    block_hashes: Vec<i64>,
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default = "default_name")]
    #[allow(dead_code)]
    tenant_id: String,
    #[serde(default)]
    cache_salt: Option<String>,
}

fn default_name() -> String {
    "default".to_string()
}

fn xxh(bytes: &[u8], seed: u64) -> u64 {
    XxHash3_64::oneshot_with_seed(seed, bytes)
}

/// msgspec.msgpack.encode([salt]): a block's extra keys, mixed into its seed (hashing.extra_seed).
fn salt_seed(parent: u64, salt: &str) -> u64 {
    let b = salt.as_bytes();
    let mut m = vec![0x91u8];
    match b.len() {
        n if n < 32 => m.push(0xa0 | n as u8),
        n if n < 256 => m.extend_from_slice(&[0xd9, n as u8]),
        n if n < 65536 => {
            m.push(0xda);
            m.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            m.push(0xdb);
            m.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    m.extend_from_slice(b);
    xxh(&m, parent)
}

/// hashing.prompt_hashes of packed tokens (no multimodal items, no lookahead).
pub fn prompt_hashes(packed: &[u8], block_size: usize, lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
    let root = match lora {
        Some(l) if !l.is_empty() => xxh(&[b"lora\0", l.as_bytes()].concat(), ROOT_SEED),
        _ => ROOT_SEED,
    };
    let step = 4 * block_size;
    match salt.filter(|s| !s.is_empty()) {
        Some(s) if packed.len() >= step => {  // the salt is an extra key of the first block only
            let first = xxh(&packed[..step], salt_seed(root, s));
            let mut out = vec![first];
            out.extend(chain_blocks(&packed[step..], step, first));
            out
        }
        _ => chain_blocks(packed, step, root),
    }
}

/// hashing.dynamo_keys: Dynamo's local hashes chained into the keys its relays publish.
fn dynamo_keys(local: &[i64]) -> Vec<u64> {
    let mut h = DYNAMO_ROOT;
    local.iter().map(|&x| {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&h.to_le_bytes());
        b[8..].copy_from_slice(&(x as u64).to_le_bytes());
        h = xxh(&b, DYNAMO_CHAIN_SEED);
        h
    }).collect()
}

/// depth[slot] = how many leading keys the slot holds (MaskMap.walk).
pub fn walk_into(m: &Masks, keys: &[u64], depth: &mut [u32]) {
    let n = keys.len();
    let mut put = |slot: usize, d: usize| {
        if let Some(x) = depth.get_mut(slot) {
            *x = d as u32;
        }
    };
    if let Some(t) = m.narrow() {
        let mut alive = t.get(keys[0]).unwrap_or(0);
        for (i, &k) in keys.iter().enumerate().skip(1) {
            if alive == 0 {
                break;
            }
            let x = t.get(k).unwrap_or(0) & alive;
            let mut lost = alive & !x;
            while lost != 0 {
                put(lost.trailing_zeros() as usize, i);
                lost &= lost - 1;
            }
            alive = x;
        }
        while alive != 0 {
            put(alive.trailing_zeros() as usize, n);
            alive &= alive - 1;
        }
        return;
    }
    let Some(mut alive) = m.words(keys[0]) else { return };
    let mut before = alive.clone();
    for (i, &k) in keys.iter().enumerate().skip(1) {
        before.copy_from_slice(&alive);
        let any = m.and_into(k, &mut alive);
        for (w, (b, a)) in before.iter().zip(alive.iter()).enumerate() {
            let mut lost = b & !a;
            while lost != 0 {
                put(64 * w + lost.trailing_zeros() as usize, i);
                lost &= lost - 1;
            }
        }
        if !any {
            return;
        }
    }
    for (w, a) in alive.iter().enumerate() {
        let mut a = *a;
        while a != 0 {
            put(64 * w + a.trailing_zeros() as usize, n);
            a &= a - 1;
        }
    }
}

/// ORs each key's mask into its row of `flat` (`words` words a row).
fn or_rows(m: &Masks, keys: &[u64], words: usize, flat: &mut [u64]) {
    if let Some(t) = m.narrow() {
        for (i, &k) in keys.iter().enumerate() {
            flat[i * words] |= t.get(k).unwrap_or(0);
        }
        return;
    }
    for (i, &k) in keys.iter().enumerate() {
        if let Some(ws) = m.words(k) {
            for (w, x) in ws.iter().take(words).enumerate() {
                flat[i * words + w] |= x;
            }
        }
    }
}

/// dynamo_api.score_response over a model's view: Dynamo's ScoreResponse as JSON text, the instances
/// and their DP ranks in slot order as the Python answer makes them.
fn score(mv: &ModelView, g: &GroupView, hashes: &[u64], tokens_per_key: i64) -> Vec<u8> {
    let n = hashes.len();
    if n == 0 {
        return EMPTY.to_vec();
    }
    let keys: Vec<u64> = hashes.iter().map(|&h| mix(h)).collect();
    let nslots = mv.slots.len();
    let words = nslots.div_ceil(64).max(1);
    let mut depth = vec![0u32; nslots];
    if let Some(gpu) = &mv.gpu {
        walk_into(&gpu.read(), &keys, &mut depth);
    }
    let levels: Vec<Option<Vec<u64>>> = mv.levels.iter().map(|maps| {
        if maps.is_empty() {
            return None;
        }
        let mut flat = vec![0u64; n * words];
        for m in maps {
            or_rows(&m.read(), &keys, words, &mut flat);
        }
        Some(flat)
    }).collect();
    let bs = g.block_size;
    // (iid, cpu, disk, dp ranks, gpu), in first-seen order; scores likewise
    let mut insts: Vec<(u64, i64, i64, Vec<(u32, i64)>, i64)> = Vec::new();
    let mut at: HashMap<u64, usize> = HashMap::new();
    let mut scores: Vec<(u64, Vec<(u32, i64)>)> = Vec::new();
    let mut score_at: HashMap<u64, usize> = HashMap::new();
    let mut reach = Vec::with_capacity(1 + levels.len());
    for (slot, st) in mv.slots.iter().enumerate() {
        let Some((replica, rank)) = st else { continue };
        let mut pos = depth[slot] as usize;
        reach.clear();
        reach.push(pos);
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        for level in &levels {
            if let Some(flat) = level {
                while pos < n && flat[pos * words + w] & bit != 0 {
                    pos += 1;
                }
            }
            reach.push(pos);
        }
        if pos == 0 {
            continue;
        }
        let Some(&iid) = g.names.get(replica) else { continue };
        let tok = |b: usize| b as i64 * tokens_per_key / bs * bs;
        let (g_tok, c_tok, d_tok) = (tok(reach[0]), tok(reach[1]), tok(reach[2]));
        if d_tok == 0 {
            continue;
        }
        if g_tok != 0 {
            let i = *score_at.entry(iid).or_insert_with(|| {
                scores.push((iid, Vec::new()));
                scores.len() - 1
            });
            set_rank(&mut scores[i].1, *rank, g_tok);
        }
        let i = *at.entry(iid).or_insert_with(|| {
            insts.push((iid, 0, 0, Vec::new(), 0));
            insts.len() - 1
        });
        let e = &mut insts[i];
        set_rank(&mut e.3, *rank, g_tok);
        e.4 = e.4.max(g_tok);
        e.1 = e.1.max(c_tok);
        e.2 = e.2.max(d_tok);
    }
    let mut out = Vec::with_capacity(64 + 96 * insts.len());
    out.extend_from_slice(br#"{"frequencies":[],"instances":{"#);
    for (j, (iid, cpu, disk, dp, gpu)) in insts.iter().enumerate() {
        if j > 0 {
            out.push(b',');
        }
        push_key(&mut out, *iid);
        out.extend_from_slice(br#"{"cpu":"#);
        push_int(&mut out, *cpu);
        out.extend_from_slice(br#","disk":"#);
        push_int(&mut out, *disk);
        out.extend_from_slice(br#","dp":"#);
        push_ranks(&mut out, dp);
        out.extend_from_slice(br#","gpu":"#);
        push_int(&mut out, *gpu);
        out.extend_from_slice(br#","longest_matched":"#);
        push_int(&mut out, *disk);
        out.push(b'}');
    }
    out.extend_from_slice(br#"},"scores":{"#);
    for (j, (iid, ranks)) in scores.iter().enumerate() {
        if j > 0 {
            out.push(b',');
        }
        push_key(&mut out, *iid);
        push_ranks(&mut out, ranks);
    }
    out.extend_from_slice(b"}}");
    out
}

fn set_rank(ranks: &mut Vec<(u32, i64)>, rank: u32, v: i64) {
    match ranks.iter_mut().find(|(r, _)| *r == rank) {
        Some(e) => e.1 = v, // a dict keeps the key where it first went
        None => ranks.push((rank, v)),
    }
}

fn push_int(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

fn push_key(out: &mut Vec<u8>, k: u64) {
    out.push(b'"');
    out.extend_from_slice(itoa::Buffer::new().format(k).as_bytes());
    out.extend_from_slice(b"\":");
}

fn push_ranks(out: &mut Vec<u8>, ranks: &[(u32, i64)]) {
    out.push(b'{');
    for (j, (r, v)) in ranks.iter().enumerate() {
        if j > 0 {
            out.push(b',');
        }
        push_key(out, *r as u64);
        push_int(out, *v);
    }
    out.push(b'}');
}

/// Constant-time equality (the tokens are secrets: hmac.compare_digest's rule).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

struct Head {
    method: String,
    target: String, // path and query
    close: bool,
    content_length: usize,
    chunked: bool,
    expect_continue: bool,
    content_type: Option<Vec<u8>>,
    authorization: Option<Vec<u8>>,
    headers: Vec<(Vec<u8>, Vec<u8>)>, // lower-case names, for the fallback
}

impl State {
    /// The answer made here (its body, its content type, its route's counter), or None for the
    /// fallback.
    fn fast(&self, head: &Head, body: &[u8]) -> Option<(Vec<u8>, &'static str, usize)> {
        if head.method != "POST" {
            return None;
        }
        let by_hash = match head.target.as_str() {
            "/query" => false,
            "/query_by_hash" => true,
            _ => return None,
        };
        if let Some(tokens) = &*self.tokens.read() {
            let a = head.authorization.as_deref()?;
            if !tokens.iter().fold(false, |ok, t| same(t, a) | ok) {
                return None; // 401/403 with the reason, and the token file re-read: the handler's
            }
        }
        let ct = head.content_type.as_deref()?;
        if !by_hash && is_msgpack(ct) {  // Mooncake conductor's /query (conductor_api.is_msgpack)
            let q = conductor::parse(body)?;
            let ctx = self.contexts.read().get(&q.key).cloned();
            let mv = self.models.read().get(&q.model).cloned();
            return Some((conductor::answer(&q, ctx.as_deref(), mv.as_deref())?, MSGPACK, 2));
        }
        let base = ct.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
        if !base.eq_ignore_ascii_case(b"application/json") {
            return None;
        }
        self.dynamo(by_hash, body).map(|a| (a, JSON, by_hash as usize))
    }

    /// Dynamo's /query or /query_by_hash, a JSON body.
    fn dynamo(&self, by_hash: bool, body: &[u8]) -> Option<Vec<u8>> {
        // (model, its group, the keys to walk, tokens a key covers), or the model's empty answer
        let (model, group, hashes, per_key): (String, Arc<GroupView>, Vec<u64>, Option<i64>) = if by_hash {
            let q: ByHash = serde_json::from_slice(body).ok()?;
            if q.cache_salt.is_some() {
                return None; // a 400 (Dynamo: the salt is in the hashes)
            }
            let g = self.group(&q.model_name, &q.routing_group)?;
            let bs = g.block_size;
            (q.model_name, g, dynamo_keys(&q.block_hashes), Some(bs))
        } else {
            let (rest, ids) = split_ids(body)?;
            let q: QueryRest = serde_json::from_slice(&rest).ok()?;
            let g = self.group(&q.model_name, &q.routing_group)?;
            let Some(mv) = self.models.read().get(&q.model_name).cloned() else {
                return Some(EMPTY.to_vec());
            };
            if g.block_size <= 0 || mv.block_size == 0 {
                return Some(EMPTY.to_vec());
            }
            let bs = g.block_size as usize; // Dynamo drops the trailing partial block of its own size
            let n = ids.len() / 4 / bs * bs;
            let keys = prompt_hashes(&ids[..4 * n], mv.block_size, q.lora_name.as_deref(), q.cache_salt.as_deref());
            (q.model_name, g, keys, None)
        };
        let mv = self.models.read().get(&model).cloned();
        let Some(mv) = mv.filter(|_| !group.names.is_empty() && group.block_size > 0) else {
            return Some(EMPTY.to_vec());
        };
        let per_key = per_key.unwrap_or(mv.block_size as i64);
        Some(score(&mv, &group, &hashes, per_key))
    }

    fn group(&self, model: &str, routing_group: &str) -> Option<Arc<GroupView>> {
        let key = format!("{model}\0{routing_group}");
        self.groups.read().get(&key).cloned()
    }

    /// The service's own handler's answer: (status, headers, body).
    fn fallback(&self, head: &Head, body: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
        self.fallen.fetch_add(1, Ordering::Relaxed);
        Python::attach(|py| {
            let headers: Vec<(Bound<'_, PyBytes>, Bound<'_, PyBytes>)> = head.headers.iter()
                .map(|(k, v)| (PyBytes::new(py, k), PyBytes::new(py, v))).collect();
            let r = self.fallback.call1(py, (head.method.as_str(), head.target.as_str(), headers,
                                             PyBytes::new(py, body)))
                .and_then(|r| r.extract::<(u16, Vec<(String, String)>, Vec<u8>)>(py));
            r.unwrap_or_else(|e| {
                e.print(py);
                (500, vec![("content-type".into(), "text/plain; charset=utf-8".into())],
                 b"Internal Server Error".to_vec())
            })
        })
    }
}

fn is_msgpack(content_type: &[u8]) -> bool {
    content_type.windows(MSGPACK.len()).any(|w| w == MSGPACK.as_bytes())
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

fn respond(out: &mut Vec<u8>, status: u16, headers: &[(String, String)], body: &[u8], close: bool) {
    out.clear();
    out.extend_from_slice(format!("HTTP/1.1 {status} {}\r\n", reason(status)).as_bytes());
    for (k, v) in headers {
        if k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("connection") {
            continue;
        }
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(if close { b"\r\nconnection: close\r\n\r\n" } else { b"\r\n\r\n" });
    out.extend_from_slice(body);
}

fn text(status: u16, msg: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
    (status, vec![("content-type".into(), "text/plain; charset=utf-8".into())], msg.as_bytes().to_vec())
}

/// The request head at the start of `buf`: Ok(Some((head, its length))), Ok(None) if incomplete,
/// Err(status, message) if it cannot be read.
fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, (u16, &'static str)> {
    let mut hs = [httparse::EMPTY_HEADER; 64];
    let mut r = httparse::Request::new(&mut hs);
    let n = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err((431, "too many headers")),
        Err(_) => return Err((400, "Invalid HTTP request received.")),
    };
    let mut head = Head {
        method: r.method.unwrap_or_default().to_string(),
        target: r.path.unwrap_or_default().to_string(),
        close: r.version == Some(0),
        content_length: 0,
        chunked: false,
        expect_continue: false,
        content_type: None,
        authorization: None,
        headers: Vec::with_capacity(r.headers.len()),
    };
    let mut lengths = 0;
    for h in r.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        let v = h.value;
        match name.as_str() {
            "content-length" => {
                lengths += 1;
                let s = std::str::from_utf8(v).ok().map(str::trim);
                head.content_length = match s.filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|s| s.parse().ok()) {
                    Some(n) => n,
                    None => return Err((400, "Invalid HTTP request received.")),
                };
            }
            "transfer-encoding" => head.chunked = true,
            "expect" => head.expect_continue = v.eq_ignore_ascii_case(b"100-continue"),
            "content-type" => head.content_type = Some(v.to_vec()),
            "authorization" => head.authorization = Some(v.to_vec()),
            "connection" => {
                let v = v.to_ascii_lowercase();
                if v.windows(5).any(|w| w == b"close") {
                    head.close = true;
                } else if v.windows(10).any(|w| w == b"keep-alive") {
                    head.close = false;
                }
            }
            _ => {}
        }
        head.headers.push((name.into_bytes(), v.to_vec()));
    }
    if lengths > 1 {
        return Err((400, "Invalid HTTP request received."));
    }
    Ok(Some((head, n)))
}

fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let at = buf.len();
    buf.resize(at + 16384, 0);
    loop {
        match s.read(&mut buf[at..]) {
            Ok(0) => {
                buf.truncate(at);
                return false;
            }
            Ok(k) => {
                buf.truncate(at + k);
                return true;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                buf.truncate(at);
                return false;
            }
        }
    }
}

fn connection(st: &State, mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(IDLE));
    let _ = s.set_write_timeout(Some(IDLE));
    let mut buf: Vec<u8> = Vec::with_capacity(16384);
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    while !st.stop.load(Ordering::Relaxed) {
        let parsed = loop {
            match parse_head(&buf) {
                Ok(Some(x)) => break Ok(x),
                Ok(None) if buf.len() > MAX_HEAD => break Err((431, "request head too large")),
                Ok(None) => {
                    if !read_more(&mut s, &mut buf) {
                        return;
                    }
                }
                Err(e) => break Err(e),
            }
        };
        let (head, n) = match parsed {
            Ok(x) => x,
            Err((status, msg)) => {
                let (st_, hs, body) = text(status, msg);
                respond(&mut out, st_, &hs, &body, true);
                let _ = s.write_all(&out);
                return;
            }
        };
        let refuse = if head.chunked {
            Some(text(411, "the lookup port reads bodies with a Content-Length (no chunked bodies)"))
        } else if head.content_length > st.max_body && head.content_type.as_deref().is_some_and(is_msgpack) {
            Some((413, vec![("content-type".into(), MSGPACK.into())],
                  b"\x81\xa5error\xb6request body too large".to_vec()))  // the conductor's
        } else if head.content_length > st.max_body {
            Some(text(413, "Failed to buffer the request body: length limit exceeded"))
        } else {
            None
        };
        if let Some((status, hs, body)) = refuse {
            respond(&mut out, status, &hs, &body, true);
            let _ = s.write_all(&out);
            let _ = s.shutdown(Shutdown::Write);
            return;
        }
        if head.expect_continue && buf.len() < n + head.content_length
            && s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err() {
            return;
        }
        while buf.len() < n + head.content_length {
            if !read_more(&mut s, &mut buf) {
                return;
            }
        }
        let body = &buf[n..n + head.content_length];
        match st.fast(&head, body) {
            Some((answer, ctype, route)) => {
                st.fast[route].fetch_add(1, Ordering::Relaxed);
                let hs = [("content-type".to_string(), ctype.to_string())];
                respond(&mut out, 200, &hs, &answer, head.close);
            }
            None => {
                if st.stop.load(Ordering::Relaxed) {
                    return; // the interpreter may be going: no Python from here
                }
                let (status, hs, body) = st.fallback(&head, body);
                respond(&mut out, status, &hs, &body, head.close);
            }
        }
        buf.drain(..n + head.content_length);
        if s.write_all(&out).is_err() || head.close {
            return;
        }
        if buf.capacity() > 1 << 20 && buf.len() < 1 << 16 {
            buf.shrink_to(1 << 16); // a large body's room is not kept by an idle connection
        }
    }
}

/// The lookup front: LookupFront(host, port, fallback, max_body, max_connections) listens at once
/// (OSError if it cannot) and serves until `close()`.
#[pyclass(name = "LookupFront", module = "kvidx_native", frozen)]
pub struct LookupFront {
    st: Arc<State>,
    addr: SocketAddr,
}

#[pymethods]
impl LookupFront {
    #[new]
    #[pyo3(signature = (host, port, fallback, max_body, max_connections=1024))]
    fn new(py: Python<'_>, host: &str, port: u16, fallback: Py<PyAny>, max_body: usize, max_connections: usize
    ) -> PyResult<Self> {
        let listener = py.detach(|| TcpListener::bind((host, port)))
            .map_err(|e| PyOSError::new_err(format!("{host}:{port}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| PyOSError::new_err(e.to_string()))?;
        let st = Arc::new(State {
            models: RwLock::new(HashMap::new()),
            groups: RwLock::new(HashMap::new()),
            contexts: RwLock::new(HashMap::new()),
            tokens: RwLock::new(None),
            fallback,
            max_body,
            max_connections,
            open: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            fast: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            fallen: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let acc = st.clone();
        thread::Builder::new().name("kvidx-lookup-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if acc.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(mut s) = conn else { continue };
                if acc.open.load(Ordering::Relaxed) >= acc.max_connections {
                    acc.refused.fetch_add(1, Ordering::Relaxed);
                    let mut out = Vec::new();
                    let (status, hs, body) = text(503, "too many connections to the lookup port");
                    respond(&mut out, status, &hs, &body, true);
                    let _ = s.write_all(&out);
                    continue;
                }
                acc.open.fetch_add(1, Ordering::Relaxed);
                let c = acc.clone();
                let spawned = thread::Builder::new().name("kvidx-lookup".into()).stack_size(STACK)
                    .spawn(move || {
                        connection(&c, s);
                        c.open.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    acc.open.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }).map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(LookupFront { st, addr })
    }

    /// The port it listens on (the one it was given, or the one the system chose for 0).
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// A model's view: its index block size, its lookup group's GPU map (None: none yet), the maps of
    /// each lower level for Dynamo's answer and for the conductor's, its slots' (replica, DP rank)
    /// (None for a free slot), and whether it has shared pools.
    #[allow(clippy::too_many_arguments)]
    fn set_model(&self, model: String, block_size: usize, gpu: Option<Bound<'_, MaskMap>>,
                 levels: Vec<Vec<Bound<'_, MaskMap>>>, conductor_levels: Vec<Vec<Bound<'_, MaskMap>>>,
                 slots: Vec<Option<(String, u32)>>, pools: bool) {
        let shared = |ls: &Vec<Vec<Bound<'_, MaskMap>>>| -> Vec<Vec<Shared>> {
            ls.iter().map(|l| l.iter().map(|m| m.borrow().m.clone()).collect()).collect()
        };
        let view = ModelView {
            block_size,
            gpu: gpu.map(|m| m.borrow().m.clone()),
            levels: shared(&levels),
            conductor_levels: shared(&conductor_levels),
            pools,
            slots,
        };
        self.st.models.write().insert(model, Arc::new(view));
    }

    /// Forgets a model (it has no lookup group: queries of it answer empty).
    fn drop_model(&self, model: &str) {
        self.st.models.write().remove(model);
    }

    /// Dynamo's registrations, all of them: (model, routing group, block size, {replica: instance id}).
    fn set_groups(&self, groups: Vec<(String, String, i64, HashMap<String, u64>)>) {
        let table = groups.into_iter().map(|(m, g, bs, names)| {
            (format!("{m}\0{g}"), Arc::new(GroupView { block_size: bs, names }))
        }).collect();
        *self.st.groups.write() = table;
    }

    /// The conductor's prefix contexts, all of them: (tenant, model, LoRA, block size, [(instance id,
    /// [(DP rank, its service's endpoint or None)])]), instance ids in the order answers list them.
    #[allow(clippy::type_complexity)]
    fn set_contexts(&self, contexts: Vec<(String, String, String, i64, Vec<(String, Vec<(u32, Option<String>)>)>)>) {
        let table = contexts.into_iter().map(|(t, m, l, bs, instances)| {
            (conductor::context_key(&t, &m, &l, bs), Arc::new(ConductorContext { instances }))
        }).collect();
        *self.st.contexts.write() = table;
    }

    /// The Authorization values answered here (b"Bearer <token>" of each token of scope read); None:
    /// no credentials (every request is answered).
    fn set_tokens(&self, tokens: Option<Vec<Vec<u8>>>) {
        *self.st.tokens.write() = tokens;
    }

    /// Counters: answered here per route, by the fallback, connections open and refused.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("fast_query", self.st.fast[0].load(Ordering::Relaxed))?;
        d.set_item("fast_query_by_hash", self.st.fast[1].load(Ordering::Relaxed))?;
        d.set_item("fast_conductor_query", self.st.fast[2].load(Ordering::Relaxed))?;
        d.set_item("fallback", self.st.fallen.load(Ordering::Relaxed))?;
        d.set_item("connections", self.st.open.load(Ordering::Relaxed))?;
        d.set_item("refused_connections", self.st.refused.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// The fast answer to a request, None where the fallback would answer (tests).
    #[pyo3(signature = (path, body, authorization, content_type="application/json"))]
    fn answer<'py>(&self, py: Python<'py>, path: &str, body: &[u8], authorization: Option<Vec<u8>>,
                   content_type: &str) -> Option<Bound<'py, PyBytes>> {
        let head = Head {
            method: "POST".into(),
            target: path.into(),
            close: false,
            content_length: body.len(),
            chunked: false,
            expect_continue: false,
            content_type: Some(content_type.as_bytes().to_vec()),
            authorization,
            headers: Vec::new(),
        };
        let st = self.st.clone();
        let body = body.to_vec();
        let out = py.detach(move || st.fast(&head, &body));
        out.map(|a| PyBytes::new(py, &a.0))
    }

    /// Stops taking connections; open ones end after their request or idle timeout.
    fn close(&self) {
        if !self.st.stop.swap(true, Ordering::SeqCst) {
            let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)); // wakes accept
        }
    }
}
