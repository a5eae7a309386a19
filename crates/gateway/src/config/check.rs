//! What validation adds beyond each field's own shape: URLs read whole (a port that is not a
//! number is an error where it is written, not a connection failure later), and warnings about
//! rules that can never apply to any key the configuration has.

use std::time::Duration;

use super::{ConfigError, GatewayConfig, err};
use tollgate_core::Dimension;

/// `url` at `field`, read whole: a scheme, a host, and a port that is a number when given.
pub(super) fn url(field: &str, url: &str, shown: &str) -> Result<(), ConfigError> {
    let parsed: http::Uri = url
        .parse()
        .map_err(|e| err(field, format!("{shown} is not a URL: {e}")))?;
    let Some(authority) = parsed.authority() else {
        return Err(err(field, format!("{shown} names no host")));
    };
    if authority.host().is_empty() {
        return Err(err(field, format!("{shown} names no host")));
    }
    // After the host (an IPv6 host is in brackets), a colon starts the port.
    let after_host = authority
        .as_str()
        .rsplit_once('@')
        .map_or(authority.as_str(), |(_, h)| h);
    let port = match after_host.rsplit_once(']') {
        Some((_, rest)) => rest.strip_prefix(':'),
        None => after_host.split_once(':').map(|(_, p)| p),
    };
    if let Some(p) = port {
        if p.parse::<u16>().is_err() {
            return Err(err(
                field,
                format!("{shown}: the port {p:?} is not a number from 0 to 65535"),
            ));
        }
    }
    Ok(())
}

/// A Redis reached on a Unix socket (`unix:///run/redis/redis.sock`, optionally `?db=N`): the
/// path must be absolute, so that it names the same socket whatever directory the gateway runs
/// in.
pub(super) fn unix_socket_url(field: &str, url: &str) -> Result<(), ConfigError> {
    let rest = url
        .strip_prefix("unix://")
        .or_else(|| url.strip_prefix("redis+unix://"))
        .unwrap_or(url);
    let path = rest.split_once('?').map_or(rest, |(p, _)| p);
    if !path.starts_with('/') || path.len() < 2 {
        return Err(err(
            field,
            format!("{url:?} names no absolute socket path (unix:///path/to/redis.sock)"),
        ));
    }
    Ok(())
}

/// A Redis that may evict keys (`[store] allow_eviction`) holds nothing whose loss would reopen
/// what it closed: no budget or tool-call budget (an evicted period would be spent again); kill
/// switches are refused at run time (`[[kill]]` entries live in the file, not the store). Rates,
/// token limits and concurrency tolerate a lost key for a window.
pub(super) fn eviction(config: &GatewayConfig) -> Result<(), ConfigError> {
    let super::StoreConfig::Redis {
        allow_eviction: true,
        ..
    } = &config.store
    else {
        return Ok(());
    };
    if let Some(r) = config
        .policy
        .scopes
        .iter()
        .find(|r| r.budget.is_some() || r.tool_calls.is_some())
    {
        return Err(err(
            "store.allow_eviction",
            format!(
                "rule {:?} has a budget, which a Redis that evicts may forget (reopening what \
                 was spent): set Redis's maxmemory-policy to noeviction and remove \
                 allow_eviction, or move budgets to a store that keeps them",
                r.name
            ),
        ));
    }
    Ok(())
}

impl GatewayConfig {
    /// What `check` warns about: rules that can never apply to a request of the keys
    /// configured (keyed on the end user while no key names one; matching a tenant, key or model
    /// that no key or upstream has).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings_with(&[])
    }

    /// The same, counting `issued` too: keys issued at run time, as (tenant, key id, whether
    /// it names an end user).
    pub fn warnings_with(&self, issued: &[(String, String, bool)]) -> Vec<String> {
        let mut out = Vec::new();
        let names_user = self.keys.values().any(|k| k.allow_user || k.user.is_some())
            || issued.iter().any(|(_, _, u)| *u);
        for rule in &self.policy.scopes {
            let name = &*rule.name;
            if rule.dims.contains(&Dimension::User) && !names_user {
                out.push(format!(
                    "rule {name:?} is keyed on user, but no key names an end user \
                     (allow_user = true, or user = \"…\"): it never applies"
                ));
            }
            for (d, v) in &rule.matches {
                let known = match d {
                    Dimension::Tenant => {
                        self.keys.values().any(|k| &k.tenant == v)
                            || issued.iter().any(|(t, _, _)| t == v)
                    }
                    Dimension::Key => {
                        self.keys.values().any(|k| &k.key_id == v)
                            || issued.iter().any(|(_, id, _)| id == v)
                    }
                    Dimension::Model => self.models.contains_key(v),
                    _ => true,
                };
                if !known {
                    out.push(format!(
                        "rule {name:?} matches {} = {v:?}, which no configured or issued key, \
                         nor any upstream, has: it never applies",
                        d.as_str()
                    ));
                }
            }
        }
        out
    }
}

/// A duration written like `250ms` or `2m`, or `default`.
pub(super) fn duration(
    v: &Option<String>,
    default: Duration,
    field: &str,
) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => humantime::parse_duration(s)
            .map_err(|e| err(field, format!("invalid duration {s:?}: {e}"))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::url;

    #[test]
    fn a_rule_met_by_issued_keys_only_is_not_warned_of() {
        let text = "[[upstreams]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n\
                    [[policy.scopes]]\nkey = \"tenant\"\nmatch = { tenant = \"beta\" }\n\
                    requests = { limit = 1, window = \"1m\" }\n";
        let cfg = crate::config::GatewayConfig::from_toml(text).unwrap();
        let w = cfg.warnings();
        assert!(w.len() == 1 && w[0].contains("\"beta\""), "{w:?}");
        let issued = [("beta".to_owned(), "k1".to_owned(), false)];
        assert!(cfg.warnings_with(&issued).is_empty());
        let other = [("gamma".to_owned(), "k2".to_owned(), false)];
        assert_eq!(cfg.warnings_with(&other).len(), 1);
    }

    #[test]
    fn urls_are_read_whole() {
        for ok in [
            "redis://127.0.0.1:6379/0",
            "rediss://user:secret@cache.internal:6380",
            "http://[::1]:8080",
            "postgres://tollgate:pw@db:5432/ledger?sslmode=disable",
            "https://api.openai.com",
        ] {
            assert!(url("f", ok, ok).is_ok(), "{ok}");
        }
        for bad in [
            "redis://127.0.0.1:notaport",
            "http://host:99999",
            "redis://",
            "http://[::1]:x",
            "not a url",
        ] {
            assert!(url("f", bad, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_unix_socket_url_names_an_absolute_path() {
        use super::unix_socket_url;
        for ok in [
            "unix:///run/redis/redis.sock",
            "redis+unix:///tmp/r.sock?db=2",
        ] {
            assert!(unix_socket_url("f", ok).is_ok(), "{ok}");
        }
        for bad in ["unix://", "unix://relative.sock", "redis+unix://./r.sock"] {
            let e = unix_socket_url("f", bad).unwrap_err().to_string();
            assert!(e.contains("absolute socket path"), "{bad}: {e}");
        }
    }
}
