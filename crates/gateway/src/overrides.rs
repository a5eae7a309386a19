//! Limits set at run time for one value: a rule's limit for one tenant, key, user (any scope the
//! rule keys), set, raised or lowered through the admin API without a reload. An override
//! replaces that rule's limit for that scope only; every other rule still applies, so a tighter
//! rule elsewhere still refuses. Kept like issued keys (the store, the ledger, every instance
//! within the key refresh interval), and named in the decision records of the requests it
//! decided, with its revision.

use std::collections::HashMap;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};
use tollgate_core::controls::reserve;
use tollgate_core::pipeline::{Kind, Plan};
use tollgate_core::policy::ScopeRule;
use tollgate_core::{Dimension, Identity, Policy, Reason, ScopeKey, Unit};

/// The controls an override can set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Control {
    /// Attempts per the rule's window.
    Requests,
    /// Requests at once.
    Concurrency,
    /// The budget per the rule's period, in its unit.
    Budget,
    /// Tool calls per the rule's period.
    ToolCalls,
}

impl Control {
    /// Its name, as the API and the CLI write it.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "requests" => Control::Requests,
            "concurrency" => Control::Concurrency,
            "budget" => Control::Budget,
            "tool_calls" => Control::ToolCalls,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Control::Requests => "requests",
            Control::Concurrency => "concurrency",
            Control::Budget => "budget",
            Control::ToolCalls => "tool_calls",
        }
    }

    /// The rule's own limit of this control, if it holds the control.
    pub fn default_of(self, rule: &ScopeRule) -> Option<u64> {
        match self {
            Control::Requests => rule.requests.map(|r| r.limit.get()),
            Control::Concurrency => rule.concurrency.map(|c| c.limit.get()),
            Control::Budget => rule.budget.map(|b| b.limit.get()),
            Control::ToolCalls => rule.tool_calls.map(|b| b.limit.get()),
        }
    }
}

/// Who set a limit: the layers a scope's limit is made of, each only tightening the one above
/// it (the file's rule, then the operator's, then the tenant's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// The operator (the admin token): any limit, in place of the rule's.
    #[default]
    Operator,
    /// The tenant (its own token): at most the limit the layers above set.
    Tenant,
}

impl Layer {
    /// Its name, as the API writes it.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "operator" => Some(Layer::Operator),
            "tenant" => Some(Layer::Tenant),
            _ => None,
        }
    }
}

/// One limit set for one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Override {
    /// The rule.
    pub rule: String,
    /// The scope's storage id (`rule|tenant:acme`).
    pub scope: String,
    /// The control.
    pub control: Control,
    /// The limit, in the rule's unit for the control.
    pub limit: u64,
    /// How many times this scope's control has been set (1 the first time).
    pub revision: u64,
    /// When it was last set (ms since the epoch).
    pub set_at_ms: u64,
    /// Who set it.
    #[serde(default)]
    pub layer: Layer,
}

impl Override {
    /// Where it is kept: its scope, control and layer.
    pub fn field(&self) -> String {
        field(&self.scope, self.control, self.layer)
    }

    /// How a decision record names it.
    fn named(&self) -> String {
        let by = match self.layer {
            Layer::Operator => "",
            Layer::Tenant => "~tenant",
        };
        format!(
            "{}#{}{by}@{}",
            self.scope,
            self.control.name(),
            self.revision
        )
    }
}

/// Where the override of `control` in scope `scope` set by `layer` is kept.
pub fn field(scope: &str, control: Control, layer: Layer) -> String {
    match layer {
        Layer::Operator => format!("{scope}#{}", control.name()),
        Layer::Tenant => format!("{scope}#{}~tenant", control.name()),
    }
}

/// The overrides this instance knows.
#[derive(Debug, Default)]
pub struct Overrides {
    table: RwLock<(u64, HashMap<String, Override>)>,
    /// The store missed a change the ledger took: its set is written again from the ledger.
    pub(crate) behind: std::sync::atomic::AtomicBool,
    /// Raised by every change applied here: a read of the store begun before one does not
    /// replace it.
    generation: std::sync::atomic::AtomicU64,
}

impl Overrides {
    /// The override of `control` in scope `scope` set by `layer`, if one is set.
    pub fn get(&self, scope: &str, control: Control, layer: Layer) -> Option<Override> {
        let t = self.table.read().ok()?;
        t.1.get(&field(scope, control, layer)).cloned()
    }

