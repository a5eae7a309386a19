//! The operator's status page at `/admin/ui`, behind the admin token (as a bearer token, or as
//! the password of HTTP Basic authentication, which a browser asks for): budgets as settled /
//! reserved / limit bars, leases held, this instance's refusals by reason over recent minutes,
//! kill switches with forms to set and lift them, and the rules in force. One HTML document, no
//! script, no external assets; every value is escaped by the template.
//!
//! The forms carry a token bound to the viewer's session: the page sets a random session cookie
//! (`HttpOnly`, `SameSite=Strict`, so another site's request never carries it) and the token is
//! a digest of that session and the admin token. Another site cannot read the page, nor send
//! the cookie; a token seen in one browser (a screenshot, a proxy's log) is worth nothing in
//! another. Instances sharing the admin token accept each other's sessions.

use askama::Template;
use axum::Form;
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use tollgate_core::{ScopeUsage, Store};

use crate::gateway::Shared;

/// The forms' key: derived from the admin token, never the token itself; a session's form
/// token is derived from it ([`FormToken::for_session`]).
#[derive(Debug, Clone)]
pub(crate) struct FormToken(String);

/// The status page's session cookie.
const SESSION: &str = "tollgate_admin_session";

impl FormToken {
    pub(crate) fn of(admin_token: &str) -> Self {
        use sha2::Digest;
        let d = sha2::Sha256::digest(format!("tollgate-admin-form\0{admin_token}").as_bytes());
        Self(crate::config::hex(&d))
    }

    /// The form token of `session`.
    fn for_session(&self, session: &str) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(format!("{}\0{session}", self.0).as_bytes());
        crate::config::hex(&d)
    }

    /// Whether `given` is the form token of the session `headers` carry.
    fn matches(&self, headers: &HeaderMap, given: &str) -> bool {
        session_of(headers).is_some_and(|s| super::token_matches(given, &self.for_session(&s)))
    }
}

/// The session a request's cookie names, if it is one this page could have set (32 hex digits).
fn session_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == SESSION)
        .map(|(_, v)| v.to_owned())
        .filter(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A new session, or `None` when the system has no randomness to give.
fn new_session() -> Option<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).ok()?;
    Some(crate::config::hex(&b))
}

#[derive(Debug)]
struct BudgetRow {
    scope: String,
    /// The rule's name and the scope's value (`tenant:acme`, `global`).
    rule: String,
    value: String,
    settled: String,
    reserved: String,
    limit: String,
    used_pct: u64,
    reserved_pct: u64,
    /// `ok`, `warn` (four fifths used or held) or `bad` (all of it).
    level: &'static str,
    resets: String,
}

#[derive(Debug)]
struct LeaseRow {
    scope: String,
    rule: String,
    value: String,
    held: u64,
    limit: u64,
}

#[derive(Debug)]
struct RefusalRow {
    reason: &'static str,
    total: u64,
    counts: Vec<u64>,
}

