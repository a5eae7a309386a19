//! The admit step, one for the proxy and the embedded layer (the tower layer): a key's
//! exemptions, the configuration's kill switches, one atomic admission in the store, what an
//! unreachable store means (a token verdict still refuses, a fail-open policy admits, otherwise
//! 503), and the bounded queue in front of a full concurrency scope or a provider's hold.

use std::time::{Duration, Instant};

use tokio::time::Instant as TimerInstant;

use tollgate_core::decision::Killed;
use tollgate_core::record::ShadowRefusal;
use tollgate_core::{Admitted, Decision, Deny, Plan, Reason, ShadowOutcome, Store, StoreError};

use crate::config::QueueConfig;
use crate::queue::{Behind, Flow, Place, Queue, line_of};
use crate::respond::{self, ApiError};

/// What an admission is decided with, besides its plan.
#[derive(Debug)]
pub(crate) struct Controls<'a, S> {
    /// Where counters, leases and reservations are kept.
    pub store: &'a S,
    /// Controls the caller's key is exempt from.
    pub exempt: &'a [Reason],
    /// Kill switches of the configuration file, `(target, reason)`: they hold whatever the
    /// store holds or forgets.
    pub kills: &'a [(String, String)],
    /// The bounded queue and its settings, when one is configured.
    pub queue: Option<(&'a Queue, QueueConfig)>,
    /// Whose places and turns in the queue a waiting request takes.
    pub flow: Flow<'a>,
    /// Where budget thresholds, exhausted budgets and a store's loss are told.
    pub alerts: Option<&'a crate::alerts::Alerts>,
    /// What to do when the store says it lost its state (the proxy: rebuild from the ledger).
    pub on_lost: Option<OnLost<'a>>,
}

impl<'a> Controls<'a, crate::store::AnyStore> {
    /// A gateway entry point's controls: the caller's exemptions, the configuration's kill
    /// switches, the queue when `queued` and one is configured, the alerts, and `on_lost` when
    /// the store lost its state (see [`crate::gateway::Gateway::store_lost`]).
    pub(crate) fn of(
        gw: &'a crate::gateway::Gateway,
        cfg: &'a crate::config::GatewayConfig,
        (exempt, flow): (&'a [Reason], Flow<'a>),
        queued: bool,
        on_lost: &'a (dyn Fn() + Sync),
    ) -> Self {
        Controls {
            store: &gw.store,
            exempt,
            kills: &cfg.kills,
            queue: cfg.queue.filter(|_| queued).map(|q| (&gw.queue, q)),
            flow,
            alerts: Some(&gw.alerts),
            on_lost: Some(OnLost(on_lost)),
        }
    }
}

/// What a caller does when the store says it lost its state.
#[derive(Clone, Copy)]
pub(crate) struct OnLost<'a>(pub &'a (dyn Fn() + Sync));

impl std::fmt::Debug for OnLost<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnLost")
    }
}

/// What a request's shadow rules made of it.
#[derive(Debug, Default)]
pub(crate) enum Shadowed {
    /// No shadow rule applies, or they would have admitted a request that was not admitted.
    #[default]
    None,
    /// Admitted under the shadow rules, held by the request's own admission: it ends with it.
    Held,
    /// Admitted under the shadow rules in an admission of its own, with this id (a store that
    /// cannot make both in one step): it ends with the request.
    Apart(String),
    /// A shadow rule would have refused.
    Refused(Deny),
    /// The store did not answer the shadow admission (the request was decided without it).
    Failed,
}

impl Shadowed {
    /// The would-be refusal, for the decision record.
    pub fn refusal(&self) -> Option<ShadowRefusal> {
        match self {
            Shadowed::Refused(d) => Some(ShadowRefusal {
                reason: d.reason.code(),
                rule: d.scope.rule().to_owned(),
                scope: d.scope.key().to_owned(),
            }),
            _ => None,
        }
    }

    /// The shadow admission of its own to end with the request, if any.
    pub fn admitted(self) -> Option<String> {
        match self {
            Shadowed::Apart(id) => Some(id),
            _ => None,
        }
    }

    fn of(outcome: ShadowOutcome) -> Self {
        match outcome {
            ShadowOutcome::Held => Shadowed::Held,
            ShadowOutcome::Passed => Shadowed::None,
            ShadowOutcome::Apart(id) => Shadowed::Apart(id),
            ShadowOutcome::Refused(d) => {
                crate::telemetry::shadow_refusal(d.reason.code(), d.scope.rule());
                Shadowed::Refused(d)
            }
            ShadowOutcome::Failed => Shadowed::Failed,
        }
    }
}

