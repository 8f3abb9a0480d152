//! Closed-loop HTTP/1.1 load (bench/bench_cores.py): `connections` threads, each on one keep-alive
//! connection, send POST requests with the bodies of a file (one JSON body a line) in turn, `depth`
//! at a time (1: each waits for its answer), for `seconds`; prints one JSON line:
//! {"lookups": N, "seconds": S, "errors": E}. No dependencies: std's blocking sockets.
//!
//!     kvidx-loadgen HOST:PORT PATH BODIES_FILE CONNECTIONS SECONDS [DEPTH]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!("POST {path} HTTP/1.1\r\nhost: kvidx\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n", body.len()).into_bytes();
    r.extend_from_slice(body);
    r
}

/// Reads one response from `buf`/`s`: Some(status) once whole, None if the connection ended.
fn response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<u16> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).ok()?;
            let status: u16 = head.get(9..12)?.parse().ok()?;
            let len: usize = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length").then(|| v.trim().parse().ok())?
            })?;
            if buf.len() >= end + 4 + len {
                buf.drain(..end + 4 + len);
                return Some(status);
            }
        }
        let mut chunk = [0u8; 65536];
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        eprintln!("usage: kvidx-loadgen HOST:PORT PATH BODIES_FILE CONNECTIONS SECONDS [DEPTH]");
        std::process::exit(2);
    }
    let (addr, path) = (a[1].clone(), a[2].clone());
    let text = std::fs::read(&a[3]).expect("bodies file");
    let reqs: Arc<Vec<Vec<u8>>> = Arc::new(text.split(|&b| b == b'\n').filter(|l| !l.is_empty())
        .map(|b| request(&path, b)).collect());
    let conns: usize = a[4].parse().expect("connections");
    let seconds: f64 = a[5].parse().expect("seconds");
    let depth: usize = a.get(6).map(|d| d.parse().expect("depth")).unwrap_or(1).max(1);
    let (done, errors, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..conns).map(|k| {
        let (reqs, done, errors, stop, addr) = (reqs.clone(), done.clone(), errors.clone(), stop.clone(), addr.clone());
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(&addr).expect("connect");
            s.set_nodelay(true).ok();
            let mut buf = Vec::with_capacity(65536);
            let mut i = k;
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                out.clear();
                for _ in 0..depth {
                    out.extend_from_slice(&reqs[i % reqs.len()]);
                    i += conns;
                }
                if s.write_all(&out).is_err() {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                for _ in 0..depth {
                    match response(&mut s, &mut buf) {
                        Some(200) => done.fetch_add(1, Ordering::Relaxed),
                        Some(_) => errors.fetch_add(1, Ordering::Relaxed),
                        None => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                }
            }
        })
    }).collect();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let n = done.load(Ordering::Relaxed);
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    println!("{{\"lookups\": {n}, \"seconds\": {wall:.3}, \"errors\": {}}}", errors.load(Ordering::Relaxed));
}
