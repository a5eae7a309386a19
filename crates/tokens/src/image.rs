//! Image input costs, by the model's own rule, its detail and the image's size.
//!
//! OpenAI prices images by one of two rules, by model family: 512-pixel tiles (gpt-4o, gpt-4.1,
//! gpt-4.5, gpt-5, o1, o3) or 32-pixel patches times the model's multiplier (gpt-4.1-mini,
//! gpt-4.1-nano, o4-mini, gpt-5-mini, gpt-5-nano). Anthropic charges pixels / 750 after its
//! resize ([`anthropic_image_tokens`]).

/// The token cost of one image and whether it is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageCost {
    /// Tokens.
    pub tokens: u64,
    /// False when the size was unknown and the model's most for one image was charged.
    pub exact: bool,
}

/// How a model prices an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageRule {
    /// A base price plus a price per 512-pixel tile after scaling; `detail: low` is the base.
    Tiles {
        /// Tokens for any image.
        base: u64,
        /// Tokens per tile.
        tile: u64,
    },
    /// 32-pixel patches (at most 1,536, the image scaled down to fit) times a multiplier, in
    /// thousandths; `detail` does not change it.
    Patches {
        /// The multiplier × 1000.
        per_mille: u64,
    },
}

/// The most patches an image is billed for under the patch rule.
const MAX_PATCHES: u64 = 1_536;

/// The rule of an OpenAI model, by the longest name prefix that OpenAI's vision guide lists;
/// names it does not list are priced as gpt-4o.
pub fn image_rule(model: &str) -> ImageRule {
    const PATCHES: [(&str, u64); 5] = [
        ("gpt-5-mini", 1_620),
        ("gpt-5-nano", 2_460),
        ("gpt-4.1-mini", 1_620),
        ("gpt-4.1-nano", 2_460),
        ("o4-mini", 1_720),
    ];
    const TILES: [(&str, u64, u64); 6] = [
        ("gpt-4o-mini", 2_833, 5_667),
        ("gpt-5", 70, 140),
        ("o1", 75, 150),
        ("o3", 75, 150),
        ("computer-use-preview", 65, 129),
        ("gpt-4", 85, 170),
    ];
    if let Some((_, m)) = PATCHES.iter().find(|(p, _)| model.starts_with(p)) {
        return ImageRule::Patches { per_mille: *m };
    }
    match TILES.iter().find(|(p, _, _)| model.starts_with(p)) {
        Some((_, base, tile)) => ImageRule::Tiles {
            base: *base,
            tile: *tile,
        },
        None => ImageRule::Tiles {
            base: 85,
            tile: 170,
        },
    }
}

/// Tokens for an image of `size` (width, height) at `detail` (`low`, `high`, `auto`) on an
/// OpenAI `model`, by its rule ([`image_rule`]). An unknown size (an image by URL or file id)
/// is charged the most one image can cost on that model, flagged.
pub fn image_tokens(model: &str, detail: Option<&str>, size: Option<(u64, u64)>) -> ImageCost {
    let size = size.filter(|(w, h)| *w > 0 && *h > 0);
    match image_rule(model) {
        ImageRule::Tiles { base, tile } => {
            if detail == Some("low") {
                return ImageCost {
                    tokens: base,
                    exact: true,
                };
            }
            match size {
                Some((w, h)) => ImageCost {
                    tokens: base + tiles(w, h) * tile,
                    exact: true,
                },
                // 768×2048 is the largest after scaling: 2 × 4 tiles.
                None => ImageCost {
                    tokens: base + 8 * tile,
                    exact: false,
                },
            }
        }
        ImageRule::Patches { per_mille } => {
            let (patches, exact) = match size {
                Some((w, h)) => (patches(w, h), true),
                None => (MAX_PATCHES, false),
            };
            ImageCost {
                tokens: (patches * per_mille).div_ceil(1_000),
                exact,
            }
        }
    }
}

/// 512-pixel tiles of a `w`×`h` image scaled to fit 2048×2048, then its short side to 768.
fn tiles(w: u64, h: u64) -> u64 {
    let (mut w, mut h) = (w as f64, h as f64);
    if w > 2048.0 || h > 2048.0 {
        let s = 2048.0 / w.max(h);
        w *= s;
        h *= s;
    }
    let s = 768.0 / w.min(h);
    if s < 1.0 {
        w *= s;
        h *= s;
    }
    ((w / 512.0).ceil() as u64) * ((h / 512.0).ceil() as u64)
}

