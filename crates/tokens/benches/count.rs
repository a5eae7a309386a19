//! Counting throughput against tiktoken-rs in the same run, and the cost of rejecting large and
//! hostile prompts against an 8k limit.
//!
//! `cargo bench -p tollgate-tokens --bench count`
//!
//! Corpora (built here, nothing downloaded): English = this repository's Markdown docs; code =
//! its Rust sources; multilingual = generated words in Cyrillic, CJK, Arabic and Devanagari with
//! Latin punctuation. Each is repeated to 1 MiB.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::LazyLock;

use divan::Bencher;
use divan::counter::BytesCount;
use tollgate_tokens::{Format, TokenCounter};

fn main() {
    divan::main();
}

const MIB: usize = 1 << 20;

fn read_tree(dir: &Path, ext: &str, out: &mut String) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() && !p.ends_with("target") {
            read_tree(&p, ext, out);
        } else if p.extension().is_some_and(|e| e == ext) {
            out.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
        }
    }
}

fn to_mib(seed: String) -> String {
    let mut s = seed.repeat(MIB / seed.len().max(1) + 1);
    let mut cut = MIB;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s
}

static ROOT: LazyLock<&'static Path> = LazyLock::new(|| {
    Box::leak(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .into_boxed_path(),
    )
});

static ENGLISH: LazyLock<String> = LazyLock::new(|| {
    let mut s = String::new();
    read_tree(&ROOT.join("docs"), "md", &mut s);
    s.push_str(&std::fs::read_to_string(ROOT.join("README.md")).unwrap());
    to_mib(s)
});

static CODE: LazyLock<String> = LazyLock::new(|| {
    let mut s = String::new();
    read_tree(&ROOT.join("crates"), "rs", &mut s);
    to_mib(s)
});

static MULTILINGUAL: LazyLock<String> = LazyLock::new(|| {
    let words = [
        "бюджет",
        "запрос",
        "лимит",
        "токены",
        "ограничение",
        "预算",
        "请求",
        "令牌",
        "并发",
        "限制",
        "ميزانية",
        "طلب",
        "حد",
        "रोक",
        "अनुरोध",
        "सीमा",
        "予算",
        "リクエスト",
        "制限",
    ];
    let mut x: u64 = 42;
    let mut s = String::new();
    while s.len() < 64 * 1024 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push_str(match (x >> 20) % 9 {
            0 => ", ",
            1 => ". ",
            2 => "\n",
            _ => " ",
        });
    }
    to_mib(s)
});

fn corpus(name: &str) -> &'static str {
    match name {
        "english" => &ENGLISH,
        "code" => &CODE,
        _ => &MULTILINGUAL,
    }
}

const CORPORA: [&str; 3] = ["english", "multilingual", "code"];

#[divan::bench(args = CORPORA, sample_count = 10)]
fn tollgate_o200k(bencher: Bencher, name: &str) {
    let text = corpus(name);
    let c = TokenCounter::default();
    bencher
        .counter(BytesCount::of_str(text))
        .bench(|| c.count_text("gpt-4o", divan::black_box(text), None));
}

#[divan::bench(args = CORPORA, sample_count = 10)]
fn tiktoken_rs_o200k(bencher: Bencher, name: &str) {
    let text = corpus(name);
    let bpe = tiktoken_rs::o200k_base_singleton();
    bencher
        .counter(BytesCount::of_str(text))
        .bench(|| bpe.encode_ordinary(divan::black_box(text)).len());
}

#[divan::bench(args = CORPORA, sample_count = 10)]
fn tollgate_cl100k(bencher: Bencher, name: &str) {
    let text = corpus(name);
    let c = TokenCounter::default();
    bencher
        .counter(BytesCount::of_str(text))
        .bench(|| c.count_text("gpt-4", divan::black_box(text), None));
}

#[divan::bench(args = CORPORA, sample_count = 10)]
fn tiktoken_rs_cl100k(bencher: Bencher, name: &str) {
    let text = corpus(name);
    let bpe = tiktoken_rs::cl100k_base_singleton();
    bencher
        .counter(BytesCount::of_str(text))
        .bench(|| bpe.encode_ordinary(divan::black_box(text)).len());
}

const HOSTILE: [&str; 8] = [
    "english",
    "spaces",
    "tabs",
    "one letter",
    "ideographic spaces",
    "digits",
    "emoji",
    "no spaces 1 MiB",
];

fn hostile_body(kind: &str) -> Vec<u8> {
    let ten = 10 * MIB;
    let content = match kind {
        "english" => ENGLISH.repeat(10),
        "spaces" => " ".repeat(ten),
        "tabs" => "\t".repeat(ten),
        "one letter" => "a".repeat(ten),
        "ideographic spaces" => "\u{3000}".repeat(ten / 3),
        "digits" => "7".repeat(ten),
        "emoji" => "🙂".repeat(ten / 4),
        // The largest text that passes the 128-bytes-per-token bound and must really be counted.
        _ => "x".repeat(128 * 8192),
    };
    serde_json::to_vec(&serde_json::json!({
        "model": "gpt-4o",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": content}],
    }))
    .unwrap()
}

/// Parsing and counting a whole request body (10 MiB, or 1 MiB for the last case) against an
/// 8192-token input limit: the time to refuse it.
#[divan::bench(args = HOSTILE, sample_count = 10)]
fn reject_10mib_request_8k_limit(bencher: Bencher, kind: &str) {
    let body = hostile_body(kind);
    let c = TokenCounter::default();
    bencher.counter(BytesCount::new(body.len())).bench(|| {
        let r = c
            .count(Format::ChatCompletions, divan::black_box(&body), Some(8192))
            .unwrap();
        assert!(r.over_limit);
    });
}

/// Counting alone (no JSON) against an 8192-token limit: 10 MiB of English is refused by the
/// byte bound without counting; 1 MiB (just under the bound, 128 × 8192 bytes) must be counted
/// until the limit is passed.
#[divan::bench(args = [10, 1], sample_count = 20)]
fn count_till_limit_english_mib(bencher: Bencher, mib: usize) {
    let text = ENGLISH.repeat(mib);
    let c = TokenCounter::default();
    bencher.bench(|| {
        let (n, _) = c.count_text("gpt-4o", divan::black_box(&text), Some(8192));
        assert_eq!(n, 8193);
    });
}
