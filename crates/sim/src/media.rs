//! What the provider bills for a request's media, by its documented rules and each item's real
//! size, which the simulator knows where the gateway cannot: an image or document given by URL
//! or file id carries its size in its name (`https://images.test/2048x2048.png`,
//! `file-img-1024x768`, `file-pdf-40pages`; an audio answer `audio_120s`).
//!
//! - Images, OpenAI: 32-pixel patches times the model's multiplier (gpt-4.1-mini and -nano,
//!   o4-mini, gpt-5-mini and -nano), else 512-pixel tiles at the model's prices; Anthropic:
//!   pixels / 750 after its resize.
//! - PDFs: each page the image of a 1700×2200 page plus its text (OpenAI), 1,500 tokens for a
//!   page without text (Anthropic); the simulator's documents have no text.
//! - Audio: 10 tokens a second of input audio; an earlier answer's audio by id is billed again.

use serde_json::Value;
use tollgate_tokens::Format;

/// The request without its media parts, for the text's count, and the tokens its media bill.
pub(crate) fn split(req: &Value, format: Format) -> (Value, u64) {
    let model = req["model"].as_str().unwrap_or("").to_owned();
    let mut text_only = req.clone();
    let mut billed = 0u64;
    let list = match format {
        Format::Responses => "input",
        _ => "messages",
    };
    if let Some(items) = text_only[list].as_array_mut() {
        for item in items {
            if let Some(id) = item["audio"]["id"].as_str() {
                billed += 10 * number_before(id, "s").unwrap_or(60);
                item.as_object_mut().map(|o| o.remove("audio"));
            }
            let Some(parts) = item["content"].as_array_mut() else {
                continue;
            };
            parts.retain(|p| match part_tokens(&model, p, format) {
                Some(n) => {
                    billed += n;
                    false
                }
                None => true,
            });
        }
    }
    (text_only, billed)
}

/// What a media part bills, or `None` for a part that is not media.
fn part_tokens(model: &str, p: &Value, format: Format) -> Option<u64> {
    let anthropic = format == Format::AnthropicMessages;
    match p["type"].as_str()? {
        "image" if anthropic => {
            let s = &p["source"];
            let size = match s["data"].as_str() {
                Some(d) => tollgate_tokens::base64_head_size(d),
                None => size_in(s["url"].as_str().or(s["file_id"].as_str()).unwrap_or("")),
            };
            Some(anthropic_image(size.unwrap_or((1024, 1024))))
        }
        "document" if anthropic && p["source"]["type"] == "base64" => {
            Some(1_500 * pages(p["source"]["data"].as_str().unwrap_or(""))?)
        }
        "image_url" | "input_image" => {
            let url = p["image_url"]["url"]
                .as_str()
                .or(p["image_url"].as_str())
                .or(p["file_id"].as_str())
                .unwrap_or("");
            let size = tollgate_tokens::data_url_size(url).or_else(|| size_in(url));
            let detail = p["image_url"]["detail"].as_str().or(p["detail"].as_str());
            Some(openai_image(model, detail, size.unwrap_or((1024, 1024))))
        }
        "file" | "input_file" => {
            let f = if p["file"].is_object() { &p["file"] } else { p };
            let pages = match f["file_data"].as_str() {
                Some(d) => pages(d)?,
                None => number_before(
                    f["file_id"]
                        .as_str()
                        .or(f["file_url"].as_str())
                        .unwrap_or(""),
                    "pages",
                )?,
            };
            Some(pages * openai_image(model, Some("high"), (1700, 2200)))
        }
        "input_audio" => {
            let a = &p["input_audio"];
            let bytes = tollgate_tokens::media::decode(a["data"].as_str()?)?;
            let seconds = tollgate_tokens::media::audio_seconds(&bytes, a["format"].as_str()?)?;
            Some(10 * seconds)
        }
        _ => None,
    }
}

fn pages(b64: &str) -> Option<u64> {
    tollgate_tokens::media::decode(b64).and_then(|b| tollgate_tokens::media::pdf_pages(&b))
}

/// `W`x`H` in a name.
fn size_in(name: &str) -> Option<(u64, u64)> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .find_map(|w| {
            let (a, b) = w.split_once('x')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
}

/// The number just before `unit` in a name (`40pages`, `120s`).
fn number_before(name: &str, unit: &str) -> Option<u64> {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .find_map(|w| w.strip_suffix(unit)?.parse().ok())
}

/// OpenAI's rule for an image of `(w, h)` on `model`, as its vision guide states it.
fn openai_image(model: &str, detail: Option<&str>, (w, h): (u64, u64)) -> u64 {
    let multiplier = [
        ("gpt-5-mini", 1.62),
        ("gpt-5-nano", 2.46),
        ("gpt-4.1-mini", 1.62),
        ("gpt-4.1-nano", 2.46),
        ("o4-mini", 1.72),
    ]
    .into_iter()
    .find(|(p, _)| model.starts_with(p));
    let (w, h) = (w as f64, h as f64);
    if let Some((_, m)) = multiplier {
        let raw = (w / 32.0).ceil() * (h / 32.0).ceil();
        let patches = if raw <= 1536.0 {
            raw
        } else {
            let r = (1024.0 * 1536.0 / (w * h)).sqrt();
            let r = r
                * ((w * r / 32.0).floor() / (w * r / 32.0))
                    .min((h * r / 32.0).floor() / (h * r / 32.0));
            ((w * r / 32.0).ceil() * (h * r / 32.0).ceil()).min(1536.0)
        };
        return (patches * m).ceil() as u64;
    }
    let (base, tile) = if model.starts_with("gpt-4o-mini") {
        (2833, 5667)
    } else if model.starts_with("gpt-5") {
        (70, 140)
    } else if model.starts_with("o1") || model.starts_with("o3") {
        (75, 150)
    } else {
        (85, 170)
    };
    if detail == Some("low") {
        return base;
    }
    let fit = (2048.0 / w.max(h)).min(1.0);
    let (w, h) = (w * fit, h * fit);
    let short = (768.0 / w.min(h)).min(1.0);
    let (w, h) = (w * short, h * short);
    base + tile * ((w / 512.0).ceil() * (h / 512.0).ceil()) as u64
}

/// Anthropic's rule: resized to a long edge of 1,568 and 1.2 megapixels, then pixels / 750.
fn anthropic_image((w, h): (u64, u64)) -> u64 {
    let (w, h) = (w as f64, h as f64);
    let s = (1568.0 / w.max(h)).min(1.0);
    let (w, h) = (w * s, h * s);
    let s = (1_200_000.0 / (w * h)).sqrt().min(1.0);
    ((w * s) * (h * s) / 750.0).ceil() as u64
}
