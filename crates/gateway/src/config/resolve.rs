//! The side effects a configuration names, in one step after validation: API keys and the
//! admin token read from the environment or a file, each upstream's client built (its trust
//! anchors and proxy), tokenizer files loaded.

use std::sync::Arc;

use tollgate_tokens::Counting;
use tollgate_tokens::hf::HfTokenizer;

use super::admin::{TokenSource, admin_token};
use super::validate::{Checked, TokenizerSpec};
use super::{ConfigError, GatewayConfig, Upstream, err};
use crate::upstream::{Route, UpstreamClient};

/// The configuration of `checked`, with everything it names outside itself done.
pub(super) fn resolve(checked: Checked) -> Result<GatewayConfig, ConfigError> {
    let Checked {
        mut config,
        upstreams,
        tokenizers,
        admin,
        webhooks,
        records_key_env,
        store_access,
    } = checked;
    resolve_store(&mut config, store_access)?;
    if let Some(var) = records_key_env {
        let key = env(&var, "records.digest_key_env")?;
        if key.len() < 16 {
            return Err(err(
                "records.digest_key_env",
                format!("{var} must hold at least 16 bytes"),
            ));
        }
        config.records_key = Some(std::sync::Arc::from(key.into_bytes()));
    }
    for w in webhooks {
        let url = match w.url {
            Ok(u) => u,
            Err(var) => {
                let text = env(&var, &format!("{}.url_env", w.field))?;
                super::validate::webhook_url(&text)
                    .map_err(|e| err(format!("{}.url_env", w.field), e))?
            }
        };
        let client = UpstreamClient::new(Route::default())
            .map_err(|(name, e)| err(format!("{}.{name}", w.field), e))?;
        config.alerts.webhooks.push(super::Webhook {
            url,
            format: w.format,
            client,
        });
    }
    for u in upstreams {
        let client = UpstreamClient::new(Route {
            ca_file: u.ca_file.as_deref().map(std::path::Path::new),
            proxy: u.proxy.as_deref(),
        })
        .map_err(|(name, e)| err(format!("{}.{name}", u.field), e))?;
        let api_key = match &u.api_key_env {
            Some(var) => Some(env(var, &format!("{}.api_key_env", u.field))?),
            None => None,
        };
        config.upstreams.push(Upstream {
            name: u.name,
            base_url: u.base_url,
            api_key,
            client,
            free_fields: u.free_fields,
        });
    }
    for (model, spec) in tokenizers {
        let counting = match spec {
            TokenizerSpec::Known(c) => c,
            TokenizerSpec::File(file) => Counting::HuggingFace(Arc::new(
                HfTokenizer::from_file(&file)
                    .map_err(|e| err(format!("tokenizers.{model:?}"), e))?,
            )),
        };
        config.counter = config.counter.with_model(model, counting);
    }
    // A degraded request's input was counted for the model it asked for.
    for (i, rule) in config.policy.scopes.iter().enumerate() {
        for (from, to) in rule.degrade.iter().flat_map(|d| &d.models) {
            let (a, b) = (
                config.counter.counting_for(from),
                config.counter.counting_for(to),
            );
            if a.name() != b.name() {
                return Err(err(
                    format!("policy.scopes[{i}].degrade.models.{from}"),
                    format!(
                        "{from:?} counts tokens with {} and {to:?} with {}: a request's input \
                         is counted once, for the model it asks for",
                        a.name(),
                        b.name()
                    ),
                ));
            }
        }
    }
    if let Some(a) = admin {
        let read = |source: &TokenSource, field: &str| match source {
            TokenSource::Env(var) => env(var, &format!("{field}.token_env")),
            TokenSource::File(file) => std::fs::read_to_string(file)
                .map(|t| t.trim().to_owned())
                .map_err(|e| {
                    err(
                        format!("{field}.token_file"),
                        format!("reading {file}: {e}"),
                    )
                }),
        };
        let token = read(&a.token, "admin")?;
        let mut tenants = Vec::with_capacity(a.tenants.len());
        for (i, (tenant, source)) in a.tenants.iter().enumerate() {
            tenants.push((
                tenant.clone(),
                read(source, &format!("admin.tenants[{i}]"))?,
            ));
        }
        config.admin = Some(admin_token(a.listen, token, tenants)?);
    }
    Ok(config)
}

/// The value of environment variable `var`, which `field` names.
/// The Redis's CA file and credentials, and the ledger's URL, read.
fn resolve_store(
    config: &mut GatewayConfig,
    spec: super::stores::AccessSpec,
) -> Result<(), ConfigError> {
    if let super::StoreConfig::Redis { access, .. } = &mut config.store {
        if let Some(path) = &spec.ca_file {
            let pem =
                std::fs::read(path).map_err(|e| err("store.ca_file", format!("{path}: {e}")))?;
            if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
                return Err(err(
                    "store.ca_file",
                    format!("{path}: no PEM certificate in it"),
                ));
            }
            access.ca_pem = Some(pem);
        }
        if let Some(var) = &spec.username_env {
            access.username = Some(env(var, "store.username_env")?);
        }
        if let Some(var) = &spec.password_env {
            access.password = Some(env(var, "store.password_env")?);
        }
    }
    if let Some(l) = &mut config.ledger {
        if let Err(var) = &l.url {
            let url = env(var, "ledger.url_env")?;
            if let Err(e) = tollgate_ledger::check_url(&url) {
                return Err(err(
                    "ledger.url_env",
                    format!("{var} must hold a postgres://… URL: {e}"),
                ));
            }
            l.url = Ok(url);
        }
    }
    Ok(())
}

fn env(var: &str, field: &str) -> Result<String, ConfigError> {
    std::env::var(var).map_err(|_| err(field, format!("environment variable {var} is not set")))
}

#[cfg(test)]
#[allow(clippy::panic)]
mod tests {
    use super::super::validate::check;
    use super::*;

    /// Validation reads nothing outside the file: a missing variable and a missing tokenizer
    /// file pass it, and resolving names each field.
    #[test]
    fn validation_is_pure_and_resolving_names_the_field() {
        let text = |extra: &str| {
            format!(
                "[[upstreams]]\nname = \"u\"\nbase_url = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n\
                 {extra}"
            )
        };
        let var = "TOLLGATE_TEST_SURELY_UNSET_VARIABLE";
        let cases = [
            (
                text(&format!("api_key_env = \"{var}\"\n")),
                "upstreams[0].api_key_env",
            ),
            (
                text("[tokenizers]\nm = \"/nonexistent/tokenizer.json\"\n"),
                "tokenizers.\"m\"",
            ),
            (
                text(&format!(
                    "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"{var}\"\n"
                )),
                "admin.token_env",
            ),
            (
                text(&format!("[records]\ndigest_key_env = \"{var}\"\n")),
                "records.digest_key_env",
            ),
            (
                text(&format!("[[alerts.webhooks]]\nurl_env = \"{var}\"\n")),
                "alerts.webhooks[0].url_env",
            ),
        ];
        for (toml_text, field) in cases {
            let raw = toml::from_str(&toml_text).unwrap_or_else(|e| panic!("{e}"));
            let checked = check(raw).unwrap_or_else(|e| panic!("{e}"));
            let e = resolve(checked).err().unwrap_or_else(|| panic!("{field}"));
            assert_eq!(e.path, field, "{e}");
        }
    }
}
