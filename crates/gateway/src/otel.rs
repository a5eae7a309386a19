//! OpenTelemetry export over OTLP (gRPC or HTTP), off unless `[otlp]` is configured:
//!
//! - the GenAI client metrics as the semantic conventions define them
//!   (`gen_ai.client.token.usage`, `gen_ai.client.operation.duration`,
//!   `gen_ai.client.operation.time_to_first_chunk`; their names, units, attributes and bucket
//!   boundaries), and on request the newer `gen_ai.client.inference.usage.*` counters;
//! - Tollgate's own: `tollgate.admission.decisions` by decision and reason, and the tokens
//!   reserved, settled and refused;
//! - one span per request, `{operation} {model}`, with the `gen_ai.*` attributes and the
//!   admission as an event; a refused request's span carries `error.type`, its reason code.
//!
//! The gateway is the GenAI client of its upstream: an operation runs from admission to the
//! request's ending in the store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use opentelemetry::metrics::{Counter, Histogram, MeterProvider as _};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{MetricExporter, Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::{SdkTracerProvider, Tracer};
use tollgate_core::Usage;
use tollgate_tokens::Format;

use crate::config::{OtlpConfig, OtlpProtocol};

/// `gen_ai.client.token.usage`'s boundaries, as the conventions give them.
const TOKEN_BUCKETS: [f64; 14] = [
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
];

/// The boundaries of the client's duration histograms, in seconds, as the conventions give
/// them.
const SECONDS_BUCKETS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

struct Otel {
    meters: SdkMeterProvider,
    traces: SdkTracerProvider,
    tracer: Tracer,
    tokens: Histogram<u64>,
    duration: Histogram<f64>,
    first_chunk: Histogram<f64>,
    /// `gen_ai.client.inference.usage.{input,output}_tokens`, when asked for.
    inference: Option<(Counter<u64>, Counter<u64>)>,
    decisions: Counter<u64>,
    reserved: Counter<u64>,
    settled: Counter<u64>,
    refused: Counter<u64>,
}

/// The export in force; a later start (another gateway in the process) replaces it.
static OTEL: RwLock<Option<Arc<Otel>>> = RwLock::new(None);
/// Whether an export is in force: the request path reads this alone when none is.
static ON: AtomicBool = AtomicBool::new(false);

fn otel() -> Option<Arc<Otel>> {
    if !ON.load(Ordering::Relaxed) {
        return None;
    }
    OTEL.read().ok().and_then(|o| o.clone())
}

