//! Who a request is: the identity dimensions, and the scope keys a policy rule derives from them.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

/// One dimension of a request's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dimension {
    /// The tenant (organisation, project) the API key belongs to.
    Tenant,
    /// The API key, as its hash (never the key itself).
    Key,
    /// The end user.
    User,
    /// The client IP address or prefix.
    Ip,
    /// The model requested.
    Model,
    /// An agent operation: the client-chosen id of one user action's model rounds and tool
    /// calls (a header), always inside its key's tenant.
    Operation,
}

impl Dimension {
    /// All dimensions in their canonical order (the order in scope keys).
    pub const ALL: [Dimension; 6] = [
        Dimension::Tenant,
        Dimension::Key,
        Dimension::User,
        Dimension::Ip,
        Dimension::Model,
        Dimension::Operation,
    ];

    /// The name used in policies and scope keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Tenant => "tenant",
            Dimension::Key => "key",
            Dimension::User => "user",
            Dimension::Ip => "ip",
            Dimension::Model => "model",
            Dimension::Operation => "operation",
        }
    }

    /// Parses a dimension name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.as_str() == s)
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The identity of one request: a value per dimension where known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Tenant id.
    pub tenant: Option<String>,
    /// API key hash.
    pub key: Option<String>,
    /// End-user id.
    pub user: Option<String>,
    /// Client IP (or prefix).
    pub ip: Option<String>,
    /// Model name.
    pub model: Option<String>,
    /// Agent operation id.
    pub operation: Option<String>,
}

impl Identity {
    /// The value of one dimension.
    pub fn get(&self, d: Dimension) -> Option<&str> {
        match d {
            Dimension::Tenant => self.tenant.as_deref(),
            Dimension::Key => self.key.as_deref(),
            Dimension::User => self.user.as_deref(),
            Dimension::Ip => self.ip.as_deref(),
            Dimension::Model => self.model.as_deref(),
            Dimension::Operation => self.operation.as_deref(),
        }
    }

    /// A builder-style setter.
    #[must_use]
    pub fn with(mut self, d: Dimension, value: impl Into<String>) -> Self {
        let v = Some(value.into());
        match d {
            Dimension::Tenant => self.tenant = v,
            Dimension::Key => self.key = v,
            Dimension::User => self.user = v,
            Dimension::Ip => self.ip = v,
            Dimension::Model => self.model = v,
            Dimension::Operation => self.operation = v,
        }
        self
    }
}

/// How many leading bits of a client address make one `ip` scope: by default each IPv4 address
/// is its own scope and IPv6 addresses are grouped by /64, the block one subscriber is usually
/// given (a client holding a /64 would otherwise have 2^64 fresh scopes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpPrefix {
    /// Prefix length for IPv4 addresses, 1 to 32.
    pub v4: u8,
    /// Prefix length for IPv6 addresses, 1 to 128.
    pub v6: u8,
}

impl Default for IpPrefix {
    fn default() -> Self {
        Self { v4: 32, v6: 64 }
    }
}

impl IpPrefix {
    /// The network `ip` falls in, written as the address (a whole one) or `network/len`.
    pub fn network(self, ip: std::net::IpAddr) -> String {
        use std::net::IpAddr;
        match ip {
            IpAddr::V4(a) => {
                let len = self.v4.min(32);
                let bits = u32::from(a) & u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
                let net = std::net::Ipv4Addr::from(bits);
                if len == 32 {
                    net.to_string()
                } else {
                    format!("{net}/{len}")
                }
            }
            IpAddr::V6(a) => {
                // An IPv4 client seen through a dual-stack socket is an IPv4 client.
                if let Some(v4) = a.to_ipv4_mapped() {
                    return self.network(IpAddr::V4(v4));
                }
                let len = self.v6.min(128);
                let bits = u128::from(a) & u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
                let net = std::net::Ipv6Addr::from(bits);
                if len == 128 {
                    net.to_string()
                } else {
                    format!("{net}/{len}")
                }
            }
        }
    }
}

/// A scope a request belongs to under one policy rule, e.g. rule `per-user`, key `user:alice`.
///
/// [`ScopeKey::id`] is the storage identity (`rule|key`): two rules over the same dimensions keep
/// separate counters. Values are escaped so that no user-supplied id can forge another scope's
/// key or a Redis hash tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeKey {
    // Shared: a key is cloned into quotas, tickets and map keys on every admission.
    id: Arc<str>,
    rule_len: usize,
    /// Where the scope as shown ends: before a [`ScopeKey::child`]'s tag.
    key_end: usize,
}

impl ScopeKey {
    /// Builds the key of `rule` over `dims` for `identity`; `None` when a dimension is unknown.
    pub fn derive(rule: &str, dims: &[Dimension], identity: &Identity) -> Option<Self> {
        Self::derive_in(rule, dims, identity, IpPrefix::default())
    }

