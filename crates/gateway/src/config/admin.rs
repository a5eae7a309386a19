//! `[admin]`, checked: where the admin API listens and where its tokens are read from (the
//! operator's, and one per tenant that manages its own keys and limits); then, once read, the
//! tokens themselves.

use std::net::SocketAddr;

use super::raw::RawAdmin;
use super::{AdminConfig, ConfigError, err};

/// The admin API, checked: where it listens and where its token is.
pub(crate) struct AdminSpec {
    pub listen: SocketAddr,
    pub token: TokenSource,
    /// Tokens of one tenant each: (tenant, where the token is read from).
    pub tenants: Vec<(String, TokenSource)>,
}

/// Where the admin token is read from.
pub(crate) enum TokenSource {
    Env(String),
    File(String),
}

pub(super) fn admin(a: &RawAdmin) -> Result<AdminSpec, ConfigError> {
    let token = match (&a.token_env, &a.token_file) {
        (Some(var), None) => TokenSource::Env(var.clone()),
        (None, Some(file)) => TokenSource::File(file.clone()),
        _ => return Err(err("admin", "give exactly one of token_env or token_file")),
    };
    let listen = a
        .listen
        .parse()
        .map_err(|e| err("admin.listen", format!("{e}")))?;
    let mut tenants = Vec::with_capacity(a.tenants.len());
    for (i, t) in a.tenants.iter().enumerate() {
        let field = format!("admin.tenants[{i}]");
        if t.tenant.is_empty() {
            return Err(err(format!("{field}.tenant"), "empty"));
        }
        let source = match (&t.token_env, &t.token_file) {
            (Some(var), None) => TokenSource::Env(var.clone()),
            (None, Some(file)) => TokenSource::File(file.clone()),
            _ => return Err(err(field, "give exactly one of token_env or token_file")),
        };
        tenants.push((t.tenant.clone(), source));
    }
    Ok(AdminSpec {
        listen,
        token,
        tenants,
    })
}

/// The admin API with its token read: at least 16 characters.
pub(super) fn admin_token(
    listen: SocketAddr,
    token: String,
    tenants: Vec<(String, String)>,
) -> Result<AdminConfig, ConfigError> {
    if token.len() < 16 {
        return Err(err(
            "admin",
            "the admin token must be at least 16 characters",
        ));
    }
    for (i, (_, t)) in tenants.iter().enumerate() {
        let field = format!("admin.tenants[{i}]");
        if t.len() < 16 {
            return Err(err(
                field,
                "a tenant's token must be at least 16 characters",
            ));
        }
        if *t == token || tenants[..i].iter().any(|(_, u)| u == t) {
            return Err(err(
                field,
                "the same token as another: each token is its own",
            ));
        }
    }
    Ok(AdminConfig {
        listen,
        token,
        tenants,
    })
}