impl<S: Store + Clone + 'static> Controls<'_, S> {
    /// The decision on plan `p`, and what the shadow plan `shadow` would have decided, in the
    /// same store step ([`Store::admit_shadowed`]). The shadow never changes the decision;
    /// when the request is not admitted, its shadow holds nothing (its attempts counted).
    pub async fn decide_shadowed(
        &self,
        p: &mut Plan,
        shadow: Option<Plan>,
    ) -> Result<(Decision, Shadowed), ApiError> {
        let mut shadow = shadow.map(|mut s| {
            exempt(&mut s, self.exempt);
            s
        });
        let (decided, shadowed) = self.decide(p, shadow.as_mut()).await?;
        let shadowed = match shadowed {
            Shadowed::Apart(id) if !matches!(decided, Decision::Admit(_)) => {
                crate::ticket::release_unanswered(self.store, &id, UNANSWERED_RELEASE_WINDOW);
                Shadowed::None
            }
            other => other,
        };
        if let Some(a) = self.alerts {
            a.observe(self.store, p, &decided);
        }
        counted(&decided);
        Ok((decided, shadowed))
    }

    /// The decision on a plan of an entry point's own (the rate decided before a body is
    /// counted, `/v1/limits`' reads), made as a request's is: exemptions, the configuration's
    /// kill switches, the queue when there is one, the store's faults and its loss. Its
    /// decision is not counted as a request's (the request's own admission is), and one that
    /// failed open is the caller's to read.
    pub async fn decide_alone(&self, p: &mut Plan) -> Result<Decision, ApiError> {
        self.decide(p, None).await.map(|(d, _)| d)
    }

    /// A shadow plan admitted on its own, for a request the configuration's kill switch
    /// refused before the store was asked: its attempts count as a refused request's do.
    async fn shadow_apart(&self, s: &Plan) -> Shadowed {
        let t = Instant::now();
        let r = {
            let unanswered = Unanswered(Some((self.store, &s.request_id)));
            let r = self.store.admit(s).await;
            if !matches!(r, Err(StoreError::Unavailable(_))) {
                unanswered.answered();
            }
            r
        };
        crate::telemetry::store_call("admit", t.elapsed().as_secs_f64(), r.is_ok());
        match r {
            Ok(Decision::Admit(_)) => Shadowed::Apart(s.request_id.clone()),
            Ok(Decision::Deny(d)) => Shadowed::of(ShadowOutcome::Refused(d)),
            Ok(Decision::Killed(_)) | Err(_) => Shadowed::Failed,
        }
    }

