//! Checks kvidx's fetch hints against Dynamo's own types (dynamo-kv-router 1.6.1, kv_hints.rs).
//!
//! stdin: one JSON KvHint per line, as kvidx's POST /v1/routes answers carry it (`kv_hint`).
//! stdout: one JSON line per input: `parsed` (Dynamo's `KvHint` deserializes it), `roundtrip` (its serde
//! JSON is the input's value), `same_as_dynamo` (the hint Dynamo's constructors make from the same
//! fields, `KvHint::new(message_id, vec![KvHintAction::fetch(action_id, KvSourceLocationsPayload)])`, is
//! the input's value), `same_bytes` (and its JSON text is the input line's, byte for byte),
//! `payload_typed` (the payload reads as `KvSourceLocationsPayload`), and `dynamo`: the JSON text
//! Dynamo makes.

use std::io::{BufRead, Write};

use dynamo_kv_router::kv_hints::{KvHint, KvHintAction, KvSourceLocationsPayload};

fn check(line: &str) -> serde_json::Value {
    let input: serde_json::Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return serde_json::json!({"parsed": false, "error": e.to_string()}),
    };
    let hint: KvHint = match serde_json::from_value(input.clone()) {
        Ok(h) => h,
        Err(e) => return serde_json::json!({"parsed": false, "error": e.to_string()}),
    };
    let roundtrip = serde_json::to_value(&hint).ok() == Some(input.clone());
    let mut typed = true;
    let mut actions = Vec::new();
    for a in &hint.actions {
        let payload = serde_json::to_value(&a.payload)
            .ok()
            .and_then(|v| serde_json::from_value::<KvSourceLocationsPayload>(v).ok());
        match payload {
            Some(p) if a.action_type == "kv.fetch" && a.action_version == "1.0" => {
                actions.push(KvHintAction::fetch(a.action_id.clone(), p))
            }
            _ => {
                typed = false;
                actions.push(a.clone())
            }
        }
    }
    let made = KvHint::new(hint.message_id.clone(), actions);
    let dynamo = serde_json::to_value(&made).unwrap_or(serde_json::Value::Null);
    serde_json::json!({
        "parsed": true,
        "roundtrip": roundtrip,
        "payload_typed": typed,
        "same_as_dynamo": dynamo == input,
        "same_bytes": serde_json::to_string(&made).ok().as_deref() == Some(line.trim()),
        "dynamo": serde_json::to_string(&made).unwrap_or_default(),
    })
}

fn main() -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        writeln!(out, "{}", check(&line))?;
    }
    Ok(())
}
