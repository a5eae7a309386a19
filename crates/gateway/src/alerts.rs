//! Alerts: a budget's committed spend (settled + reserved) reaching a threshold of its rule's
//! `alert_at`, a budget of such a rule refusing (exhausted), a kill switch set or lifted, the
//! store found to have forgotten its state. Each goes to the configured webhooks, off the
//! request path, through a bounded queue, with retries.
//!
//! A threshold or an exhaustion fires once per scope and period across every instance sharing
//! the store: the instance that sees it first claims `alert|SCOPE|PERIOD_START|PERCENT` in the
//! store (the atomic claim idempotency keys use, held until the period ends), and only the one
//! whose claim lands sends it. Each instance remembers what it has claimed or seen claimed, so
//! it asks the store once per threshold and period. A claim the store does not answer is not
//! remembered: the next admission that reaches the threshold asks again.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tollgate_core::{Clock, Decision, KeyClaim, KeyUse, Plan, Reason, Store, SystemClock};

use crate::config::{AlertsConfig, Webhook, WebhookFormat};

/// Thresholds remembered per instance at most; past it the memory starts again (a threshold
/// asked about again is found claimed in the store, so nothing is sent twice).
const MAX_REMEMBERED: usize = 10_000;

/// The alerts of a gateway. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Alerts(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    tx: mpsc::Sender<Value>,
    rx: Mutex<Option<mpsc::Receiver<Value>>>,
    webhooks: Vec<Webhook>,
    attempts: u32,
    /// Thresholds this instance has claimed or found claimed.
    seen: Mutex<HashSet<String>>,
    /// When this instance last reported a store that forgot (ms): once a minute at most.
    lost_at: Mutex<u64>,
}

impl Alerts {
    /// The alerts of `config`; [`Alerts::spawn`] starts their delivery.
    pub fn new(config: &AlertsConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        Self(Arc::new(Inner {
            tx,
            rx: Mutex::new(Some(rx)),
            webhooks: config.webhooks.clone(),
            attempts: config.attempts.max(1),
            seen: Mutex::new(HashSet::new()),
            lost_at: Mutex::new(0),
        }))
    }

    /// Starts delivering (once; later calls do nothing).
    pub fn spawn(&self) {
        let rx = self.0.rx.lock().ok().and_then(|mut r| r.take());
        if let Some(rx) = rx {
            tokio::spawn(deliver(self.0.clone(), rx));
        }
    }

    /// Queues `event` (an object with `event` and its fields) for the webhooks; a full queue
    /// drops it, counted.
    pub fn emit(&self, mut event: Value) {
        if let Some(o) = event.as_object_mut() {
            o.insert("at_ms".into(), json!(SystemClock.now()));
        }
        crate::telemetry::alert(event["event"].as_str().unwrap_or(""));
        if self.0.webhooks.is_empty() {
            return;
        }
        if self.0.tx.try_send(event).is_err() {
            crate::telemetry::alert_dropped();
            crate::faults::ALERTS_DROPPED.fail(
                &"the webhook queue is full",
                "alerts are dropped until the webhooks catch up ([alerts] queue)",
            );
        } else {
            crate::faults::ALERTS_DROPPED.ok();
        }
    }