    /// The limit the layers above the tenant's set for `control` in `scope`: the operator's,
    /// else the rule's own (`rule`).
    pub fn above_tenant(&self, scope: &str, control: Control, rule: u64) -> u64 {
        self.get(scope, control, Layer::Operator)
            .map_or(rule, |o| o.limit)
    }

    /// The limit in force for `control` in `scope` whose rule's own is `rule`: every layer's.
    pub fn in_force(&self, scope: &str, control: Control, rule: u64) -> u64 {
        let above = self.above_tenant(scope, control, rule);
        self.get(scope, control, Layer::Tenant)
            .map_or(above, |t| t.limit.min(above))
    }

    /// Every override, by scope.
    pub fn list(&self) -> Vec<Override> {
        let mut all: Vec<Override> = self
            .table
            .read()
            .map(|t| t.1.values().cloned().collect())
            .unwrap_or_default();
        all.sort_by_key(Override::field);
        all
    }

    /// The version of the store's set this table was read at.
    pub fn version(&self) -> u64 {
        self.table.read().map_or(0, |t| t.0)
    }

    /// What [`Overrides::replace`] is given, read when the read of the store begins.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Replaces the table with `entries` (field, record JSON) at `version`, unless a change was
    /// applied here since `generation` (the next refresh reads again).
    pub fn replace(&self, generation: u64, version: u64, entries: &[(String, String)]) {
        let mut map = HashMap::with_capacity(entries.len());
        for (f, json) in entries {
            match serde_json::from_str::<Override>(json) {
                Ok(o) => {
                    map.insert(f.clone(), o);
                }
                Err(e) => tracing::warn!(cause = %e, "a limit override cannot be read: skipped"),
            }
        }
        if let Ok(mut t) = self.table.write() {
            if self.generation() == generation {
                *t = (version, map);
            }
        }
    }

    /// Applies changes made on this instance at once (others read them from the store).
    pub fn apply_locally(&self, changes: &[(String, Option<String>)]) {
        let Ok(mut t) = self.table.write() else {
            return;
        };
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        t.0 += 1;
        for (f, json) in changes {
            match json.as_deref().map(serde_json::from_str::<Override>) {
                Some(Ok(o)) => {
                    t.1.insert(f.clone(), o);
                }
                _ => {
                    t.1.remove(f);
                }
            }
        }
    }

    /// Puts the overrides that concern `plan`'s checks in place of their rules' limits, and
    /// names them in its policy version (so in its decision record).
    pub fn apply(&self, plan: &mut Plan) {
        let Ok(t) = self.table.read() else {
            return;
        };
        if t.1.is_empty() {
            return;
        }
        let mut used: Vec<String> = Vec::new();
        // The operator's layer in place of the rule's, then the tenant's under it.
        let mut set = |scope: &ScopeKey, control: Control| {
            // A tool-call budget is kept in a child of its rule's scope.
            let id = scope.id().split('?').next().unwrap_or_default();
            let op = t.1.get(&field(id, control, Layer::Operator));
            let tenant = t.1.get(&field(id, control, Layer::Tenant));
            used.extend(op.into_iter().chain(tenant).map(Override::named));
            match (op, tenant) {
                (None, None) => None,
                (op, tenant) => Some((op.map(|o| o.limit), tenant.map(|o| o.limit))),
            }
        };
        let layered = |rule: u64, (op, tenant): (Option<u64>, Option<u64>)| {
            let above = op.unwrap_or(rule);
            tenant.map_or(above, |t| t.min(above))
        };
        // By control: a loop's repeat counter is a count too, and a reserve's lease is
        // concurrency's with the reserved share kept off the limit set.
        for c in &mut plan.checks {
            match (&mut c.kind, c.reason.control()) {
                (Kind::Count(r) | Kind::Peek(r), Reason::RequestRateLimit) => {
                    if let Some(l) = set(&r.scope, Control::Requests) {
                        r.limit = layered(r.limit, l);
                    }
                }
                (Kind::Lease(l), Reason::ConcurrencyLimit) => {
                    if let Some((op, tenant)) = set(&l.scope, Control::Concurrency) {
                        // The lease's limit is the open share of the rule's; a layer sets the
                        // whole, whose open share it takes (the share grows with the whole).
                        let open = |n: u64| reserve::open(n, l.kept_percent);
                        let above = op.map_or(l.limit, open);
                        l.limit = tenant.map_or(above, |t| open(t).min(above));
                    }
                }
                (Kind::Reserve(b), _) => {
                    let control = match b.unit {
                        Unit::ToolCalls => Control::ToolCalls,
                        Unit::Tokens | Unit::MicroUsd => Control::Budget,
                    };
                    if let Some(l) = set(&b.scope, control) {
                        b.limit = layered(b.limit, l);
                    }
                }
                _ => {}
            }
        }
        if !used.is_empty() {
            plan.policy_version = format!("{}+{}", plan.policy_version, used.join("+")).into();
        }
    }
}