    /// [`ScopeKey::derive`] with the rule's own grouping of client addresses.
    pub fn derive_in(
        rule: &str,
        dims: &[Dimension],
        identity: &Identity,
        ip_prefix: IpPrefix,
    ) -> Option<Self> {
        // Built in a buffer kept per thread, then copied once into the shared id: one
        // allocation per key instead of two (a `String`, then the `Arc`).
        thread_local! {
            static BUF: RefCell<String> = const { RefCell::new(String::new()) };
        }
        BUF.with(|buf| match buf.try_borrow_mut() {
            Ok(mut buf) => {
                let key = Self::build(&mut buf, rule, dims, identity, ip_prefix);
                if buf.capacity() > 4096 {
                    *buf = String::new(); // one huge id does not stay held by the thread
                }
                key
            }
            Err(_) => Self::build(&mut String::new(), rule, dims, identity, ip_prefix),
        })
    }

    fn build(
        id: &mut String,
        rule: &str,
        dims: &[Dimension],
        identity: &Identity,
        ip_prefix: IpPrefix,
    ) -> Option<Self> {
        id.clear();
        id.push_str(rule);
        id.push('|');
        if dims.is_empty() {
            id.push_str("global");
        }
        // An end user and an operation are named by the client, so their scopes are always
        // inside their tenant where one is known: two tenants' `alice` are two scopes.
        let mut first = true;
        let chosen = dims.contains(&Dimension::User) || dims.contains(&Dimension::Operation);
        if chosen && !dims.contains(&Dimension::Tenant) {
            if let Some(t) = identity.tenant.as_deref() {
                id.push_str("tenant:");
                escape_into(t, id);
                first = false;
            }
        }
        for d in dims {
            if !std::mem::take(&mut first) {
                id.push('/');
            }
            id.push_str(d.as_str());
            id.push(':');
            let value = identity.get(*d)?;
            // Only an `ip` value is parsed (a scope key is derived on every request). The
            // network is written from a parsed address: only hex digits, '.', ':' and '/', so
            // it needs no escaping, and no escaped value (which holds neither ':' nor '/', and
            // would itself have parsed if it were an IPv4 address) equals it.
            let ip = (*d == Dimension::Ip)
                .then(|| value.parse::<std::net::IpAddr>().ok())
                .flatten();
            match ip {
                Some(ip) => id.push_str(&ip_prefix.network(ip)),
                None => escape_into(value, id),
            }
        }
        Some(Self {
            id: Arc::from(id.as_str()),
            rule_len: rule.len(),
            key_end: id.len(),
        })
    }

    /// This scope's key under another rule, `rule|key`: what [`ScopeKey::derive_in`] makes for
    /// a rule with the same dimensions and address grouping, copied instead of derived again
    /// (its values are escaped once). A child's tag is not carried over.
    pub fn renamed(&self, rule: &str) -> Self {
        let key = self.id.get(self.rule_len..self.key_end).unwrap_or_default();
        let mut id = String::with_capacity(rule.len() + key.len());
        id.push_str(rule);
        id.push_str(key);
        Self {
            key_end: id.len(),
            id: Arc::from(id),
            rule_len: rule.len(),
        }
    }

    /// A counter of its own inside this scope, `rule|key?tag`: a rule's tool calls beside its
    /// budget, or one request's repeats. No value or rule name holds a `?` (values escape it),
    /// so no scope's id equals a child's. Shown as its parent.
    pub fn child(&self, tag: &str) -> Self {
        let mut id = String::with_capacity(self.id.len() + 1 + tag.len());
        id.push_str(&self.id);
        id.push('?');
        id.push_str(tag);
        Self {
            id: Arc::from(id),
            rule_len: self.rule_len,
            key_end: self.key_end,
        }
    }

    /// The storage identity, `rule|key`.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// The storage identity, shared.
    pub fn shared_id(&self) -> &Arc<str> {
        &self.id
    }
    /// The policy rule's name.
    pub fn rule(&self) -> &str {
        &self.id[..self.rule_len]
    }
    /// The scope as shown to people, e.g. `tenant:acme/model:gpt-4o` or `global`.
    pub fn key(&self) -> &str {
        self.id
            .get(self.rule_len + 1..self.key_end)
            .unwrap_or_default()
    }
}

impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// Percent-escapes the characters that structure a scope key or a Redis key, control
/// characters and `?`: injective, so two different values never share a scope.
fn escape_into(value: &str, out: &mut String) {
    let escaped = |c: char| c.is_control() || matches!(c, '%' | '/' | ':' | '|' | '{' | '}' | '?');
    // Most values are plain ASCII with nothing to escape: copied whole, since char by char is
    // a large part of a plan's cost.
    if value
        .bytes()
        .all(|b| b.is_ascii() && !escaped(char::from(b)))
    {
        out.push_str(value);
        return;
    }
    for c in value.chars() {
        if escaped(c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push('%');
                out.push(char::from(HEX[usize::from(b >> 4)]));
                out.push(char::from(HEX[usize::from(b & 0xf)]));
            }
        } else {
            out.push(c);
        }
    }
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

#[cfg(test)]
mod tests;