    /// Looks at a decision for thresholds reached and budgets exhausted, of rules with
    /// `alert_at`; claims each new one in `store` in the background.
    pub fn observe<S: Store + Clone + 'static>(&self, store: &S, p: &Plan, d: &Decision) {
        if p.reserves().all(|(_, b)| b.alert_at.is_empty()) {
            return;
        }
        let now = SystemClock.now();
        match d {
            Decision::Admit(a) => {
                for q in a.quotas.iter().filter(|q| q.reason == Reason::BudgetLimit) {
                    let Some(b) = p.reserve_at(q.check) else {
                        continue;
                    };
                    let committed = q.limit.saturating_sub(q.remaining);
                    for pct in b.alert_at.reached(committed, q.limit) {
                        let event = json!({"event": "budget_threshold", "percent": pct,
                            "committed": committed});
                        self.once(store, p, q.check, now, pct.to_string(), event);
                    }
                }
            }
            Decision::Deny(x) if x.reason == Reason::BudgetLimit => {
                if let Some((i, _)) = p.reserves().find(|(_, b)| b.scope == x.scope) {
                    let event = json!({"event": "budget_exhausted", "requested": x.requested,
                        "remaining": x.remaining});
                    self.once(store, p, i, now, "exhausted".into(), event);
                }
            }
            _ => {}
        }
    }

    /// Claims `what` of the budget at place `i` of `p` for its current period, and sends `event` if
    /// this instance's claim is the one that lands.
    fn once<S: Store + Clone + 'static>(
        &self,
        store: &S,
        p: &Plan,
        i: usize,
        now: u64,
        what: String,
        mut event: Value,
    ) {
        let Some(b) = p.reserve_at(i) else { return };
        if b.alert_at.is_empty() {
            return;
        }
        let (_, start, end) = b.period.at(now);
        let key = format!("alert|{}|{start}|{what}", b.scope.id());
        {
            let Ok(mut seen) = self.0.seen.lock() else {
                return;
            };
            if seen.len() >= MAX_REMEMBERED {
                seen.clear();
            }
            if !seen.insert(key.clone()) {
                return;
            }
        }
        if let Some(o) = event.as_object_mut() {
            o.insert("scope".into(), json!(b.scope.id()));
            o.insert("rule".into(), json!(b.scope.rule()));
            o.insert("limit".into(), json!(b.limit));
            o.insert("unit".into(), json!(b.unit.as_str()));
            o.insert("period_start_ms".into(), json!(start));
            o.insert("period_end_ms".into(), json!(end));
            o.insert("policy_version".into(), json!(&*p.policy_version));
        }
        let (alerts, store, id) = (self.clone(), store.clone(), p.request_id.clone());
        tokio::spawn(async move {
            let claim = KeyUse {
                key: &key,
                digest: "alert",
                request_id: &id,
                // Held past the period's end: the next period has keys of its own.
                in_flight_ms: end.saturating_sub(now).saturating_add(60_000),
            };
            match store.claim_key(claim).await {
                Ok(KeyClaim::Claimed) => alerts.emit(event),
                Ok(KeyClaim::NoRoom) | Err(_) => {
                    // Undecided: asked again by the next admission that reaches it.
                    crate::telemetry::alert_undecided();
                    if let Ok(mut seen) = alerts.0.seen.lock() {
                        seen.remove(&key);
                    }
                }
                Ok(_) => {}
            }
        });
    }

    /// The store forgot its state: reported by each instance that finds it, once a minute.
    pub fn store_lost(&self) {
        let now = SystemClock.now();
        let first = self.0.lost_at.lock().is_ok_and(|mut at| {
            let first = now.saturating_sub(*at) >= 60_000;
            if first {
                *at = now;
            }
            first
        });
        if first {
            self.emit(json!({"event": "store_state_lost"}));
        }
    }
}

/// Sends each queued event to every webhook, in order.
async fn deliver(inner: Arc<Inner>, mut rx: mpsc::Receiver<Value>) {
    while let Some(event) = rx.recv().await {
        for w in &inner.webhooks {
            post(w, &event, inner.attempts).await;
        }
    }
}

/// One delivery, retried with backoff from 0.5 s to 30 s; a 2xx answer is delivered.
async fn post(w: &Webhook, event: &Value, attempts: u32) {
    let body = match w.format {
        WebhookFormat::Json => event.to_string(),
        WebhookFormat::Slack => json!({"text": slack_text(event)}).to_string(),
    };
    let mut wait = Duration::from_millis(500);
    let mut cause = String::new();
    for attempt in 1..=attempts {
        let req = http::Request::post(w.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::USER_AGENT, "tollgate-alerts")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())));
        let ok = match req {
            Ok(req) => {
                match tokio::time::timeout(Duration::from_secs(10), w.client.request(req)).await {
                    Ok(Ok(resp)) if resp.status().is_success() => true,
                    Ok(Ok(resp)) => {
                        cause = format!("answered {}", resp.status());
                        false
                    }
                    Ok(Err(e)) => {
                        cause = crate::upstream::error_chain(&e);
                        false
                    }
                    Err(_) => {
                        cause = "no answer within 10 s".to_owned();
                        false
                    }
                }
            }
            Err(e) => {
                cause = e.to_string();
                false
            }
        };
        if ok {
            crate::telemetry::alert_delivery("delivered");
            return;
        }
        if attempt < attempts {
            crate::telemetry::alert_delivery("retried");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(30));
        }
    }
    crate::telemetry::alert_delivery("failed");
    // The webhook's URL is not logged: chat webhooks carry their secret in it.
    tracing::error!(
        event = event["event"].as_str().unwrap_or(""),
        attempts,
        cause = %cause,
        "an alert could not be delivered to a webhook"
    );
}

/// The one line a chat channel shows.
fn slack_text(e: &Value) -> String {
    let s = |k: &str| e[k].as_str().unwrap_or("").to_owned();
    let n = |k: &str| e[k].as_u64().unwrap_or(0);
    match e["event"].as_str().unwrap_or("") {
        "budget_threshold" => format!(
            "Tollgate: budget of {} reached {}% ({} of {} {}), policy {}",
            s("scope"),
            n("percent"),
            n("committed"),
            n("limit"),
            s("unit"),
            s("policy_version")
        ),
        "budget_exhausted" => format!(
            "Tollgate: budget of {} is exhausted ({} {}), requests are refused until the period ends",
            s("scope"),
            n("limit"),
            s("unit")
        ),
        "kill_switch_set" => format!(
            "Tollgate: kill switch set on {}: {}",
            s("target"),
            s("reason")
        ),
        "kill_switch_lifted" => format!("Tollgate: kill switch lifted on {}", s("target")),
        "store_state_lost" => {
            "Tollgate: the store forgot its state; admissions are refused until acknowledged"
                .to_owned()
        }
        other => format!("Tollgate: {other}"),
    }
}
