//! Prometheus metrics. Labels are low-cardinality on purpose: reason codes, rule names, status
//! classes, never tenant or user ids (except the operator's configured scopes in the
//! budget-remaining gauge).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Seconds: store calls and queue waits are short, upstream calls long.
const FAST: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
const SLOW: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The process's metrics renderer (installed once; every gateway in the process shares it).
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("store_call_seconds".into()), FAST)
                .ok()?
                .set_buckets_for_metric(Matcher::Suffix("queue_wait_seconds".into()), FAST)
                .ok()?
                .set_buckets_for_metric(Matcher::Suffix("upstream_seconds".into()), SLOW)
                .ok()?;
            builder.install_recorder().ok()
        })
        .as_ref()
}

/// Admitted requests not yet ended, by id, with when they were admitted and what they reserved.
#[derive(Debug, Default)]
struct InFlight {
    next: AtomicU64,
    map: Mutex<BTreeMap<(Instant, u64), u64>>,
}

fn in_flight() -> &'static InFlight {
    static IN_FLIGHT: OnceLock<InFlight> = OnceLock::new();
    IN_FLIGHT.get_or_init(InFlight::default)
}

/// Held by a ticket while its request is in flight.
#[derive(Debug)]
pub struct InFlightGuard {
    key: (Instant, u64),
}

impl InFlightGuard {
    /// Tracks a request that reserved `estimate_tokens`.
    pub fn new(estimate_tokens: u64) -> Self {
        let f = in_flight();
        let key = (Instant::now(), f.next.fetch_add(1, Ordering::Relaxed));
        if let Ok(mut m) = f.map.lock() {
            m.insert(key, estimate_tokens);
        }
        Self { key }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = in_flight().map.lock() {
            m.remove(&self.key);
        }
    }
}

/// A decision was made.
pub fn decision(code: &'static str, rule: &str) {
    counter!("tollgate_decisions_total", "decision" => code, "rule" => rule.to_owned())
        .increment(1);
    if code != "admit" {
        recent().note(code);
    }
}

/// Minutes of refusals the status page shows.
pub const RECENT_MINUTES: usize = 15;

/// Refusals of this instance per minute, by reason, over the last [`RECENT_MINUTES`]: what the
/// status page shows without a Prometheus. Admissions are not kept here, so the hot path of an
/// admitted request takes no lock for it.
#[derive(Debug, Default)]
struct Recent {
    /// (minute since the epoch, reason, count), oldest first.
    cells: Mutex<std::collections::VecDeque<(u64, &'static str, u64)>>,
}

fn recent() -> &'static Recent {
    static RECENT: OnceLock<Recent> = OnceLock::new();
    RECENT.get_or_init(Recent::default)
}

fn minute_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 60)
}

impl Recent {
    fn note(&self, code: &'static str) {
        let now = minute_now();
        let Ok(mut cells) = self.cells.lock() else {
            return;
        };
        while cells
            .front()
            .is_some_and(|c| c.0 + RECENT_MINUTES as u64 <= now)
        {
            cells.pop_front();
        }
        match cells.iter_mut().rev().find(|c| c.0 == now && c.1 == code) {
            Some(c) => c.2 += 1,
            None => cells.push_back((now, code, 1)),
        }
    }
}

/// Refusals by reason over the last [`RECENT_MINUTES`]: for each reason, its counts per
/// minute, oldest first (the last is the current minute).
pub fn recent_refusals() -> BTreeMap<&'static str, [u64; RECENT_MINUTES]> {
    let now = minute_now();
    let mut out: BTreeMap<&'static str, [u64; RECENT_MINUTES]> = BTreeMap::new();
    if let Ok(cells) = recent().cells.lock() {
        for &(minute, code, n) in cells.iter() {
            let ago = now.saturating_sub(minute) as usize;
            if let Some(i) = (RECENT_MINUTES - 1).checked_sub(ago) {
                if let Some(c) = out.entry(code).or_default().get_mut(i) {
                    *c += n;
                }
            }
        }
    }
    out
}

/// An alert fired (`event`: budget_threshold, budget_exhausted, kill_switch_set, …).
pub fn alert(event: &str) {
    counter!("tollgate_alerts_total", "event" => event.to_owned()).increment(1);
}

/// An admin call refused its credentials (`route`: one of a fixed set; `principal`: `none`
/// presented, an `unknown` token, or a `tenant`'s token beyond its tenant).
pub fn admin_login_failed(route: &'static str, principal: &'static str) {
    counter!("tollgate_admin_login_failures_total", "route" => route, "principal" => principal)
        .increment(1);
}

