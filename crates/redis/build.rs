//! Assembles the Lua scripts: the common state, one file per stateful control, the ledger and
//! the script's own part, with every `@layout.field` of the argument contract replaced by its
//! offset and every `@layout#` by its length (`src/contract.rs`, the table the encoder writes
//! by). A name the table lacks fails the build.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

include!("src/contract.rs");

/// The files every ledger script is made of, in order, before its own.
const LEDGER: &[&str] = &[
    "common_v7.lua",
    "controls/rate.lua",
    "controls/concurrency.lua",
    "controls/budget.lua",
    "ledger_v7.lua",
];

/// Each script that is written out: its name and its own files, after the ledger's.
const SCRIPTS: &[(&str, &[&str])] = &[
    // The ledger alone, for benchmarks that call its functions.
    ("ledger.lua", &[]),
    ("batch.lua", &["slices_v1.lua", "batch_v5.lua"]),
    ("renew.lua", &["renew_v4.lua"]),
    ("usage.lua", &["usage_v2.lua"]),
    ("sweep.lua", &["sweep_v2.lua"]),
];

fn main() {
    let dir = Path::new("src/lua");
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    println!("cargo::rerun-if-changed=src/lua");
    println!("cargo::rerun-if-changed=src/contract.rs");
    for (name, own) in SCRIPTS {
        let mut text = String::new();
        for file in LEDGER.iter().chain(own.iter()) {
            let path = dir.join(file);
            let src = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            text.push_str(&substitute(&src, file));
            text.push('\n');
        }
        std::fs::write(Path::new(&out).join(name), text).expect("write the script");
    }
}

/// `src` with its contract names replaced by numbers.
fn substitute(src: &str, file: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let word_end = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '#'))
            .unwrap_or(after.len());
        let word = &after[..word_end];
        if word.is_empty() {
            // A literal `@` (a budget cell's field is `label@period`).
            out.push('@');
            rest = after;
            continue;
        }
        out.push_str(
            &resolve(word)
                .unwrap_or_else(|| panic!("{file}: `@{word}` names no field of src/contract.rs")),
        );
        rest = &after[word_end..];
    }
    out.push_str(rest);
    out
}

fn resolve(word: &str) -> Option<String> {
    if let Some(layout) = word.strip_suffix('#') {
        let (_, fields) = LAYOUTS.iter().find(|(n, _)| *n == layout)?;
        return Some(fields.len().to_string());
    }
    let (layout, field) = word.split_once('.')?;
    let (_, fields) = LAYOUTS.iter().find(|(n, _)| *n == layout)?;
    fields
        .iter()
        .position(|f| *f == field)
        .map(|i| i.to_string())
}