/// Starts the export `cfg` describes; within a Tokio runtime.
pub fn start(cfg: &OtlpConfig) -> Result<(), String> {
    let (metrics, spans) = exporters(cfg).map_err(|e| format!("OTLP exporter: {e}"))?;
    let resource = Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .build();
    let reader =
        opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader::builder(
            metrics,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_interval(cfg.interval)
        .build();
    let meters = SdkMeterProvider::builder()
        .with_reader(reader)
        .with_resource(resource.clone())
        .build();
    let batch =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            spans,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let traces = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(resource)
        .build();
    let scope = InstrumentationScope::builder("tollgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let tracer = traces.tracer_with_scope(scope.clone());
    let m = meters.meter_with_scope(scope);
    let seconds = |name: &'static str, what: &'static str| {
        m.f64_histogram(name)
            .with_unit("s")
            .with_description(what)
            .with_boundaries(SECONDS_BUCKETS.to_vec())
            .build()
    };
    let tokens = |name: &'static str, what: &'static str| {
        m.u64_counter(name)
            .with_unit("{token}")
            .with_description(what)
            .build()
    };
    let otel = Otel {
        tokens: m
            .u64_histogram("gen_ai.client.token.usage")
            .with_unit("{token}")
            .with_description("Number of input and output tokens used.")
            .with_boundaries(TOKEN_BUCKETS.to_vec())
            .build(),
        duration: seconds(
            "gen_ai.client.operation.duration",
            "GenAI operation duration.",
        ),
        first_chunk: seconds(
            "gen_ai.client.operation.time_to_first_chunk",
            "Time to receive the first chunk, measured from when the client issues the \
             generation request to when the first chunk is received in the response stream.",
        ),
        inference: cfg.inference_usage.then(|| {
            (
                tokens(
                    "gen_ai.client.inference.usage.input_tokens",
                    "Input tokens used by inference operations.",
                ),
                tokens(
                    "gen_ai.client.inference.usage.output_tokens",
                    "Output tokens used by inference operations.",
                ),
            )
        }),
        decisions: m
            .u64_counter("tollgate.admission.decisions")
            .with_unit("{decision}")
            .with_description("Admission decisions, by decision and reason.")
            .build(),
        reserved: tokens(
            "tollgate.admission.reserved",
            "Tokens reserved at admission (input and the granted output cap).",
        ),
        settled: tokens(
            "tollgate.admission.settled",
            "Tokens charged when requests ended.",
        ),
        refused: tokens(
            "tollgate.admission.refused",
            "Tokens refused requests would have reserved.",
        ),
        meters,
        traces,
        tracer,
    };
    let old = match OTEL.write() {
        Ok(mut slot) => {
            ON.store(true, Ordering::Relaxed);
            slot.replace(Arc::new(otel))
        }
        Err(_) => None,
    };
    if let Some(old) = old {
        // Its providers' shutdown waits on their exporting tasks: off the async workers.
        tokio::task::spawn_blocking(move || drop(old));
    }
    tracing::info!(endpoint = %cfg.endpoint, "OpenTelemetry export started");
    Ok(())
}

fn exporters(cfg: &OtlpConfig) -> Result<(MetricExporter, SpanExporter), String> {
    let e = |e: opentelemetry_otlp::ExporterBuildError| e.to_string();
    Ok(match cfg.protocol {
        OtlpProtocol::Grpc => (
            MetricExporter::builder()
                .with_tonic()
                .with_endpoint(&cfg.endpoint)
                .build()
                .map_err(e)?,
            SpanExporter::builder()
                .with_tonic()
                .with_endpoint(&cfg.endpoint)
                .build()
                .map_err(e)?,
        ),
        OtlpProtocol::HttpProtobuf => (
            MetricExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(format!("{}/v1/metrics", cfg.endpoint))
                .build()
                .map_err(e)?,
            SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(format!("{}/v1/traces", cfg.endpoint))
                .build()
                .map_err(e)?,
        ),
    })
}

/// Exports what is pending and stops (a shutdown).
pub async fn shutdown() {
    if let Some(o) = otel() {
        let (meters, traces) = (o.meters.clone(), o.traces.clone());
        let _ = tokio::task::spawn_blocking(move || {
            let _ = traces.force_flush();
            let _ = meters.force_flush();
        })
        .await;
    }
}

/// `gen_ai.operation.name` and `gen_ai.provider.name` of an API format.
fn names(format: Format) -> (&'static str, &'static str) {
    match format {
        Format::ChatCompletions | Format::Responses => ("chat", "openai"),
        Format::Completions => ("text_completion", "openai"),
        Format::Embeddings => ("embeddings", "openai"),
        Format::AnthropicMessages => ("chat", "anthropic"),
    }
}

/// A decision, counted by decision (`admit`, `deny`, `killed`) and reason code.
pub fn decision(decision: &'static str, reason: &'static str) {
    if let Some(o) = otel() {
        o.decisions.add(
            1,
            &[
                KeyValue::new("tollgate.decision", decision),
                KeyValue::new("tollgate.reason", reason),
            ],
        );
    }
}

/// A refused request: its span, with `error.type` its reason code, and the tokens it asked.
pub fn refused(format: Format, model: &str, reason: &'static str, tokens: u64) {
    let Some(o) = otel() else {
        return;
    };
    let (op, provider) = names(format);
    o.refused
        .add(tokens, &[KeyValue::new("tollgate.reason", reason)]);
    let mut span = o
        .tracer
        .span_builder(format!("{op} {model}"))
        .with_kind(SpanKind::Client)
        .with_attributes(base(op, provider, model))
        .start(&o.tracer);
    span.add_event(
        "tollgate.admission",
        vec![
            KeyValue::new("tollgate.decision", "refused"),
            KeyValue::new("tollgate.reason", reason),
        ],
    );
    span.set_attribute(KeyValue::new("error.type", reason));
    span.set_status(Status::error(reason));
    span.end();
}

fn base(op: &'static str, provider: &'static str, model: &str) -> Vec<KeyValue> {
    vec![
        KeyValue::new("gen_ai.operation.name", op),
        KeyValue::new("gen_ai.provider.name", provider),
        KeyValue::new("gen_ai.request.model", model.to_owned()),
    ]
}

/// An admitted request's operation: its span, open until it ends.
#[derive(Debug)]
pub struct Operation {
    span: opentelemetry_sdk::trace::Span,
    attrs: Vec<KeyValue>,
    started: Instant,
    first_chunk: bool,
    error: Option<String>,
}

impl Operation {
    /// The operation of a request of `format` for `model`, admitted with an output cap of
    /// `granted` and `reserved` tokens held; `None` when nothing is exported.
    pub fn admitted(format: Format, model: &str, granted: u64, reserved: u64) -> Option<Self> {
        let o = otel()?;
        let (op, provider) = names(format);
        let attrs = base(op, provider, model);
        o.reserved.add(reserved, &attrs[..2]);
        let mut span = o
            .tracer
            .span_builder(format!("{op} {model}"))
            .with_kind(SpanKind::Client)
            .with_attributes(attrs.clone())
            .start(&o.tracer);
        span.set_attribute(KeyValue::new(
            "gen_ai.request.max_tokens",
            i64::try_from(granted).unwrap_or(i64::MAX),
        ));
        span.add_event(
            "tollgate.admission",
            vec![
                KeyValue::new("tollgate.decision", "admit"),
                KeyValue::new(
                    "tollgate.reserved_tokens",
                    i64::try_from(reserved).unwrap_or(i64::MAX),
                ),
            ],
        );
        Some(Self {
            span,
            attrs,
            started: Instant::now(),
            first_chunk: false,
            error: None,
        })
    }

    /// The first chunk of a stream arrived.
    pub fn first_chunk(&mut self) {
        if self.first_chunk {
            return;
        }
        self.first_chunk = true;
        if let Some(o) = otel() {
            o.first_chunk
                .record(self.started.elapsed().as_secs_f64(), &self.attrs);
        }
    }

    /// The upstream answered with an error status: the operation's `error.type`.
    pub fn upstream_status(&mut self, status: u16) {
        if status >= 400 {
            self.error = Some(status.to_string());
        }
    }

    /// The request ended (`ending`: settled, released, abandoned) with `usage` when known.
    pub fn end(mut self, usage: Option<&Usage>, ending: &'static str) {
        let Some(o) = otel() else {
            return;
        };
        let mut attrs = self.attrs.clone();
        if let Some(e) = self.error.clone() {
            attrs.push(KeyValue::new("error.type", e));
        } else if ending != "settled" {
            attrs.push(KeyValue::new("error.type", ending));
        }
        o.duration
            .record(self.started.elapsed().as_secs_f64(), &attrs);
        if let Some(u) = usage {
            let input = u.input_tokens.saturating_add(u.cache_write_tokens);
            for (kind, n) in [("input", input), ("output", u.output_tokens)] {
                let mut a = self.attrs.clone();
                a.push(KeyValue::new("gen_ai.token.type", kind));
                o.tokens.record(n, &a);
            }
            if let Some((i, out)) = &o.inference {
                i.add(input, &self.attrs);
                out.add(u.output_tokens, &self.attrs);
            }
            o.settled
                .add(input.saturating_add(u.output_tokens), &self.attrs[..2]);
            let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.span
                .set_attribute(KeyValue::new("gen_ai.usage.input_tokens", n(input)));
            self.span.set_attribute(KeyValue::new(
                "gen_ai.usage.output_tokens",
                n(u.output_tokens),
            ));
        }
        self.span.add_event(
            "tollgate.ending",
            vec![KeyValue::new("tollgate.ending", ending)],
        );
        if let Some(e) = attrs.iter().find(|kv| kv.key.as_str() == "error.type") {
            self.span.set_attribute(e.clone());
            self.span.set_status(Status::error(e.value.to_string()));
        }
        self.span.end();
    }
}
