//! `[otlp]`: OpenTelemetry export (OTLP over gRPC or HTTP) of the GenAI metrics, Tollgate's
//! admission metrics and one span per request. Off unless the section is present.

use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// `[otlp]`
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawOtlp {
    /// The collector: `http://127.0.0.1:4317` for gRPC; for HTTP its base, `/v1/metrics` and
    /// `/v1/traces` added (`http://127.0.0.1:4318`).
    pub endpoint: Option<String>,
    /// `grpc` (default) or `http/protobuf`.
    pub protocol: Option<String>,
    /// How often metrics are exported (default `10s`, from 100 ms to 1 h).
    pub interval: Option<String>,
    /// Also export the newer `gen_ai.client.inference.usage.*` counters (default false).
    #[serde(default)]
    pub inference_usage: bool,
    /// `service.name` of the resource (default `tollgate`).
    pub service_name: Option<String>,
}

/// How the export reaches its collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC.
    Grpc,
    /// OTLP/HTTP with protobuf bodies.
    HttpProtobuf,
}

/// `[otlp]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpConfig {
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    pub interval: Duration,
    pub inference_usage: bool,
    pub service_name: String,
}

/// `[otlp]`, checked: `None` when absent.
pub(super) fn otlp(raw: Option<&RawOtlp>) -> Result<Option<OtlpConfig>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let protocol = match raw.protocol.as_deref() {
        None | Some("grpc") => OtlpProtocol::Grpc,
        Some("http/protobuf") => OtlpProtocol::HttpProtobuf,
        Some(other) => {
            return Err(super::err(
                "otlp.protocol",
                format!("unknown protocol {other:?}; expected \"grpc\" or \"http/protobuf\""),
            ));
        }
    };
    let endpoint = match (&raw.endpoint, protocol) {
        (Some(e), _) => e.trim_end_matches('/').to_owned(),
        (None, OtlpProtocol::Grpc) => "http://127.0.0.1:4317".to_owned(),
        (None, OtlpProtocol::HttpProtobuf) => "http://127.0.0.1:4318".to_owned(),
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(super::err(
            "otlp.endpoint",
            "expected an http:// or https:// URL of the collector",
        ));
    }
    let interval = super::check::duration(&raw.interval, Duration::from_secs(10), "otlp.interval")?;
    if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&interval) {
        return Err(super::err("otlp.interval", "must be from 100ms to 1 hour"));
    }
    let service_name = raw
        .service_name
        .clone()
        .unwrap_or_else(|| "tollgate".to_owned());
    Ok(Some(OtlpConfig {
        endpoint,
        protocol,
        interval,
        inference_usage: raw.inference_usage,
        service_name,
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<OtlpConfig>, ConfigError> {
        let raw: RawOtlp = toml::from_str(text).unwrap();
        otlp(Some(&raw))
    }

    #[test]
    fn absent_is_off_and_each_protocol_has_its_default_port() {
        assert_eq!(otlp(None).unwrap(), None);
        let grpc = parse("").unwrap().unwrap();
        assert_eq!(
            (grpc.endpoint.as_str(), grpc.protocol, grpc.interval),
            (
                "http://127.0.0.1:4317",
                OtlpProtocol::Grpc,
                Duration::from_secs(10)
            )
        );
        let http = parse("protocol = \"http/protobuf\"").unwrap().unwrap();
        assert_eq!(http.endpoint, "http://127.0.0.1:4318");
        assert_eq!(http.service_name, "tollgate");
    }

    #[test]
    fn what_it_cannot_use_is_refused_by_field() {
        for (text, field) in [
            ("protocol = \"http/json\"", "otlp.protocol"),
            ("endpoint = \"collector:4317\"", "otlp.endpoint"),
            ("interval = \"1ms\"", "otlp.interval"),
            ("interval = \"soon\"", "otlp.interval"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text}: {e}");
        }
    }
}