/// The rule and scope a value names (`tenant:acme`, `tenant:acme/user:alice`) for `control`:
/// the rule named, or the one rule keyed on exactly those dimensions that holds the control.
pub fn resolve<'p>(
    policy: &'p Policy,
    value: &str,
    control: Control,
    rule: Option<&str>,
) -> Result<(&'p ScopeRule, ScopeKey), String> {
    let mut identity = Identity::default();
    let mut dims = Vec::new();
    for part in value.split('/') {
        let (d, v) = part.split_once(':').ok_or_else(|| {
            format!("value {value:?}: expected dimension:value, e.g. tenant:acme")
        })?;
        let d =
            Dimension::parse(d).ok_or_else(|| format!("value {value:?}: no dimension {d:?}"))?;
        if v.is_empty() || v.len() > 256 {
            return Err(format!("value {value:?}: {d:?} must be 1 to 256 bytes"));
        }
        identity = identity.with(d, v.to_owned());
        dims.push(d);
    }
    dims.sort();
    let fits = |r: &&ScopeRule| {
        let mut own = r.dims.clone();
        own.sort();
        // A user's scope is inside its tenant (`tenant:acme/user:alice` for `key = "user"`):
        // the value names the tenant too.
        let mut named = dims.clone();
        if own.contains(&Dimension::User) && !own.contains(&Dimension::Tenant) {
            named.retain(|d| *d != Dimension::Tenant);
        }
        !r.shadow
            && own == named
            && control.default_of(r).is_some()
            && r.matches
                .iter()
                .all(|(d, v)| identity.get(*d) == Some(v.as_str()))
    };
    let candidates: Vec<&ScopeRule> = policy.scopes.iter().filter(fits).collect();
    let chosen = match (rule, candidates.as_slice()) {
        (Some(name), _) => candidates
            .iter()
            .find(|r| &*r.name == name)
            .copied()
            .ok_or_else(|| {
                format!(
                    "rule {name:?} is not keyed on {value:?} with {} (rules that are: {})",
                    control.name(),
                    names(&candidates)
                )
            })?,
        (None, [one]) => *one,
        (None, []) => {
            return Err(format!(
                "no rule keyed on {value:?} holds {}",
                control.name()
            ));
        }
        (None, many) => {
            return Err(format!(
                "several rules are keyed on {value:?} with {}: name one with rule ({})",
                control.name(),
                names(many)
            ));
        }
    };
    let key = ScopeKey::derive_in(&chosen.name, &chosen.dims, &identity, chosen.ip_prefix)
        .ok_or_else(|| format!("value {value:?} does not name every dimension of its rule"))?;
    Ok((chosen, key))
}

fn names(rules: &[&ScopeRule]) -> String {
    let n: Vec<&str> = rules.iter().map(|r| &*r.name).collect();
    if n.is_empty() {
        "none".to_owned()
    } else {
        n.join(", ")
    }
}

