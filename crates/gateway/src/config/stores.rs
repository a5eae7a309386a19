//! `[store]` and `[ledger]`, checked: where counters live, how a Redis is reached (TLS, ACL
//! user and password, never shown), and the spend ledger.

use std::time::Duration;

use super::check::duration;
use super::{ConfigError, RawLedger, RawStore, RedisAccess, StoreConfig, err};

/// What `[store]` names outside the file: read when resolved.
#[derive(Debug, Default)]
pub(super) struct AccessSpec {
    pub ca_file: Option<String>,
    pub username_env: Option<String>,
    pub password_env: Option<String>,
}

/// The Redis's CA file and credential variables; a CA file only for `rediss://`.
pub(super) fn access(raw: &RawStore) -> Result<AccessSpec, ConfigError> {
    let tls = raw
        .url
        .as_deref()
        .is_some_and(|u| u.starts_with("rediss://"))
        || raw
            .cluster
            .as_ref()
            .is_some_and(|n| n.iter().all(|u| u.starts_with("rediss://")));
    if raw.ca_file.is_some() && !tls {
        return Err(err(
            "store.ca_file",
            "a CA file is for TLS: give a rediss://… URL (or cluster nodes)",
        ));
    }
    if let Some(nodes) = &raw.cluster {
        let schemes: std::collections::BTreeSet<bool> =
            nodes.iter().map(|u| u.starts_with("rediss://")).collect();
        if schemes.len() > 1 {
            return Err(err(
                "store.cluster",
                "every node takes the same scheme: all redis:// or all rediss://",
            ));
        }
    }
    Ok(AccessSpec {
        ca_file: raw.ca_file.clone(),
        username_env: raw.username_env.clone(),
        password_env: raw.password_env.clone(),
    })
}

pub(super) fn store(raw: &RawStore) -> Result<StoreConfig, ConfigError> {
    let shards = match raw.shards {
        None => 1,
        Some(n @ 1..=1024) => n,
        Some(n) => {
            return Err(err(
                "store.shards",
                format!("{n} shards: give 1 to 1024 (every instance the same number)"),
            ));
        }
    };
    let retention = duration(&raw.retention, Duration::from_secs(3600), "store.retention")?;
    if retention < Duration::from_secs(1) {
        return Err(err(
            "store.retention",
            "at least 1s: a settlement may arrive after the request's last byte",
        ));
    }
    let prefix = raw.prefix.clone().unwrap_or_else(|| "tollgate".into());
    let call_timeout = duration(
        &raw.call_timeout,
        Duration::from_millis(250),
        "store.call_timeout",
    )?;
    // Slices are on for Redis unless turned off: the fast path is the default.
    let asked = raw
        .slices
        .as_ref()
        .is_some_and(|s| s.enabled != Some(false));
    let slices = match &raw.slices {
        Some(s) if s.enabled == Some(false) => None,
        Some(s) => Some(Box::new(slices(s)?)),
        None => Some(Box::new(slices(&super::RawSlices::default())?)),
    };
    let redis = |url: String, cluster| StoreConfig::Redis {
        url,
        prefix: prefix.clone(),
        call_timeout,
        cluster,
        shards,
        retention,
        allow_eviction: raw.allow_eviction,
        access: RedisAccess::default(),
        slices,
    };
    for (i, node) in raw.cluster.iter().flatten().enumerate() {
        let shown = tollgate_core::store::redacted(node);
        super::check::url(&format!("store.cluster[{i}]"), node, &shown)?;
    }
    match raw.url.as_deref() {
        None | Some("memory") if raw.cluster.is_some() => {
            Ok(redis(String::new(), raw.cluster.clone()))
        }
        None | Some("memory") if asked => Err(err(
            "store.slices",
            "slices are leased from a store that instances share: configure Redis",
        )),
        None | Some("memory") => Ok(StoreConfig::Memory { retention }),
        Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
            super::check::url("store.url", url, &tollgate_core::store::redacted(url))?;
            Ok(redis(url.to_owned(), None))
        }
        Some(url) if url.starts_with("unix://") || url.starts_with("redis+unix://") => {
            super::check::unix_socket_url("store.url", url)?;
            Ok(redis(url.to_owned(), None))
        }
        Some(other) => Err(err(
            "store.url",
            format!(
                "expected \"memory\", redis://…, rediss://… or unix:///path/to/redis.sock, got {:?}",
                tollgate_core::store::redacted(other)
            ),
        )),
    }
}