    /// The decision on plan `p` (exempted already) and its shadow's; `Err` only for a store
    /// that failed in a way the policy does not answer for (see [`store_error`]).
    async fn decide(
        &self,
        p: &mut Plan,
        mut shadow: Option<&mut Plan>,
    ) -> Result<(Decision, Shadowed), ApiError> {
        exempt(p, self.exempt);
        if let Some(k) = configured_kill(p, self.kills) {
            let shadowed = match shadow {
                Some(s) => self.shadow_apart(s).await,
                None => Shadowed::None,
            };
            return Ok((k, shadowed));
        }
        let Some((queue, q)) = self.queue else {
            return self.once(p, shadow.as_deref()).await;
        };
        // The timer's clock, which the waits below follow (and a test's paused time moves).
        let entered = TimerInstant::now();
        let deadline = entered + q.max_wait;
        // Behind the requests that wait for one of its leases, it is tried in its turn.
        let mut place = match queue.behind(p, &self.flow, q) {
            None => None,
            Some(Behind::InLine(pl)) => {
                wait_turn(&pl, deadline).await;
                Some(pl)
            }
            Some(Behind::Full(d)) => return Ok((Decision::Deny(d), Shadowed::None)),
        };
        let (mut first, mut shadowed) = self.once(p, shadow.as_deref()).await?;
        // A provider's hold that ends within the wait is waited out in a place of the queue,
        // so that held requests are as bounded as any waiters.
        if hold_wait(&first).is_some()
            && let Some(pl) = place.take().or_else(|| queue.enter(&self.flow, q))
        {
            (first, shadowed) = self
                .wait_out_hold(p, shadow.as_deref(), first, deadline)
                .await?;
            place = Some(pl);
        }
        let deny = match first {
            Decision::Deny(d) if p.refused_lease(&d) => d,
            other => {
                if let Some(pl) = place.take() {
                    queued(pl, entered, &other);
                }
                return Ok((other, shadowed));
            }
        };
        let Some(mut place) = place.or_else(|| queue.enter(&self.flow, q)) else {
            return Ok((Decision::Deny(deny), shadowed));
        };
        place.line_up(line_of(&deny));
        // A shadow that would have admitted is tried again with each retry; one admitted apart
        // (a sharded store) is released now, and a request admitted from the queue then holds
        // nothing under the shadow rules.
        if let Shadowed::Apart(id) = &shadowed {
            crate::ticket::release_unanswered(self.store, id, UNANSWERED_RELEASE_WINDOW);
            shadowed = Shadowed::None;
        }
        if !matches!(shadowed, Shadowed::None) {
            shadow = None;
        }
        // The attempt was counted once: retries from the queue skip the counts.
        p.attempt_counted = true;
        if let Some(s) = shadow.as_deref_mut() {
            s.attempt_counted = true;
        }
        let mut wait = Duration::from_millis(5);
        let mut last = deny;
        while TimerInstant::now() + wait <= deadline {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(50));
            if !place.first() {
                continue;
            }
            let (d, s) = self.once(p, shadow.as_deref()).await?;
            if shadow.is_some() {
                shadowed = s;
            }
            match d {
                Decision::Deny(d) if p.refused_lease(&d) => {
                    place.line_up(line_of(&d));
                    last = d;
                }
                other => {
                    queued(place, entered, &other);
                    return Ok((other, shadowed));
                }
            }
        }
        crate::telemetry::queue_wait(entered.elapsed().as_secs_f64(), false);
        Ok((Decision::Deny(last), shadowed))
    }

    /// Tries plan `p` again once each provider hold that refused it (`d`) has ended, while its
    /// end comes before `deadline`. The kill switch comes before every count, so the attempt is
    /// counted once, by the call that gets past the hold. Each waiter wakes at the end plus up
    /// to a tenth of its wait (at most a second), so that the requests held together do not
    /// reach the provider at once when its window opens.
    async fn wait_out_hold(
        &self,
        p: &Plan,
        shadow: Option<&Plan>,
        mut d: Decision,
        deadline: TimerInstant,
    ) -> Result<(Decision, Shadowed), ApiError> {
        let mut shadowed = Shadowed::None;
        while let Some(wait) = hold_wait(&d) {
            let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
            let wake = TimerInstant::now() + wait + Duration::from_millis(respond::jitter_ms(ms));
            if wake > deadline {
                break;
            }
            tokio::time::sleep_until(wake).await;
            (d, shadowed) = self.once(p, shadow).await?;
        }
        Ok((d, shadowed))
    }

    /// One call to the store, with the shadow plan when there is one, and what its failure
    /// means.
    async fn once(
        &self,
        p: &Plan,
        shadow: Option<&Plan>,
    ) -> Result<(Decision, Shadowed), ApiError> {
        let t = Instant::now();
        // The store may apply an admission whose answer never reaches this request: the call
        // timed out, or the client left while it was under way (this future is then dropped).
        // Its leases and reservation are given back by id rather than held until they expire
        // (a shadow held with them goes with them).
        let unanswered = Unanswered(Some((self.store, &p.request_id)));
        // A shadow admitted apart (a sharded store) has an id of its own.
        let apart = shadow.map(|s| Unanswered(Some((self.store, &s.request_id))));
        let r = match shadow {
            None => self.store.admit(p).await.map(|d| (d, Shadowed::None)),
            Some(s) => self
                .store
                .admit_shadowed(p, s)
                .await
                .map(|(d, o)| (d, Shadowed::of(o))),
        };
        crate::telemetry::store_call("admit", t.elapsed().as_secs_f64(), r.is_ok());
        if !matches!(r, Err(StoreError::Unavailable(_))) {
            unanswered.answered();
            if let Some(a) = apart {
                a.answered();
            }
        }
        let (d, shadowed) = match r {
            Ok(d) => {
                crate::faults::STORE.ok();
                crate::faults::STORE_LOST.ok();
                crate::faults::STORE_UNINITIALISED.ok();
                d
            }
            Err(e) => (self.unanswered(p, e)?, Shadowed::Failed),
        };
        Ok((d, shadowed))
    }

    /// What a store's failure `e` means for plan `p`.
    fn unanswered(&self, p: &Plan, e: StoreError) -> Result<Decision, ApiError> {
        match &e {
            // The caller's `on_lost` logs it with its cause.
            StoreError::StateLost if self.on_lost.is_some() => false,
            StoreError::StateLost => crate::faults::STORE_LOST.fail(
                &e,
                "the store has lost its state: admissions are refused (503 store_state_lost) \
                 until its books are rebuilt from the ledger or an operator acknowledges the loss",
            ),
            StoreError::Uninitialised => crate::faults::STORE_UNINITIALISED.fail(
                &e,
                "the store holds no marker: admissions are refused (503 store_uninitialised) \
                 until it is initialised (`tollgate admin init-store`) or rebuilt from the ledger",
            ),
            StoreError::Unavailable(_) if p.fail_open => crate::faults::STORE.fail(
                &e,
                "the store does not answer: the controls listed in fail_open admit without it",
            ),
            _ => crate::faults::STORE.fail(
                &e,
                "the store does not answer: admissions are refused (503 store_unavailable)",
            ),
        };
        Ok(match e {
            // A verdict needs no store: a stateless control's refuses as usual, and so does a
            // stateful control's when the plan fails open (the controls failing open are the
            // ones before it that need the store).
            StoreError::Unavailable(_) if p.verdict_without_store().is_some() => Decision::Deny(
                p.verdict_without_store()
                    .cloned()
                    .ok_or_else(respond::inconsistent)?,
            ),
            StoreError::Unavailable(_) if p.fail_open => {
                crate::telemetry::fail_open();
                Decision::Admit(Admitted {
                    max_output_tokens: p.max_output_tokens,
                    expires_at: 0,
                    quotas: Vec::new(),
                    fail_open: true,
                })
            }
            e => {
                if let StoreError::StateLost = &e {
                    if let Some(a) = self.alerts {
                        a.store_lost();
                    }
                    if let Some(OnLost(lost)) = self.on_lost {
                        lost();
                    }
                }
                return Err(store_error(e));
            }
        })
    }
}