/// A limit as written (`50USD`, `$12.50`, `5000000`, `120/1m`), in `rule`'s unit for `control`.
/// A period or window after `/` must be the rule's own: an override sets a limit, not a period.
pub fn amount(rule: &ScopeRule, control: Control, text: &str) -> Result<u64, String> {
    let (number, per) = match text.split_once('/') {
        Some((n, p)) => (n.trim(), Some(p.trim())),
        None => (text.trim(), None),
    };
    let (unit, own_per) = match control {
        Control::Requests => (None, rule.requests.map(|r| r.window_ms.get())),
        Control::Concurrency => (None, None),
        Control::Budget => (
            rule.budget.map(|b| b.unit),
            rule.budget.and_then(|b| fixed_ms(b.period)),
        ),
        Control::ToolCalls => (None, rule.tool_calls.and_then(|b| fixed_ms(b.period))),
    };
    if let Some(p) = per {
        let asked = match p {
            "day" => Some(86_400_000),
            "month" => None,
            other => Some(
                humantime::parse_duration(other)
                    .map_err(|e| format!("{text:?}: {other:?} is not a period: {e}"))?
                    .as_millis() as u64,
            ),
        };
        if asked != own_per || (control == Control::Concurrency) {
            return Err(format!(
                "{text:?}: the rule {:?} keeps its own window or period; an override sets its limit only",
                rule.name
            ));
        }
    }
    let n = match unit {
        Some(Unit::MicroUsd) => dollars(number)
            .ok_or_else(|| format!("{text:?}: expected dollars, e.g. 50USD or $12.50"))?,
        _ => number
            .trim_end_matches("tokens")
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("{text:?}: expected a whole number"))?,
    };
    if n == 0 {
        return Err(format!(
            "{text:?}: a limit of 0; use a kill switch to stop a target"
        ));
    }
    Ok(n)
}

fn fixed_ms(p: tollgate_core::Period) -> Option<u64> {
    match p {
        tollgate_core::Period::Fixed(ms) => Some(ms),
        tollgate_core::Period::CalendarMonth | tollgate_core::Period::Calendar(_) => None,
    }
}

/// `50USD`, `50 usd`, `$12.50`, or micro-USD as a whole number: micro-USD.
fn dollars(s: &str) -> Option<u64> {
    tollgate_core::ledger::micro_usd(s).or_else(|| s.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits set at run time change their own controls' checks only: a loop's repeat counter
    /// (a count in a child of the scope) keeps its limit when the scope's request rate is set,
    /// and a reserve keeps its share of a concurrency limit set.
    #[test]
    fn an_override_changes_its_own_control_only() {
        let policy = Policy::from_toml(
            "[classes.critical]\nweight = 4\n[[scopes]]\nname = \"t\"\nkey = \"tenant\"\n\
             requests = { limit = 5, window = \"1m\" }\nconcurrency = { limit = 10 }\n\
             reserve = { critical = \"20%\" }\nloops = { max_identical = 3, window = \"1m\" }\n",
        )
        .unwrap_or_else(|e| unreachable!("{e}"));
        let facts = tollgate_core::RequestFacts {
            request_id: "r".into(),
            identity: Identity::default().with(Dimension::Tenant, "acme"),
            fingerprint: Some(7),
            ..Default::default()
        };
        let mut plan = tollgate_core::plan(&policy, &facts).unwrap_or_else(|e| unreachable!("{e}"));
        let scope = plan.checks[0]
            .scope()
            .map(|s| s.id().to_owned())
            .unwrap_or_default();
        let o = Overrides::default();
        let entries: Vec<(String, String)> = [(Control::Requests, 50), (Control::Concurrency, 100)]
            .into_iter()
            .map(|(control, limit)| {
                let o = Override {
                    rule: "t".into(),
                    scope: scope.clone(),
                    control,
                    limit,
                    revision: 1,
                    set_at_ms: 0,
                    layer: Layer::Operator,
                };
                (o.field(), serde_json::to_string(&o).unwrap_or_default())
            })
            .collect();
        o.replace(0, 1, &entries);
        o.apply(&mut plan);
        let limits: Vec<(Reason, u64)> = plan
            .checks
            .iter()
            .filter_map(|c| match &c.kind {
                Kind::Count(r) => Some((c.reason, r.limit)),
                Kind::Lease(l) => Some((c.reason, l.limit)),
                _ => None,
            })
            .collect();
        assert_eq!(
            limits,
            [
                (Reason::RequestRateLimit, 50),
                (Reason::CapacityReserved, 80),
                (Reason::LoopDetected, 3),
            ]
        );
    }

    #[test]
    fn dollars_are_read_to_the_micro() {
        assert_eq!(dollars("50USD"), Some(50_000_000));
        assert_eq!(dollars("$12.50"), Some(12_500_000));
        assert_eq!(dollars("0.000001 usd"), Some(1));
        assert_eq!(dollars("1.0000001usd"), None);
        assert_eq!(dollars("7"), Some(7));
        assert_eq!(dollars("$x"), None);
        assert_eq!(dollars("$99999999999999999999"), None);
    }
}