/// An alert was dropped: its queue was full.
pub fn alert_dropped() {
    counter!("tollgate_alerts_dropped_total").increment(1);
}

/// A threshold's claim was not answered by the store: asked again later.
pub fn alert_undecided() {
    counter!("tollgate_alerts_undecided_total").increment(1);
}

/// A webhook delivery: `delivered`, `retried` or `failed`.
pub fn alert_delivery(outcome: &'static str) {
    counter!("tollgate_alert_deliveries_total", "outcome" => outcome).increment(1);
}

/// A shadow rule would have refused a request.
pub fn shadow_refusal(code: &'static str, rule: &str) {
    counter!("tollgate_shadow_refusals_total", "reason" => code, "rule" => rule.to_owned())
        .increment(1);
    if let Ok(mut m) = shadow_totals().lock() {
        *m.entry((rule.to_owned(), code)).or_default() += 1;
    }
}

/// A shadow rule's would-be refusals on this instance since it started, by (rule, reason): the
/// status page shows them without a Prometheus.
fn shadow_totals() -> &'static Mutex<BTreeMap<(String, &'static str), u64>> {
    static TOTALS: OnceLock<Mutex<BTreeMap<(String, &'static str), u64>>> = OnceLock::new();
    TOTALS.get_or_init(Mutex::default)
}

/// See [`shadow_totals`].
pub fn shadow_refusals() -> Vec<(String, &'static str, u64)> {
    shadow_totals().lock().map_or(Vec::new(), |m| {
        m.iter().map(|((r, c), n)| (r.clone(), *c, *n)).collect()
    })
}

/// A store call took `seconds`, or failed.
pub fn store_call(op: &'static str, seconds: f64, ok: bool) {
    histogram!("tollgate_store_call_seconds", "op" => op).record(seconds);
    if !ok {
        counter!("tollgate_store_errors_total", "op" => op).increment(1);
    }
}

/// The upstream answered with `status` after `seconds` (to the response headers).
pub fn upstream(status: u16, seconds: f64) {
    let class = match status {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    };
    counter!("tollgate_upstream_responses_total", "status" => class).increment(1);
    histogram!("tollgate_upstream_seconds").record(seconds);
}

/// The upstream could not be reached or timed out.
pub fn upstream_failed(kind: &'static str) {
    counter!("tollgate_upstream_failures_total", "kind" => kind).increment(1);
}

/// Tokens and money settled.
pub fn settled(input: u64, output: u64, micro_usd: Option<u64>) {
    counter!("tollgate_settled_tokens_total", "kind" => "input").increment(input);
    counter!("tollgate_settled_tokens_total", "kind" => "output").increment(output);
    if let Some(m) = micro_usd {
        counter!("tollgate_settled_micro_usd_total").increment(m);
    }
}

/// A client went away before its answer's end; the answer was read on.
pub fn client_left() {
    counter!("tollgate_client_left_total").increment(1);
}

/// A request ended without usage from this instance (its lease expires; the policy charges).
pub fn abandoned() {
    counter!("tollgate_abandoned_total").increment(1);
}

/// Queue entry and wait.
pub fn queue_waiting(delta: f64) {
    gauge!("tollgate_queue_waiting").increment(delta);
}

/// How long a request waited in the queue.
pub fn queue_wait(seconds: f64, admitted: bool) {
    histogram!("tollgate_queue_wait_seconds", "outcome" => if admitted { "admitted" } else { "refused" }).record(seconds);
}

/// Sets the gauges computed at scrape time.
pub fn scrape_gauges(records_dropped: u64, memos: &crate::memo::CountMemos) {
    let (n, reserved, oldest) = match in_flight().map.lock() {
        Ok(m) => (
            m.len() as f64,
            m.values().sum::<u64>() as f64,
            m.keys()
                .next()
                .map_or(0.0, |(t, _)| t.elapsed().as_secs_f64()),
        ),
        Err(_) => (0.0, 0.0, 0.0),
    };
    gauge!("tollgate_in_flight").set(n);
    gauge!("tollgate_reserved_unsettled_tokens").set(reserved);
    gauge!("tollgate_oldest_unsettled_seconds").set(oldest);
    gauge!("tollgate_records_dropped").set(records_dropped as f64);
    gauge!("tollgate_count_memo_entries").set(memos.entries() as f64);
    gauge!("tollgate_count_memo_bytes").set(memos.bytes() as f64);
}

/// The remaining budget of an operator-configured scope.
pub fn budget_remaining(scope: &str, unit: &'static str, limit: u64, remaining: u64) {
    gauge!("tollgate_budget_limit", "scope" => scope.to_owned(), "unit" => unit).set(limit as f64);
    gauge!("tollgate_budget_remaining", "scope" => scope.to_owned(), "unit" => unit)
        .set(remaining as f64);
}

/// An ending (settlement or release) the store did not take, tried again.
pub fn end_retried(op: &'static str) {
    counter!("tollgate_store_end_retries_total", "op" => op).increment(1);
}

/// An ending given up: the store never took it within the ticket's lifetime (the store expires
/// the ticket and charges what the policy says for an expired one).
pub fn end_lost(op: &'static str) {
    counter!("tollgate_store_ends_lost_total", "op" => op).increment(1);
}

/// An upstream stream cut off at a bound (`stream_idle_timeout`, `stream_max_duration`,
/// `stream_event_too_large`).
pub fn stream_cut_off(bound: &'static str) {
    counter!("tollgate_streams_cut_off_total", "bound" => bound).increment(1);
}

/// An admission refused because the store lost its state.
pub fn store_state_lost() {
    counter!("tollgate_store_state_lost_total").increment(1);
}

/// Something the spend ledger did besides writing: `rebuilt`, `rebuild_failed`, `dropped`,
/// `apply_failed`, `kill_not_written`, `refused` (an admission refused while its buffer is full).
pub fn ledger_event(event: &'static str) {
    counter!("tollgate_ledger_events_total", "event" => event).increment(1);
}

/// The slices' counts since `last`, added to their counters: admissions decided here
/// (`path="slice"`) and by the store (`path="store"`), exchanges with the store and those that
/// failed, and answers that granted more than was asked (cut down to it). Returns the counts
/// now.
pub fn slices(
    now: tollgate_slices::SliceStats,
    last: tollgate_slices::SliceStats,
) -> tollgate_slices::SliceStats {
    counter!("tollgate_slice_admissions_total", "path" => "slice")
        .increment(now.local.saturating_sub(last.local));
    counter!("tollgate_slice_admissions_total", "path" => "store")
        .increment(now.store.saturating_sub(last.store));
    counter!("tollgate_slice_exchanges_total", "outcome" => "ok")
        .increment(now.exchanges.saturating_sub(last.exchanges));
    counter!("tollgate_slice_exchanges_total", "outcome" => "failed")
        .increment(now.failed.saturating_sub(last.failed));
    counter!("tollgate_slice_answers_cut_total")
        .increment(now.anomalies.saturating_sub(last.anomalies));
    now
}

/// An operator acknowledged a loss of the store's state.
pub fn store_loss_acknowledged() {
    counter!("tollgate_store_loss_acknowledged_total").increment(1);
}

/// A settlement above its reservation (charged all the same).
pub fn over_reservation() {
    counter!("tollgate_settled_over_reservation_total").increment(1);
}

/// An upstream's reported output below what the gateway counted passing through (the count was
/// charged).
pub fn usage_underreported() {
    counter!("tollgate_upstream_usage_underreported_total").increment(1);
}

/// An answer cut off by the gateway once its output passed the granted cap.
pub fn output_cap_held() {
    counter!("tollgate_output_cap_held_total").increment(1);
}

/// An upstream usage number that was not a count (the reservation was charged).
pub fn usage_invalid() {
    counter!("tollgate_upstream_usage_invalid_total").increment(1);
}

/// A connection closed at accept because a listener was full, in all or for its address.
pub fn connection_refused(limit: &'static str) {
    counter!("tollgate_connections_refused_total", "limit" => limit).increment(1);
}

/// This instance found the store lost (`cause`: `forgot`, its marker gone; `behind`, its write
/// sequence behind what an instance had seen).
pub fn store_loss(cause: &'static str) {
    counter!("tollgate_store_losses_total", "cause" => cause).increment(1);
}

/// A connection accepted (`1.0`) or ended (`-1.0`) on a listener.
pub fn connections_open(listener: &'static str, delta: f64) {
    gauge!("tollgate_connections_open", "listener" => listener).increment(delta);
}

/// An idle connection of a full admin or metrics listener closed to take a new one.
pub fn connection_evicted() {
    counter!("tollgate_connections_evicted_total").increment(1);
}

/// The operator's fixed scopes: those of global rules and of rules whose `match` names every
/// dimension they are keyed on, one scope each, known without a request.
pub(crate) fn fixed_scopes(
    policy: &tollgate_core::Policy,
) -> Vec<(&tollgate_core::policy::ScopeRule, tollgate_core::ScopeKey)> {
    use tollgate_core::{Identity, ScopeKey};
    policy
        .scopes
        .iter()
        .filter_map(|rule| {
            let mut identity = Identity::default();
            for (d, v) in &rule.matches {
                identity = identity.with(*d, v.clone());
            }
            let scope = ScopeKey::derive_in(&rule.name, &rule.dims, &identity, rule.ip_prefix)?;
            Some((rule, scope))
        })
        .collect()
}

/// What a request's idempotency key did: `claimed`, `in_flight`, `conflict`, `replayed`,
/// `no_room`, `store_error`, or what failed after (`keep_failed`, `release_failed`).
pub fn idempotency(outcome: &'static str) {
    counter!("tollgate_idempotency_total", "outcome" => outcome).increment(1);
}

/// Every series at zero from the first second, so that a rate or an `increase()` sees a
/// fault's first burst and an alert that joins on a series finds it: the counters without
/// labels, the store's operations, and each rule's decisions (and a shadow rule's would-be
/// refusals) by the reasons its controls can give. Installs the recorder first: a gateway's
/// series are recorded from its start, not from the first scrape.
pub fn register(policy: &tollgate_core::Policy) {
    let _ = handle();
    for name in [
        "tollgate_abandoned_total",
        "tollgate_client_left_total",
        "tollgate_alerts_dropped_total",
        "tollgate_alerts_undecided_total",
        "tollgate_settled_micro_usd_total",
        "tollgate_store_state_lost_total",
        "tollgate_store_loss_acknowledged_total",
        "tollgate_settled_over_reservation_total",
        "tollgate_upstream_usage_underreported_total",
        "tollgate_output_cap_held_total",
        "tollgate_upstream_usage_invalid_total",
        "tollgate_fail_open_total",
    ] {
        counter!(name).increment(0);
    }
    for route in [
        "keys", "limits", "usage", "kill", "status", "ui", "store", "reload", "metrics", "other",
    ] {
        for principal in ["none", "unknown", "tenant"] {
            counter!("tollgate_admin_login_failures_total", "route" => route, "principal" => principal)
                .increment(0);
        }
    }
    for cause in ["forgot", "behind"] {
        counter!("tollgate_store_losses_total", "cause" => cause).increment(0);
    }
    for op in ["admit", "settle", "release"] {
        counter!("tollgate_store_errors_total", "op" => op).increment(0);
        counter!("tollgate_store_ends_lost_total", "op" => op).increment(0);
        counter!("tollgate_store_end_retries_total", "op" => op).increment(0);
    }
    for kind in ["unreachable", "timeout"] {
        counter!("tollgate_upstream_failures_total", "kind" => kind).increment(0);
    }
    counter!("tollgate_decisions_total", "decision" => "admit", "rule" => "").increment(0);
    for code in ["kill_switch", "upstream_rate_limited"] {
        counter!("tollgate_decisions_total", "decision" => code, "rule" => "").increment(0);
    }
    gauge!("tollgate_oldest_unsettled_seconds").set(0.0);
    gauge!("tollgate_in_flight").set(0.0);
    for rule in &policy.scopes {
        for reason in rule_reasons(rule) {
            let (code, name) = (reason.code(), rule.name.to_string());
            if rule.shadow {
                counter!("tollgate_shadow_refusals_total", "reason" => code, "rule" => name)
                    .increment(0);
            } else {
                counter!("tollgate_decisions_total", "decision" => code, "rule" => name)
                    .increment(0);
            }
        }
    }
}

/// The reasons a rule's controls can refuse for.
fn rule_reasons(rule: &tollgate_core::policy::ScopeRule) -> Vec<tollgate_core::Reason> {
    rule.controls().map(|(_, reason)| reason).collect()
}

/// The policy version in force: `tollgate_policy_info{version}` is 1 for it and 0 for the one
/// it replaced, so that alerts can name the version their refusals came under.
pub fn policy_in_force(old: Option<&str>, new: &str) {
    if let Some(old) = old.filter(|o| *o != new) {
        gauge!("tollgate_policy_info", "version" => old.to_owned()).set(0.0);
    }
    gauge!("tollgate_policy_info", "version" => new.to_owned()).set(1.0);
}

/// A reload of the configuration file (SIGHUP or `POST /admin/reload`), applied or refused.
pub fn reloaded(result: &'static str) {
    counter!("tollgate_reloads_total", "result" => result).increment(1);
}

/// A request admitted without the store because the policy lets its controls fail open.
pub fn fail_open() {
    counter!("tollgate_fail_open_total").increment(1);
}

/// A Responses API follow-up's earlier context was looked up: known (what the upstream bills
/// is counted), or not (counted as `unknown_context_tokens`, which may refuse it).
pub fn followup_context(known: bool) {
    counter!("tollgate_followup_context_total", "context" => if known { "known" } else { "unknown" })
        .increment(1);
}
