//! `[[keys]]`, checked: each key's digest, tenant, end user, models, exemptions and class.

use std::collections::{BTreeMap, HashMap};

use tollgate_core::Reason;

use super::raw::RawKey;
use super::{ConfigError, KeyConfig, err};

/// The virtual keys, by the hex of their hash.
pub(super) fn keys(
    raw: Vec<RawKey>,
    models: &BTreeMap<String, usize>,
    classes: &tollgate_core::controls::reserve::Classes,
) -> Result<HashMap<String, KeyConfig>, ConfigError> {
    let mut keys = HashMap::new();
    for (i, k) in raw.into_iter().enumerate() {
        let field = format!("keys[{i}]");
        let hex = k
            .hash
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
            .ok_or_else(|| {
                err(
                    format!("{field}.hash"),
                    "expected sha256:<64 hex digits> (see `tollgate hash-key`)",
                )
            })?
            .to_ascii_lowercase();
        let mut exempt = Vec::new();
        for (j, e) in k.exempt.iter().enumerate() {
            exempt.push(
                Reason::from_code(e)
                    .filter(|r| r.control() == *r)
                    .ok_or_else(|| {
                        err(
                            format!("{field}.exempt[{j}]"),
                            format!("unknown control {e:?}"),
                        )
                    })?,
            );
        }
        for (j, m) in k.models.iter().flatten().enumerate() {
            if !models.contains_key(m) {
                return Err(err(
                    format!("{field}.models[{j}]"),
                    format!("no upstream serves {m:?}"),
                ));
            }
        }
        if let Some(c) = k.class.as_deref().filter(|c| !classes.has(c)) {
            return Err(err(
                format!("{field}.class"),
                format!("{c:?} is not a class declared in [policy.classes]"),
            ));
        }
        let uses = match k.uses.as_deref() {
            None | Some("proxy") => super::Uses::Proxy,
            Some("reservations") => super::Uses::Reservations,
            Some("both") => super::Uses::Both,
            Some(other) => {
                return Err(err(
                    format!("{field}.uses"),
                    format!("{other:?}: expected \"proxy\", \"reservations\" or \"both\""),
                ));
            }
        };
        let key = KeyConfig {
            uses,
            name: k.name.unwrap_or_else(|| format!("key{i}")),
            key_id: hex[..16].to_owned(),
            tenant: k.tenant,
            user: k.user,
            allow_user: k.allow_user,
            models: k.models,
            exempt,
            class: k.class,
        };
        if keys.insert(hex, key).is_some() {
            return Err(err(format!("{field}.hash"), "the same key twice"));
        }
    }
    Ok(keys)
}