/// 32-pixel patches of a `w`×`h` image, scaled down (OpenAI's steps) when over 1,536.
fn patches(w: u64, h: u64) -> u64 {
    let count = |w: f64, h: f64| ((w / 32.0).ceil() as u64) * ((h / 32.0).ceil() as u64);
    let (w, h) = (w as f64, h as f64);
    if count(w, h) <= MAX_PATCHES {
        return count(w, h);
    }
    let r = (32.0 * 32.0 * MAX_PATCHES as f64 / (w * h)).sqrt();
    let fit = |side: f64| (side * r / 32.0).floor() / (side * r / 32.0);
    let r = r * fit(w).min(fit(h));
    count(w * r, h * r).min(MAX_PATCHES)
}

/// Anthropic's tokens for an image of `size`: scaled to a long edge of at most 1,568 pixels and
/// at most 1,600 tokens' worth of pixels (1.2 megapixels: its guide's 1092×1092 costs about
/// 1,590), then width × height / 750. An unknown size (by URL or
/// file) is charged 1,600, flagged.
pub fn anthropic_image_tokens(size: Option<(u64, u64)>) -> ImageCost {
    const MOST: u64 = 1_600;
    match size.filter(|(w, h)| *w > 0 && *h > 0) {
        Some((w, h)) => {
            let (mut w, mut h) = (w as f64, h as f64);
            let long = w.max(h);
            if long > 1568.0 {
                w *= 1568.0 / long;
                h *= 1568.0 / long;
            }
            let px = w * h;
            if px > 1_200_000.0 {
                let s = (1_200_000.0 / px).sqrt();
                w *= s;
                h *= s;
            }
            ImageCost {
                tokens: ((w * h / 750.0).ceil() as u64).min(MOST),
                exact: true,
            }
        }
        None => ImageCost {
            tokens: MOST,
            exact: false,
        },
    }
}

/// The size of an image given inline as a base64 data URL, read from its header only (at most
/// the first 64 KiB are decoded). `None` for remote URLs or unreadable headers.
pub fn data_url_size(url: &str) -> Option<(u64, u64)> {
    let rest = url.strip_prefix("data:")?;
    let (_, b64) = rest.split_once(";base64,")?;
    base64_head_size(b64)
}

/// The size of an image whose bytes are `b64` (base64), read from its header.
pub fn base64_head_size(b64: &str) -> Option<(u64, u64)> {
    use base64::Engine;
    // Whole 4-character groups only, so that a prefix decodes on its own.
    let take = b64.len().min(64 * 1024) / 4 * 4;
    let head = base64::engine::general_purpose::STANDARD
        .decode(&b64.as_bytes()[..take])
        .ok()?;
    let size = imagesize::blob_size(&head).ok()?;
    Some((size.width as u64, size.height as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_examples_hold() {
        // OpenAI's vision guide: 1024×1024 high on gpt-4o is 765; low is 85; 2048×4096 is 1105.
        assert_eq!(
            image_tokens("gpt-4o", Some("high"), Some((1024, 1024))).tokens,
            765
        );
        assert_eq!(
            image_tokens("gpt-4o", Some("low"), Some((1024, 1024))).tokens,
            85
        );
        assert_eq!(
            image_tokens("gpt-4o", None, Some((2048, 4096))).tokens,
            1105
        );
        // The patch rule: 1024×1024 is 1024 patches; 1800×2400 scales to 1452 patches.
        assert_eq!(patches(1024, 1024), 1024);
        assert_eq!(patches(1800, 2400), 1452);
        // gpt-4.1-nano's ×2.46, whatever the detail; by URL, the most: 1536 × 2.46.
        assert_eq!(
            image_tokens("gpt-4.1-nano", Some("low"), Some((1024, 1024))).tokens,
            2520
        );
        let url = image_tokens("gpt-4.1-nano", Some("high"), None);
        assert_eq!((url.tokens, url.exact), (3779, false));
        assert_eq!(image_tokens("gpt-4.1-mini", None, None).tokens, 2489);
        assert_eq!(image_tokens("o4-mini", None, None).tokens, 2642);
        // gpt-4o-mini's own tile prices; gpt-5's and o3's.
        assert_eq!(image_tokens("gpt-4o-mini", Some("low"), None).tokens, 2833);
        assert_eq!(image_tokens("gpt-5", Some("low"), None).tokens, 70);
        assert_eq!(image_tokens("o3", None, None).tokens, 75 + 8 * 150);
    }

    #[test]
    fn anthropic_examples_hold() {
        // Anthropic's vision guide: 1092×1092 is about 1,590 tokens; 200×200 about 54.
        assert_eq!(anthropic_image_tokens(Some((1092, 1092))).tokens, 1590);
        assert_eq!(anthropic_image_tokens(Some((200, 200))).tokens, 54);
        assert_eq!(anthropic_image_tokens(Some((8000, 8000))).tokens, 1600);
        assert_eq!(anthropic_image_tokens(Some((1568, 400))).tokens, 837);
        assert_eq!(anthropic_image_tokens(None).tokens, 1600);
    }
}
