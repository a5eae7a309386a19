//! OpenTelemetry export: a receiver built from the OTLP protobufs (gRPC services and the HTTP
//! routes) takes what the gateway exports, and the GenAI metrics' names, units, attributes and
//! bucket boundaries are those of the semantic conventions; one span per request, a refused
//! request's with `error.type`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::instance::{Instance, sim};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric};
use opentelemetry_proto::tonic::trace::v1::{Span, span};
use prost::Message;
use serde_json::json;

/// What the receiver was sent.
#[derive(Clone, Default)]
struct Received {
    metrics: Arc<Mutex<Vec<Metric>>>,
    spans: Arc<Mutex<Vec<Span>>>,
}

impl Received {
    fn take_metrics(&self, r: ExportMetricsServiceRequest) {
        let mut m = self.metrics.lock().unwrap();
        for rm in r.resource_metrics {
            for sm in rm.scope_metrics {
                m.extend(sm.metrics);
            }
        }
    }

    fn take_spans(&self, r: ExportTraceServiceRequest) {
        let mut s = self.spans.lock().unwrap();
        for rs in r.resource_spans {
            for ss in rs.scope_spans {
                s.extend(ss.spans);
            }
        }
    }

    /// The last export of each metric, by name.
    fn metrics(&self) -> BTreeMap<String, Metric> {
        let mut out = BTreeMap::new();
        for m in self.metrics.lock().unwrap().iter() {
            out.insert(m.name.clone(), m.clone());
        }
        out
    }
}

