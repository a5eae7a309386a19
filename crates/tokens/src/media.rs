//! Documents and audio held inline: what the provider bills for them, read from their own
//! bytes (a PDF's pages, an audio clip's duration), never from the JSON text that carries them.
//!
//! - **PDF**: providers bill each page as the image of the page plus its text. OpenAI: the
//!   model's most for one image ([`crate::image_tokens`] of unknown size) plus
//!   [`PAGE_TEXT_TOKENS`]; Anthropic: [`ANTHROPIC_PAGE_TOKENS`], the top of its stated range.
//! - **Audio** (`input_audio`, WAV or MP3): OpenAI bills a token per 100 ms of input audio.

use std::borrow::Cow;

use base64::Engine;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::{RequestError, Tally};

/// The text of one PDF page, allowed on top of the page's image (OpenAI): a dense page of
/// small print; settlement charges what the upstream reports.
pub const PAGE_TEXT_TOKENS: u64 = 2_000;

/// One PDF page on Anthropic's API: its guide states 1,500 to 3,000 tokens a page, text and
/// image together.
pub const ANTHROPIC_PAGE_TOKENS: u64 = 3_000;

/// Input audio tokens per second (a token per 100 ms).
pub const AUDIO_TOKENS_PER_SECOND: u64 = 10;

/// A file part: chat's `file` (`{"file": {"file_data"}}`) or the Responses API's `input_file`
/// (`{"file_data"}`): an inline PDF is charged by its pages on `model`; one held elsewhere (by
/// id or URL), or inline but not a PDF whose pages can be read, is its JSON text and a remote
/// item, whose content the caller allows for (or refuses).
pub(crate) fn file_part(
    t: &mut Tally,
    model: &str,
    raw: &RawValue,
    path: &str,
) -> Result<(), RequestError> {
    #[derive(Deserialize)]
    struct Inner<'a> {
        #[serde(default, borrow)]
        file_data: Option<Cow<'a, str>>,
    }
    #[derive(Deserialize)]
    struct FilePart<'a> {
        #[serde(default, borrow)]
        file: Option<Inner<'a>>,
        #[serde(default, borrow)]
        file_data: Option<Cow<'a, str>>,
    }
    let p: FilePart<'_> =
        serde_json::from_str(raw.get()).map_err(|e| RequestError::invalid(path, e.to_string()))?;
    t.estimated();
    let data = p.file_data.or(p.file.and_then(|f| f.file_data));
    match data
        .as_deref()
        .and_then(decode)
        .as_deref()
        .and_then(pdf_pages)
    {
        Some(pages) => t.add(openai_pdf_tokens(model, pages)),
        None => {
            t.text(raw.get());
            t.remote_item();
        }
    }
    Ok(())
}

/// Chat's `input_audio` part (`{"input_audio": {"data", "format"}}`): charged by its duration;
/// a clip whose duration cannot be read is refused, named.
pub(crate) fn audio_part(t: &mut Tally, raw: &RawValue, path: &str) -> Result<(), RequestError> {
    #[derive(Deserialize)]
    struct Clip<'a> {
        #[serde(borrow)]
        data: Cow<'a, str>,
        #[serde(borrow)]
        format: Cow<'a, str>,
    }
    #[derive(Deserialize)]
    struct AudioPart<'a> {
        #[serde(borrow)]
        input_audio: Clip<'a>,
    }
    let field = format!("{path}.input_audio");
    let p: AudioPart<'_> = serde_json::from_str(raw.get())
        .map_err(|e| RequestError::invalid(&field, e.to_string()))?;
    let clip = p.input_audio;
    let seconds = decode(&clip.data)
        .and_then(|b| audio_seconds(&b, &clip.format))
        .ok_or_else(|| {
            RequestError::invalid(
                &field,
                format!(
                    "not a readable {:?} clip (wav or mp3): its duration, which the upstream \
                     bills, cannot be read",
                    clip.format
                ),
            )
        })?;
    t.add_audio(seconds.saturating_mul(AUDIO_TOKENS_PER_SECOND));
    t.estimated();
    Ok(())
}

/// The bytes of a base64 text (a data URL's or a source's `data`), or `None` when it is not
/// base64.
pub fn decode(b64: &str) -> Option<Vec<u8>> {
    let b64 = b64.split_once(";base64,").map_or(b64, |(_, d)| d);
    base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()
}

