//! Image input costs for OpenAI vision models, by detail and size.

/// The token cost of one image and whether it is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageCost {
    /// Tokens.
    pub tokens: u64,
    /// False when the size was unknown and the worst case was charged.
    pub exact: bool,
}

/// Tokens for an image of `size` (width, height) at `detail` (`low`, `high`, `auto`) on a model
/// of the gpt-4o family: `low` is a flat base; `high` scales the image to fit 2048×2048, then
/// its short side to 768, and charges a tile price per 512-pixel tile plus the base. `auto` is
/// charged as `high`. An unknown size is charged the worst case (768×2048: 8 tiles), flagged.
/// `-mini` models use their own (larger) base and tile prices.
pub fn image_tokens(model: &str, detail: Option<&str>, size: Option<(u64, u64)>) -> ImageCost {
    let (base, tile) = if model.contains("mini") {
        (2833, 5667)
    } else {
        (85, 170)
    };
    if detail == Some("low") {
        return ImageCost {
            tokens: base,
            exact: true,
        };
    }
    let Some((w, h)) = size.filter(|(w, h)| *w > 0 && *h > 0) else {
        return ImageCost {
            tokens: base + 8 * tile,
            exact: false,
        };
    };
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
    let tiles = ((w / 512.0).ceil() as u64) * ((h / 512.0).ceil() as u64);
    ImageCost {
        tokens: base + tiles * tile,
        exact: true,
    }
}

/// The size of an image given inline as a base64 data URL, read from its header only (at most
/// the first 64 KiB are decoded). `None` for remote URLs or unreadable headers.
pub fn data_url_size(url: &str) -> Option<(u64, u64)> {
    use base64::Engine;
    let rest = url.strip_prefix("data:")?;
    let (_, b64) = rest.split_once(";base64,")?;
    // Whole 4-character groups only, so that a prefix decodes on its own.
    let take = b64.len().min(64 * 1024) / 4 * 4;
    let head = base64::engine::general_purpose::STANDARD
        .decode(&b64.as_bytes()[..take])
        .ok()?;
    let size = imagesize::blob_size(&head).ok()?;
    Some((size.width as u64, size.height as u64))
}