#[tonic::async_trait]
impl MetricsService for Received {
    async fn export(
        &self,
        r: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.take_metrics(r.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take_spans(r.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC receiver on a free loopback port: its endpoint.
async fn grpc_receiver(received: &Received) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tonic::transport::Server::builder()
        .add_service(MetricsServiceServer::new(received.clone()))
        .add_service(TraceServiceServer::new(received.clone()))
        .serve_with_incoming(incoming);
    tokio::spawn(server);
    format!("http://{addr}")
}

/// An OTLP/HTTP receiver (protobuf bodies) on a free loopback port: its base URL.
async fn http_receiver(received: &Received) -> String {
    use axum::routing::post;
    let (m, t) = (received.clone(), received.clone());
    let app = axum::Router::new()
        .route(
            "/v1/metrics",
            post(move |body: bytes::Bytes| async move {
                m.take_metrics(ExportMetricsServiceRequest::decode(body).unwrap());
                ExportMetricsServiceResponse::default().encode_to_vec()
            }),
        )
        .route(
            "/v1/traces",
            post(move |body: bytes::Bytes| async move {
                t.take_spans(ExportTraceServiceRequest::decode(body).unwrap());
                ExportTraceServiceResponse::default().encode_to_vec()
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v: &AnyValue| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// The conventions' boundaries of `gen_ai.client.token.usage`: 1 to 4^13, times 4.
fn token_buckets() -> Vec<f64> {
    (0..14).map(|i| 4f64.powi(i)).collect()
}

/// The conventions' boundaries of the client's durations: 10 ms to 81.92 s, times 2.
fn seconds_buckets() -> Vec<f64> {
    (0..14).map(|i| 0.01 * 2f64.powi(i)).collect()
}

/// A histogram's data points' attributes and its boundaries, after checking its unit.
fn histogram(m: &Metric, unit: &str, bounds: &[f64]) -> Vec<BTreeMap<String, String>> {
    assert_eq!(m.unit, unit, "{}", m.name);
    let Some(metric::Data::Histogram(h)) = &m.data else {
        panic!("{} is not a histogram: {:?}", m.name, m.data);
    };
    h.data_points
        .iter()
        .map(|p| {
            assert_eq!(p.explicit_bounds, bounds, "{}", m.name);
            assert!(p.count > 0, "{}", m.name);
            attrs(&p.attributes)
        })
        .collect()
}

fn counter(m: &Metric, unit: &str) -> Vec<(BTreeMap<String, String>, u64)> {
    assert_eq!(m.unit, unit, "{}", m.name);
    let Some(metric::Data::Sum(s)) = &m.data else {
        panic!("{} is not a sum: {:?}", m.name, m.data);
    };
    assert!(s.is_monotonic, "{}", m.name);
    s.data_points
        .iter()
        .map(|p| {
            let v = match p.value {
                Some(opentelemetry_proto::tonic::metrics::v1::number_data_point::Value::AsInt(
                    i,
                )) => u64::try_from(i).unwrap(),
                other => panic!("{other:?}"),
            };
            (attrs(&p.attributes), v)
        })
        .collect()
}

const SCOPES: &str = "[[policy.scopes]]\nname = \"tenant\"\nkey = \"tenant\"\n\
    budget = { tokens = 150, period = \"day\" }\n";

/// Requests through an instance exporting to `endpoint` over `protocol`: a whole answer, a
/// stream, then refusals once the budget is spent; what arrives is checked.
async fn exports_what_the_conventions_name(protocol: &str, received: Received, endpoint: String) {
    let sim = sim().await;
    let text = format!(
        "[otlp]\nendpoint = \"{endpoint}\"\nprotocol = \"{protocol}\"\ninterval = \"200ms\"\n\
         inference_usage = true\n"
    );
    let on = Instance::start_with(&sim, &text, SCOPES).await;
    assert_eq!(on.ask("acme").await.0, 200);
    let stream = json!({"model": "gpt-4o", "max_tokens": 20, "stream": true,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}]});
    let r = common::post(
        on.addr,
        "/v1/chat/completions",
        &[("authorization", "Bearer sk-acme".to_owned())],
        stream.to_string(),
    )
    .await;
    assert_eq!(r.status, 200);
    let mut more = 0;
    while on.ask("acme").await.0 == 200 {
        more += 1;
        assert!(more < 20, "the budget never refused");
    }
    on.stop().await;
    let wanted = [
        "gen_ai.client.token.usage",
        "gen_ai.client.operation.duration",
        "gen_ai.client.operation.time_to_first_chunk",
        "gen_ai.client.inference.usage.input_tokens",
        "gen_ai.client.inference.usage.output_tokens",
        "tollgate.admission.decisions",
        "tollgate.admission.reserved",
        "tollgate.admission.settled",
        "tollgate.admission.refused",
    ];
    let metrics = tollgate_testkit::wait::poll(Duration::from_secs(10), async || {
        let m = received.metrics();
        let spans = received.spans.lock().unwrap().len();
        match wanted.iter().find(|w| !m.contains_key(**w)) {
            None if spans >= 3 => Ok(m),
            missing => Err(format!(
                "{missing:?} not exported, {spans} spans: {:?}",
                m.keys()
            )),
        }
    })
    .await;

    for p in histogram(
        &metrics["gen_ai.client.token.usage"],
        "{token}",
        &token_buckets(),
    ) {
        assert_eq!(p["gen_ai.operation.name"], "chat", "{p:?}");
        assert_eq!(p["gen_ai.provider.name"], "openai", "{p:?}");
        assert_eq!(p["gen_ai.request.model"], "gpt-4o", "{p:?}");
        assert!(
            ["input", "output"].contains(&p["gen_ai.token.type"].as_str()),
            "{p:?}"
        );
    }
    for name in [
        "gen_ai.client.operation.duration",
        "gen_ai.client.operation.time_to_first_chunk",
    ] {
        for p in histogram(&metrics[name], "s", &seconds_buckets()) {
            assert_eq!(p["gen_ai.operation.name"], "chat", "{name}: {p:?}");
            assert_eq!(p["gen_ai.request.model"], "gpt-4o", "{name}: {p:?}");
        }
    }
    for name in [
        "gen_ai.client.inference.usage.input_tokens",
        "gen_ai.client.inference.usage.output_tokens",
        "tollgate.admission.reserved",
        "tollgate.admission.settled",
    ] {
        assert!(
            counter(&metrics[name], "{token}")
                .iter()
                .all(|(_, v)| *v > 0),
            "{name}"
        );
    }
    let decisions = counter(&metrics["tollgate.admission.decisions"], "{decision}");
    let by = |d: &str, r: &str| {
        decisions
            .iter()
            .find(|(a, _)| a["tollgate.decision"] == d && a["tollgate.reason"] == r)
            .map_or(0, |(_, v)| *v)
    };
    assert_eq!(by("admit", ""), 2 + more, "{decisions:?}");
    assert_eq!(by("deny", "budget_limit"), 1, "{decisions:?}");

    let spans = received.spans.lock().unwrap().clone();
    let chat: Vec<&Span> = spans.iter().filter(|s| s.name == "chat gpt-4o").collect();
    assert_eq!(chat.len(), spans.len(), "{spans:?}");
    assert_eq!(chat.len() as u64, 2 + more + 1);
    for s in &chat {
        assert_eq!(s.kind, span::SpanKind::Client as i32);
        assert!(
            s.events.iter().any(|e| e.name == "tollgate.admission"),
            "{s:?}"
        );
        let a = attrs(&s.attributes);
        assert_eq!(a["gen_ai.provider.name"], "openai");
    }
    let denied: Vec<BTreeMap<String, String>> = chat
        .iter()
        .map(|s| attrs(&s.attributes))
        .filter(|a| a.contains_key("error.type"))
        .collect();
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert_eq!(denied[0]["error.type"], "budget_limit");
    assert!(
        chat.iter()
            .any(|s| attrs(&s.attributes).contains_key("gen_ai.usage.output_tokens"))
    );
}

/// Both protocols, one after the other: the export is the process's, so one test holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_exports_what_the_conventions_name_over_grpc_and_http() {
    let received = Received::default();
    let endpoint = grpc_receiver(&received).await;
    exports_what_the_conventions_name("grpc", received, endpoint).await;
    let received = Received::default();
    let endpoint = http_receiver(&received).await;
    exports_what_the_conventions_name("http/protobuf", received, endpoint).await;
}
