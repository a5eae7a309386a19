//! Assembles the Lua library that Redis loads once (`FUNCTION LOAD`): the common state, one file
//! per stateful control, the ledger, the slices and each entry point's file, with every
//! `@layout.field` of the argument contract replaced by its offset and every `@layout#` by its
//! length (`src/contract.rs`, the table the encoder writes by), and `@schema` by the schema
//! (`SCHEMA` there). A name the table lacks fails the build.
//!
//! The library's name and its functions' names end with a hash of its text, so two builds with
//! different scripts never replace each other's functions on a shared Redis
//! (`TOLLGATE_LUA_VERSION`, read by `src/conn.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

include!("src/contract.rs");

/// The ledger's files, in order: the functions every entry point shares.
const LEDGER: &[&str] = &[
    "common.lua",
    "seq.lua",
    "controls/rate.lua",
    "controls/concurrency.lua",
    "controls/budget.lua",
    "ledger.lua",
];

/// The entry points, after the ledger and the slices: each file defines the local function
/// `call_<name>`, which the library registers as `tollgate_<name>_<version>`.
const ENTRIES: &[(&str, &str)] = &[
    ("batch.lua", "batch"),
    ("renew.lua", "renew"),
    ("usage.lua", "usage"),
    ("sweep.lua", "sweep"),
    ("state.lua", "state"),
    ("keys.lua", "keys"),
    ("records.lua", "records"),
];

fn main() {
    let dir = Path::new("src/lua");
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    println!("cargo::rerun-if-changed=src/lua");
    println!("cargo::rerun-if-changed=src/contract.rs");
    let read = |file: &str| {
        let path = dir.join(file);
        let src =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        substitute(&src, file) + "\n"
    };
    let ledger: String = LEDGER.iter().map(|f| read(f)).collect();
    // The ledger alone, for benchmarks that call its functions.
    std::fs::write(Path::new(&out).join("ledger.lua"), &ledger).expect("write the ledger");
    let mut body = ledger + &read("slices.lua");
    for (file, _) in ENTRIES {
        body.push_str(&read(file));
    }
    let version = format!("{:016x}", fnv1a(body.as_bytes()));
    let mut library = format!("#!lua name=tollgate_{version}\n{body}");
    for (_, name) in ENTRIES {
        library.push_str(&format!(
            "redis.register_function('tollgate_{name}_{version}', call_{name})\n"
        ));
    }
    std::fs::write(Path::new(&out).join("library.lua"), library).expect("write the library");
    println!("cargo::rustc-env=TOLLGATE_LUA_VERSION={version}");
}

/// FNV-1a, 64 bits: a stable name for the library's text (not a defence against anyone).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
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
    if word == "schema" {
        return Some(SCHEMA.to_owned());
    }
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