#[derive(Debug, Template)]
#[template(path = "status.html")]
struct StatusPage {
    version: String,
    store: &'static str,
    in_flight: usize,
    csrf: String,
    budgets: Vec<BudgetRow>,
    leases: Vec<LeaseRow>,
    minutes: usize,
    minute_labels: Vec<String>,
    refusals: Vec<RefusalRow>,
    kills: Vec<super::Kill>,
    shadow: Vec<(String, &'static str, u64)>,
    rules: Vec<super::RuleRow>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct PageQuery {
    /// One more scope to show, `rule|key`.
    scope: Option<String>,
}

/// `GET /admin/ui`.
pub(crate) async fn page(
    State(gw): State<Shared>,
    Extension(form): Extension<FormToken>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let (session, fresh) = match session_of(&headers) {
        Some(s) => (s, false),
        None => match new_session() {
            Some(s) => (s, true),
            None => return problem(StatusCode::SERVICE_UNAVAILABLE, NO_RANDOMNESS),
        },
    };
    let cfg = gw.config();
    let (store, kills) = super::store_state(&gw).await;
    let mut scopes: Vec<_> = crate::telemetry::fixed_scopes(&cfg.policy)
        .into_iter()
        .map(|(rule, key)| (rule, key.id().to_owned()))
        .collect();
    if let Some(extra) = q.scope.filter(|s| !s.is_empty()) {
        let rule_name = extra.split('|').next().unwrap_or("");
        match cfg.policy.scopes.iter().find(|r| &*r.name == rule_name) {
            Some(rule) => scopes.push((rule, extra)),
            None => return problem(StatusCode::NOT_FOUND, &format!("No rule {rule_name:?}.")),
        }
    }
    let budget_of = |rule: &tollgate_core::policy::ScopeRule, id: &str| {
        let in_force = |n| {
            gw.overrides
                .in_force(id, crate::overrides::Control::Budget, n)
        };
        rule.budget.map(|b| (b, in_force(b.limit.get())))
    };
    let reads = scopes
        .iter()
        .map(|(rule, id)| crate::usage::of(&gw.store, id, budget_of(rule, id)));
    let usages = futures_util::future::join_all(reads).await;
    let (mut budgets, mut leases) = (Vec::new(), Vec::new());
    for ((rule, id), u) in scopes.iter().zip(usages) {
        let u = u.unwrap_or(ScopeUsage::default());
        if let Some(b) = rule.budget {
            // The store's clock, as admissions count.
            let (_, _, end) = b.period.at(u.at_ms);
            let limit = budget_of(rule, id).map_or(b.limit.get(), |(_, l)| l);
            budgets.push(budget_row(
                id,
                b.unit,
                limit.saturating_add(u.carried),
                u,
                end,
            ));
        }
        if let Some(c) = rule.concurrency {
            let (rule, value) = id.split_once('|').unwrap_or((id, ""));
            leases.push(LeaseRow {
                rule: rule.to_owned(),
                value: value.to_owned(),
                scope: id.clone(),
                held: u.leases,
                limit: c.limit.get(),
            });
        }
    }
    let page = StatusPage {
        version: cfg.policy.version.to_string(),
        store,
        in_flight: crate::ticket::open_tickets(),
        csrf: form.for_session(&session),
        budgets,
        leases,
        minutes: crate::telemetry::RECENT_MINUTES,
        minute_labels: (0..crate::telemetry::RECENT_MINUTES)
            .rev()
            .map(|ago| {
                if ago == 0 {
                    "now".into()
                } else {
                    format!("-{ago}m")
                }
            })
            .collect(),
        refusals: crate::telemetry::recent_refusals()
            .into_iter()
            .map(|(reason, counts)| RefusalRow {
                reason,
                total: counts.iter().sum(),
                counts: counts.to_vec(),
            })
            .collect(),
        kills,
        shadow: crate::telemetry::shadow_refusals(),
        rules: super::rule_rows(&cfg.policy),
    };
    let r = match page.render() {
        Ok(html) => html_response(StatusCode::OK, html),
        Err(e) => problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    with_session(r, fresh.then_some(&session))
}

const NO_RANDOMNESS: &str = "The system gave no randomness for a session: try again.";

/// `r`, setting the session cookie when the session is new.
fn with_session(mut r: Response, new: Option<&String>) -> Response {
    if let Some(session) = new {
        let cookie = format!("{SESSION}={session}; Path=/admin/ui; HttpOnly; SameSite=Strict");
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            r.headers_mut().insert(header::SET_COOKIE, v);
        }
    }
    r
}

fn budget_row(
    id: &str,
    unit: tollgate_core::Unit,
    limit: u64,
    u: ScopeUsage,
    end: u64,
) -> BudgetRow {
    use crate::words::amount;
    let pct = |v: u64| (u128::from(v) * 100 / u128::from(limit.max(1))).min(100) as u64;
    let used_pct = pct(u.settled);
    let held = pct(u.settled.saturating_add(u.reserved));
    let (rule, value) = id.split_once('|').unwrap_or((id, ""));
    BudgetRow {
        scope: id.to_owned(),
        rule: rule.to_owned(),
        value: value.to_owned(),
        settled: amount(u.settled, unit),
        reserved: amount(u.reserved, unit),
        limit: amount(limit, unit),
        used_pct,
        reserved_pct: pct(u.reserved).min(100 - used_pct),
        level: match held {
            100.. => "bad",
            80.. => "warn",
            _ => "ok",
        },
        resets: crate::words::reset_at(end, u.at_ms),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct KillForm {
    csrf: String,
    target: String,
    #[serde(default)]
    reason: String,
}

/// `POST /admin/ui/kill` and `POST /admin/ui/lift`: a form of the page; back to it on success.
pub(crate) async fn kill(
    State(gw): State<Shared>,
    Extension(form): Extension<FormToken>,
    headers: HeaderMap,
    Form(f): Form<KillForm>,
) -> Response {
    act(&gw, form.matches(&headers, &f.csrf), &f, true).await
}

/// See [`kill`].
pub(crate) async fn lift(
    State(gw): State<Shared>,
    Extension(form): Extension<FormToken>,
    headers: HeaderMap,
    Form(f): Form<KillForm>,
) -> Response {
    act(&gw, form.matches(&headers, &f.csrf), &f, false).await
}

/// A form's change, made when its token is its session's (`token_ok`).
async fn act(gw: &Shared, token_ok: bool, f: &KillForm, kill: bool) -> Response {
    if !token_ok {
        return problem(
            StatusCode::FORBIDDEN,
            "The form's token is not this session's: reload the page and try again.",
        );
    }
    let target = f.target.trim();
    if !super::valid_target(target) {
        return problem(
            StatusCode::BAD_REQUEST,
            "Unknown target: use all, tenant:…, key:…, model:… or user:….",
        );
    }
    let reason = f.reason.trim();
    if kill && reason.is_empty() {
        return problem(
            StatusCode::BAD_REQUEST,
            "Say why the target is switched off.",
        );
    }
    if !kill {
        if let Err(e) = super::liftable(gw, target).await {
            return problem(e.status(), &e.message());
        }
    } else if let Some(e) = super::evicting(gw) {
        return problem(e.status(), &e.message());
    }
    match gw.store.set_kill(target, kill.then_some(reason)).await {
        Ok(()) => {
            super::kill_alert(gw, target, kill.then_some(reason));
            Redirect::to("/admin/ui").into_response()
        }
        Err(e @ tollgate_core::StoreError::NotReplicated(_)) => {
            super::kill_alert(gw, target, kill.then_some(reason));
            problem(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
        }
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("The store did not take it: {e}"),
        ),
    }
}

/// An error as a small HTML page, escaped like the page.
fn problem(status: StatusCode, message: &str) -> Response {
    #[derive(Template)]
    #[template(
        source = "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Tollgate</title></head><body><p id=\"problem\">{{ message }}</p><p><a href=\"/admin/ui\">Back to the status page</a></p></body></html>",
        ext = "html"
    )]
    struct Problem<'a> {
        message: &'a str,
    }
    let html = Problem { message }
        .render()
        .unwrap_or_else(|_| String::from("error"));
    html_response(status, html)
}

fn html_response(status: StatusCode, html: String) -> Response {
    let mut r = (status, html).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Nothing loads from elsewhere, nothing runs, forms post only here, no framing.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}