/// A request's decision, counted once (however many times the queue asked the store).
pub(crate) fn counted(d: &Decision) {
    match d {
        Decision::Admit(_) => {
            crate::telemetry::decision("admit", "");
            crate::otel::decision("admit", "");
        }
        Decision::Deny(x) => {
            crate::telemetry::decision(x.reason.code(), x.scope.rule());
            crate::otel::decision("deny", x.reason.code());
        }
        Decision::Killed(_) => {
            crate::telemetry::decision(d.code(), "");
            crate::otel::decision("killed", d.code());
        }
    }
}

/// Clears the controls in `exempt` from the plan.
fn exempt(p: &mut Plan, exempt: &[Reason]) {
    for r in exempt {
        p.exempt(*r);
    }
}

/// The first of the plan's kill targets that the configuration switches off.
fn configured_kill(p: &Plan, kills: &[(String, String)]) -> Option<Decision> {
    p.kill_targets.iter().find_map(|t| {
        kills
            .iter()
            .find(|(target, _)| target == t)
            .map(|(target, reason)| {
                Decision::Killed(Killed {
                    target: target.clone(),
                    reason: reason.clone(),
                    until: None,
                })
            })
    })
}

/// A store failure that no policy answers for.
pub(crate) fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::Unavailable(_) => respond::store_unavailable(),
        StoreError::Uninitialised => respond::store_uninitialised(),
        StoreError::StateLost => {
            crate::telemetry::store_state_lost();
            respond::store_state_lost()
        }
        other => respond::internal("store_error", other),
    }
}

/// An admission under way; dropped before it is answered, it releases its request by id.
struct Unanswered<'a, S: Store + Clone + 'static>(Option<(&'a S, &'a str)>);

impl<S: Store + Clone + 'static> Unanswered<'_, S> {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl<S: Store + Clone + 'static> Drop for Unanswered<'_, S> {
    fn drop(&mut self) {
        if let Some((store, id)) = self.0.take() {
            crate::ticket::release_unanswered(store, id, UNANSWERED_RELEASE_WINDOW);
        }
    }
}

/// How long the release of an unanswered admission is retried: an admission still in flight in
/// the store when the call timed out has been applied (or dropped) well within it.
const UNANSWERED_RELEASE_WINDOW: Duration = Duration::from_secs(30);

/// How long until the provider's hold that refused `d` ends, when one did.
fn hold_wait(d: &Decision) -> Option<Duration> {
    match d {
        Decision::Killed(k) => k
            .wait_ms(tollgate_core::Clock::now(&tollgate_core::SystemClock))
            .map(Duration::from_millis),
        _ => None,
    }
}

/// Waits until it is `place`'s turn, or until `deadline`.
async fn wait_turn(place: &Place<'_>, deadline: TimerInstant) {
    let mut wait = Duration::from_millis(5);
    while !place.first() && TimerInstant::now() + wait <= deadline {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(50));
    }
}

/// A request leaves the queue with decision `d`: served, its line moves on.
fn queued(place: Place<'_>, entered: TimerInstant, d: &Decision) {
    crate::telemetry::queue_wait(
        entered.elapsed().as_secs_f64(),
        matches!(d, Decision::Admit(_)),
    );
    place.served();
}