/// The pages of a PDF: the most of its page objects (`/Type /Page`) and of its page trees'
/// counts (`/Count`), read from the file's text. `None` when it is not a PDF or shows neither
/// (its objects are all compressed): the caller cannot know its cost.
pub fn pdf_pages(bytes: &[u8]) -> Option<u64> {
    if !bytes.starts_with(b"%PDF-") {
        return None;
    }
    let mut objects = 0u64;
    let mut counted = 0u64;
    let mut i = 0;
    while let Some(at) = find(&bytes[i..], b"/Type") {
        let rest = &bytes[i + at + 5..];
        let rest = &rest[rest.iter().take_while(|b| b.is_ascii_whitespace()).count()..];
        if rest.starts_with(b"/Pages") {
            counted = counted.max(tree_count(rest).unwrap_or(0));
        } else if rest.starts_with(b"/Page") {
            objects += 1;
        }
        i += at + 5;
    }
    let pages = objects.max(counted);
    (pages > 0).then_some(pages)
}

/// The `/Count` of the page tree whose dictionary continues in `rest` (within its `>>`).
fn tree_count(rest: &[u8]) -> Option<u64> {
    let end = find(rest, b">>").unwrap_or(rest.len());
    let dict = &rest[..end];
    let at = find(dict, b"/Count")? + 6;
    let digits: Vec<u8> = dict[at..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Tokens for a PDF of `pages` pages on `model` (OpenAI's rule), see the module's notes.
pub fn openai_pdf_tokens(model: &str, pages: u64) -> u64 {
    let image = crate::image_tokens(model, Some("high"), None).tokens;
    pages.saturating_mul(image.saturating_add(PAGE_TEXT_TOKENS))
}

/// The seconds of an audio clip in `format` (`wav`, `mp3`), rounded up; `None` when its bytes
/// are not of that format.
pub fn audio_seconds(bytes: &[u8], format: &str) -> Option<u64> {
    match format {
        "wav" => wav_seconds(bytes),
        "mp3" => mp3_seconds(bytes),
        _ => None,
    }
}

/// A WAV clip's seconds: its bytes after the `data` chunk's header over the byte rate of its
/// `fmt ` chunk (the bytes the decoder will play, whatever the header claims).
fn wav_seconds(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return None;
    }
    let mut at = 12;
    let mut byte_rate = None;
    while at + 8 <= bytes.len() {
        let id = &bytes[at..at + 4];
        let size = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().ok()?) as usize;
        let body = at + 8;
        if id == b"fmt " && body + 12 <= bytes.len() {
            byte_rate = Some(u32::from_le_bytes(
                bytes[body + 8..body + 12].try_into().ok()?,
            ));
        }
        if id == b"data" {
            let rate = u64::from(byte_rate.filter(|r| *r > 0)?);
            let data = (bytes.len() - body) as u64;
            return Some(data.div_ceil(rate));
        }
        at = body.checked_add(size)?.checked_add(size % 2)?;
    }
    None
}

/// An MP3 clip's seconds, frame by frame (after an ID3v2 tag). Where the frames stop before the
/// end, the rest is taken at the lowest bitrate MP3 has (8 kbit/s): no decoder can play it for
/// longer.
fn mp3_seconds(bytes: &[u8]) -> Option<u64> {
    let mut at = 0usize;
    if bytes.len() >= 10 && &bytes[..3] == b"ID3" {
        let size = bytes[6..10]
            .iter()
            .fold(0usize, |n, b| (n << 7) | usize::from(b & 0x7f));
        at = 10 + size;
    }
    let (mut samples, mut rate, mut frames) = (0u64, 0u64, 0u64);
    while let Some((len, n, r)) = bytes.get(at..at + 4).and_then(mp3_frame) {
        samples += n;
        rate = r;
        frames += 1;
        at += len;
    }
    if frames == 0 {
        return None;
    }
    let rest = bytes.len().saturating_sub(at) as u64;
    Some((samples.div_ceil(rate)).saturating_add((rest * 8).div_ceil(8_000)))
}

/// An MPEG audio Layer III frame header: (frame length in bytes, samples, sample rate).
fn mp3_frame(h: &[u8]) -> Option<(usize, u64, u64)> {
    if h[0] != 0xff || h[1] & 0xe0 != 0xe0 || (h[1] >> 1) & 3 != 1 {
        return None;
    }
    let version = (h[1] >> 3) & 3; // 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
    const V1: [u64; 15] = [
        0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320,
    ];
    const V2: [u64; 15] = [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160];
    let kbps = *match version {
        3 => V1.get(usize::from(h[2] >> 4))?,
        0 | 2 => V2.get(usize::from(h[2] >> 4))?,
        _ => return None,
    };
    let base: u64 = *[44_100, 48_000, 32_000].get(usize::from((h[2] >> 2) & 3))?;
    let rate = match version {
        3 => base,
        2 => base / 2,
        _ => base / 4,
    };
    let samples = if version == 3 { 1_152 } else { 576 };
    let padding = u64::from((h[2] >> 1) & 1);
    let len = samples / 8 * kbps * 1_000 / rate + padding;
    (kbps > 0 && len >= 4).then_some((usize::try_from(len).ok()?, samples, rate))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PDF of `n` empty pages, as a writer lays one out.
    pub(crate) fn pdf(n: u64) -> Vec<u8> {
        let mut s = String::from("%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n");
        s.push_str(&format!(
            "2 0 obj << /Type /Pages /Count {n} /Kids [] >> endobj\n"
        ));
        for k in 0..n {
            s.push_str(&format!(
                "{} 0 obj << /Type /Page /Parent 2 0 R >> endobj\n",
                k + 3
            ));
        }
        s.push_str("%%EOF\n");
        s.into_bytes()
    }

    /// A WAV clip of `seconds` of 16 kHz 16-bit mono silence.
    pub(crate) fn wav(seconds: u32) -> Vec<u8> {
        let data = 32_000 * seconds;
        let mut b = b"RIFF".to_vec();
        b.extend((36 + data).to_le_bytes());
        b.extend(b"WAVEfmt ");
        b.extend(16u32.to_le_bytes());
        b.extend([1, 0, 1, 0]);
        b.extend(16_000u32.to_le_bytes());
        b.extend(32_000u32.to_le_bytes());
        b.extend([2, 0, 16, 0]);
        b.extend(b"data");
        b.extend(data.to_le_bytes());
        b.extend(vec![0u8; data as usize]);
        b
    }

    #[test]
    fn pages_are_read_from_the_document() {
        assert_eq!(pdf_pages(&pdf(100)), Some(100));
        assert_eq!(pdf_pages(&pdf(1)), Some(1));
        // A tree that says more pages than objects show (its pages compressed): the count.
        let compressed = b"%PDF-1.7\n2 0 obj << /Type /Pages /Count 60 /Kids [3 0 R] >>\n";
        assert_eq!(pdf_pages(compressed), Some(60));
        assert_eq!(pdf_pages(b"%PDF-1.7\n<< /Type /ObjStm >>"), None);
        assert_eq!(pdf_pages(b"not a pdf /Type /Page"), None);
    }

    #[test]
    fn durations_are_read_from_the_clip() {
        assert_eq!(audio_seconds(&wav(3), "wav"), Some(3));
        assert_eq!(audio_seconds(&wav(3), "mp3"), None);
        assert_eq!(audio_seconds(b"RIFF....WAVE", "wav"), None);
        // 100 MPEG-1 frames at 128 kbit/s, 44.1 kHz: 417 bytes each, 1,152 samples: 2.6 s.
        let frame = {
            let mut f = vec![0xff, 0xfb, 0x90, 0x00];
            f.resize(417, 0);
            f
        };
        let clip: Vec<u8> = frame.iter().copied().cycle().take(417 * 100).collect();
        assert_eq!(audio_seconds(&clip, "mp3"), Some(3));
        // Junk after the frames is taken at 8 kbit/s: 1,000 bytes are at most a second more.
        let mut junk = clip.clone();
        junk.extend(vec![0u8; 1_000]);
        assert_eq!(audio_seconds(&junk, "mp3"), Some(4));
        assert_eq!(audio_seconds(&[0u8; 64], "mp3"), None);
    }
}