/// `[store.slices]`, checked.
fn slices(raw: &super::RawSlices) -> Result<tollgate_slices::SliceConfig, ConfigError> {
    let d = tollgate_slices::SliceConfig::default();
    let ms = |v: &Option<String>, default: u64, field: &str, min: u64, max: u64| {
        let t = duration(v, Duration::from_millis(default), field)?;
        let t = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
        if (min..=max).contains(&t) {
            Ok(t)
        } else {
            Err(err(field, format!("give {min}ms to {max}ms")))
        }
    };
    let hot_after = raw.hot_after.unwrap_or(d.hot_after);
    if hot_after > 1_000_000 {
        return Err(err("store.slices.hot_after", "give 0 to 1000000"));
    }
    let divisor = raw.divisor.unwrap_or(d.divisor);
    if !(1..=1024).contains(&divisor) {
        return Err(err("store.slices.divisor", "give 1 to 1024"));
    }
    let kill_bound_ms = ms(
        &raw.kill_bound,
        d.kill_bound_ms,
        "store.slices.kill_bound",
        10,
        60_000,
    )?;
    let tick_ms = ms(&raw.tick, d.tick_ms, "store.slices.tick", 10, 10_000)?;
    if tick_ms >= kill_bound_ms {
        return Err(err(
            "store.slices.tick",
            "shorter than kill_bound: each tick reads the kill switches",
        ));
    }
    let ttl_ms = match &raw.ttl {
        None => None,
        Some(_) => Some(ms(&raw.ttl, 0, "store.slices.ttl", 1_000, 86_400_000)?),
    };
    Ok(tollgate_slices::SliceConfig {
        hot_after,
        divisor,
        ttl_ms,
        kill_bound_ms,
        tick_ms,
        ..d
    })
}

