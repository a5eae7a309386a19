//! A virtual key issued at run time, as the store and the ledger keep it (one JSON record by its
//! id, with a version), its transitions, and what an operator asks for when creating one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::KeyConfig;

/// The longest tenant, user, name, metadata key or value of an issued key, in bytes.
pub const MAX_FIELD_BYTES: usize = 128;
/// The most metadata entries of an issued key.
pub const MAX_METADATA: usize = 32;

/// What an issued key is: its id, its tenant, what it may do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    /// The key's id: its `key` dimension, its name in the admin API. Never the secret.
    pub id: String,
    /// A label.
    pub name: String,
    /// Its tenant.
    pub tenant: String,
    /// A fixed end user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Whether requests may name their end user.
    #[serde(default)]
    pub allow_user: bool,
    /// The models it may use (`None`: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// What it may do: the proxy (default), reservations, or both.
    #[serde(default, skip_serializing_if = "crate::config::Uses::is_proxy")]
    pub uses: crate::config::Uses,
    /// When it was created (ms since the epoch).
    pub created_at_ms: u64,
    /// When it stops working (ms since the epoch); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// The operator's own labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

impl Issued {
    /// The key as the request path reads it.
    pub fn key_config(&self) -> KeyConfig {
        KeyConfig {
            name: self.name.clone(),
            key_id: self.id.clone(),
            tenant: self.tenant.clone(),
            user: self.user.clone(),
            allow_user: self.allow_user,
            models: self.models.clone(),
            exempt: Vec::new(),
            // An issued key is of its tenant's class: a tenant's own token must not raise it.
            class: None,
            uses: self.uses,
        }
    }

    /// Whether it still works at `now_ms`.
    pub fn valid_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|e| now_ms < e)
    }
}

/// `POST /admin/keys`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    /// Its tenant (required).
    pub tenant: String,
    /// A label; default the id.
    pub name: Option<String>,
    /// A fixed end user.
    pub user: Option<String>,
    /// Whether requests may name their end user.
    #[serde(default)]
    pub allow_user: bool,
    /// The models it may use.
    pub models: Option<Vec<String>>,
    /// What it may do: `proxy` (default), `reservations` or `both`.
    #[serde(default)]
    pub uses: crate::config::Uses,
    /// How long it lives, e.g. `30d`; or
    pub expires_in: Option<String>,
    /// when it stops, RFC 3339.
    pub expires_at: Option<String>,
    /// The operator's own labels.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Limits of its own, by control (`requests`, `concurrency`, `budget`, `tool_calls`): each
    /// set for the key's scope of the rule keyed on `key` that holds the control, as
    /// `/admin/limits` sets them.
    #[serde(default)]
    pub limits: BTreeMap<String, serde_json::Value>,
}

/// `POST /admin/keys/{id}/rotate`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rotation {
    /// How long the old secret keeps working, e.g. `1h`; default one hour, `0s` for none.
    pub grace: Option<String>,
    /// The version the rotation is made from (as `GET /admin/keys` shows it): when the key has
    /// another, 409 `key_changed` and nothing changes.
    pub version: Option<u64>,
}

/// A text field of an issued key, checked: not empty, at most [`MAX_FIELD_BYTES`], no control
/// characters.
pub fn field(name: &str, v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Err(format!("{name} is empty"));
    }
    if v.len() > MAX_FIELD_BYTES {
        return Err(format!("{name} is longer than {MAX_FIELD_BYTES} bytes"));
    }
    if v.chars().any(char::is_control) {
        return Err(format!("{name} holds a control character"));
    }
    Ok(())
}
