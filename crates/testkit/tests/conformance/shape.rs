//! The code's shape, as the workspace's rules state it: outside tests, no source file is over
//! 600 lines and no function over 120, in Rust and in the Redis scripts. Tests are exempt:
//! `tests/` and `benches/` folders, `tests.rs` modules, `#[cfg(test)]` modules and the test kit
//! (this crate). Functions are found by their layout, which `cargo fmt` keeps: a Rust function's
//! body ends at the first `}` at its own indentation, a Lua function's at the first `end`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 600;
const MAX_FUNCTION_LINES: usize = 120;

/// A function found: its name, its first line (from 1) and its length in lines.
type Found = (String, usize, usize);

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `dir` whose name ends with `ext`, outside test folders.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "tests" | "benches" | "target") {
                files(&path, ext, out);
            }
        } else if name.ends_with(ext) && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The sources checked: every crate's `src/` and build script but the test kit's, and the
/// Redis scripts.
fn sources(ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(workspace().join("crates")).unwrap() {
        let krate = entry.unwrap().path();
        if krate.ends_with("testkit") {
            continue;
        }
        files(&krate.join("src"), ext, &mut out);
        let build = krate.join("build.rs");
        if ext == ".rs" && build.exists() {
            out.push(build);
        }
    }
    assert!(out.len() > 10, "found only {} {ext} files", out.len());
    out
}

/// A file's lines without its `#[cfg(test)]` modules.
fn non_test_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let next = lines.get(i + 1).map_or("", |l| l.trim_start());
        let opens_module = (next.starts_with("mod ") || next.starts_with("pub(crate) mod "))
            && next.ends_with('{');
        if lines[i].trim() == "#[cfg(test)]" && opens_module {
            let indent = indentation(lines[i + 1]);
            let close = format!("{indent}}}");
            i += 2;
            while i < lines.len() && lines[i] != close {
                i += 1;
            }
            i += 1;
            continue;
        }
        out.push(lines[i]);
        i += 1;
    }
    out
}

fn indentation(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

/// Each Rust function with a body.
fn rust_functions(lines: &[&str]) -> Vec<Found> {
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let after_fn = ["pub ", "pub(crate) ", "pub(super) ", "async ", "const "]
            .iter()
            .fold(code, |c, p| c.strip_prefix(p).unwrap_or(c))
            .strip_prefix("fn ");
        let Some(rest) = after_fn else { continue };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The signature ends at the body's `{`, or at `;` for a declaration without one.
        let Some(open) = (i..lines.len()).find(|&j| {
            let l = lines[j].trim_end();
            l.contains('{') || l.ends_with(';')
        }) else {
            continue;
        };
        let sig_end = lines[open].trim_end();
        if !sig_end.contains('{') || sig_end.ends_with('}') {
            continue;
        }
        let close = format!("{}}}", indentation(line));
        if let Some(end) = (open + 1..lines.len()).find(|&j| lines[j] == close) {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

/// Each Lua function.
fn lua_functions(lines: &[&str]) -> Vec<Found> {
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let code = code.strip_prefix("local ").unwrap_or(code);
        let Some(rest) = code.strip_prefix("function ") else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let close = format!("{}end", indentation(line));
        if let Some(end) = (i + 1..lines.len()).find(|&j| lines[j].trim_end() == close) {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

fn over_limits(ext: &str, functions: fn(&[&str]) -> Vec<Found>) -> Vec<String> {
    let mut found = Vec::new();
    for path in sources(ext) {
        let text = std::fs::read_to_string(&path).unwrap();
        let lines = non_test_lines(&text);
        let shown = path.strip_prefix(workspace()).unwrap_or(&path).display();
        if lines.len() > MAX_FILE_LINES {
            found.push(format!("{shown}: {} lines", lines.len()));
        }
        for (name, at, n) in functions(&lines) {
            if n > MAX_FUNCTION_LINES {
                found.push(format!("{shown}:{at}: fn {name}, {n} lines"));
            }
        }
    }
    found
}

#[test]
fn rust_sources_keep_files_and_functions_short() {
    let found = over_limits(".rs", rust_functions);
    assert!(found.is_empty(), "over the limits:\n{}", found.join("\n"));
}

#[test]
fn lua_scripts_keep_files_and_functions_short() {
    let found = over_limits(".lua", lua_functions);
    assert!(found.is_empty(), "over the limits:\n{}", found.join("\n"));
}

/// The measures themselves find what they must: a long function, a test module left out.
#[test]
fn the_measures_find_long_functions_and_skip_test_modules() {
    let body = "    let x = 1;\n".repeat(130);
    let rust = format!(
        "pub fn long(a: u8) -> u8 {{\n{body}}}\nfn short() {{}}\ntrait T {{\n    fn decl(&self);\n}}\n\
         #[cfg(test)]\nmod tests {{\n{body}}}\n"
    );
    let lines = non_test_lines(&rust);
    assert_eq!(lines.len(), 132 + 4);
    assert_eq!(rust_functions(&lines), vec![("long".to_owned(), 1, 132)]);
    let lua = format!("local function f(a)\n{body}end\nfunction g() return 1 end\n");
    let lines: Vec<&str> = lua.lines().collect();
    assert_eq!(lua_functions(&lines), vec![("f".to_owned(), 1, 132)]);
}