/// `[ledger]`: the URL (or the variable holding it, read when resolved) and the buffer.
pub(super) fn ledger(raw: &RawLedger) -> Result<super::LedgerConfig, ConfigError> {
    let url = match (&raw.url, &raw.url_env) {
        (Some(u), None) => Ok(u.clone()),
        (None, Some(var)) => Err(var.clone()),
        _ => return Err(err("ledger.url", "give url or url_env, one of them")),
    };
    if let Ok(u) = &url {
        // Read as the ledger's client reads it (a socket's directory is a host there).
        tollgate_ledger::check_url(u)
            .map_err(|e| err("ledger.url", format!("the ledger's URL: {e}")))?;
    }
    let n = |v: Option<usize>, default: usize, max: usize, field: &str| match v {
        None => Ok(default),
        Some(n) if (1..=max).contains(&n) => Ok(n),
        Some(n) => Err(err(field, format!("{n}: give 1 to {max}"))),
    };
    let flush_every = duration(
        &raw.flush_every,
        Duration::from_millis(200),
        "ledger.flush_every",
    )?;
    if !(Duration::from_millis(10)..=Duration::from_secs(60)).contains(&flush_every) {
        return Err(err("ledger.flush_every", "give 10ms to 60s"));
    }
    let on_full = match raw.on_full.as_deref() {
        None | Some("refuse") => tollgate_ledger::OnFull::Refuse,
        Some("drop") => tollgate_ledger::OnFull::Drop,
        Some(other) => {
            return Err(err(
                "ledger.on_full",
                format!("expected \"refuse\" or \"drop\", got {other:?}"),
            ));
        }
    };
    let spool = std::path::PathBuf::from(
        raw.spool
            .clone()
            .unwrap_or_else(|| "tollgate-ledger.spool".to_owned()),
    );
    if spool.as_os_str().is_empty() {
        return Err(err("ledger.spool", "give a file"));
    }
    Ok(super::LedgerConfig {
        spool,
        url,
        buffer: n(raw.buffer, 100_000, 10_000_000, "ledger.buffer")?,
        batch: n(raw.batch, 1000, 10_000, "ledger.batch")?,
        flush_every,
        on_full,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use crate::config::{GatewayConfig, StoreConfig};

    fn err_of(text: &str) -> String {
        match GatewayConfig::from_toml(text) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted: {text}"),
        }
    }

    /// A managed Redis's TLS URL (as Upstash gives it) is taken; a bad one is refused without
    /// showing its password.
    #[test]
    fn rediss_urls_and_their_secrets() {
        let c = GatewayConfig::from_toml(
            "[store]\nurl = \"rediss://default:AbCd1234@eu1-fine-cat-12345.upstash.io:6379\"\n",
        )
        .unwrap();
        assert!(
            matches!(c.store, StoreConfig::Redis { ref url, .. } if url.starts_with("rediss://"))
        );
        let e = err_of("[store]\nurl = \"redis+tls://default:AbCd1234@host:6379\"\n");
        assert!(
            e.starts_with("store.url:") && !e.contains("AbCd1234"),
            "{e}"
        );
        let e = err_of("[store]\nurl = \"redis://h:6379\"\nca_file = \"/etc/ca.pem\"\n");
        assert!(e.starts_with("store.ca_file:"), "{e}");
        let e = err_of(
            "[store]\nurl = \"rediss://h:6379\"\npassword_env = \"TOLLGATE_TEST_UNSET_VAR\"\n",
        );
        assert!(e.starts_with("store.password_env:"), "{e}");
    }

    #[test]
    fn ledger_settings_are_checked() {
        let c = GatewayConfig::from_toml("[ledger]\nurl = \"postgres://u@h/db\"\n").unwrap();
        let l = c.ledger.unwrap();
        assert_eq!(
            (l.buffer, l.batch, l.on_full),
            (100_000, 1000, tollgate_ledger::OnFull::Refuse)
        );
        assert!(err_of("[ledger]\nurl = \"mysql://h\"\n").starts_with("ledger.url:"));
        assert!(err_of("[ledger]\n").starts_with("ledger.url:"));
        assert!(
            err_of("[ledger]\nurl = \"postgres://h\"\non_full = \"block\"\n")
                .starts_with("ledger.on_full:")
        );
        assert!(
            err_of("[ledger]\nurl = \"postgres://h\"\nbuffer = 0\n").starts_with("ledger.buffer:")
        );
    }

    /// `[store.slices]`: defaults, settings, and what cannot be: slices of a store no other
    /// instance shares, a tick that would leave the kill switches older than their bound.
    #[test]
    fn slice_settings_are_checked() {
        let redis = "[store]\nurl = \"redis://h:6379\"\n[store.slices]\n";
        let c = GatewayConfig::from_toml(redis).unwrap();
        let StoreConfig::Redis {
            slices: Some(s), ..
        } = c.store
        else {
            panic!("no slices");
        };
        assert_eq!(*s, tollgate_slices::SliceConfig::default());
        let c = GatewayConfig::from_toml(&format!(
            "{redis}hot_after = 0\ndivisor = 8\nkill_bound = \"500ms\"\ntick = \"50ms\"\nttl = \"30s\"\n"
        ))
        .unwrap();
        let StoreConfig::Redis {
            slices: Some(s), ..
        } = c.store
        else {
            panic!("no slices");
        };
        assert_eq!(
            (s.hot_after, s.divisor, s.kill_bound_ms, s.tick_ms, s.ttl_ms),
            (0, 8, 500, 50, Some(30_000))
        );
        assert!(err_of("[store.slices]\n").starts_with("store.slices:"));
        // On by default for Redis; off when turned off, which a memory store also takes.
        let on = GatewayConfig::from_toml("[store]\nurl = \"redis://h:6379\"\n").unwrap();
        assert!(matches!(
            on.store,
            StoreConfig::Redis {
                slices: Some(_),
                ..
            }
        ));
        let off = GatewayConfig::from_toml(&format!("{redis}enabled = false\n")).unwrap();
        assert!(matches!(off.store, StoreConfig::Redis { slices: None, .. }));
        let memory = "[store]\nurl = \"memory\"\n[store.slices]\nenabled = false\n";
        assert!(matches!(
            GatewayConfig::from_toml(memory).unwrap().store,
            StoreConfig::Memory { .. }
        ));
        assert!(err_of(&format!("{redis}divisor = 0\n")).starts_with("store.slices.divisor:"));
        assert!(err_of(&format!("{redis}tick = \"2s\"\n")).starts_with("store.slices.tick:"));
        assert!(err_of(&format!("{redis}ttl = \"10ms\"\n")).starts_with("store.slices.ttl:"));
        assert!(err_of(&format!("{redis}shards = 2\n")).contains("unknown field"));
    }
}
