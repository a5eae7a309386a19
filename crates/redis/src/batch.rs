//! Batching: admissions and settlements that wait at the same moment travel in one script call
//! per shard (`batch.lua`), each applied as its own atomic transition, in order.

use crate::mark::Mark;
use std::sync::{Arc, OnceLock};

use redis::Value;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tollgate_core::{Clock, StoreError};

use crate::config::RedisConfig;
use crate::conn::{Conn, Function, fcall, no_answer, unavailable};
use crate::decode::{items, text};
use crate::encode::{Invocation, num};

/// Where one shard's admissions and settlements wait for a script call.
pub(crate) struct Lane {
    pub(crate) queue: OnceLock<mpsc::Sender<Job>>,
    /// Script calls in flight (`RedisConfig::batches_in_flight`), shared by the batch task and
    /// by callers that find the lane idle.
    pub(crate) slots: Arc<Semaphore>,
    /// The shard's prefix and the keys every call on it names.
    pub(crate) head: Arc<HeadKeys>,
}

impl Lane {
    fn new(config: &RedisConfig, prefix: &str) -> Self {
        Self {
            queue: OnceLock::new(),
            slots: Arc::new(Semaphore::new(config.batches_in_flight.max(1))),
            head: Arc::new(HeadKeys::new(prefix)),
        }
    }
}

pub(crate) fn lanes(config: &RedisConfig, shards: &[String]) -> Arc<[Lane]> {
    shards.iter().map(|p| Lane::new(config, p)).collect()
}

/// A shard's prefix and the five keys of its batch calls, made once per shard: a caller that
/// finds the lane idle makes a call of its own, and formatting them per call cost more than the
/// rest of the call's head.
pub(crate) struct HeadKeys {
    prefix: String,
    keys: [String; 6],
}

impl HeadKeys {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            keys: ["x", "clock", "kill", "marker", "lost", "seq"].map(|k| format!("{prefix}:{k}")),
        }
    }
}

/// An admission (`a`) or a settlement (`f`) waiting for a batch call.
pub(crate) struct Job {
    pub(crate) op: &'static str,
    pub(crate) inv: Invocation,
    pub(crate) reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// Collects waiting jobs into batch calls: takes the first, waits for a free call slot, then
/// takes whatever else has arrived meanwhile (up to `max_batch`).
pub(crate) async fn run_batches(
    mut rx: mpsc::Receiver<Job>,
    slots: Arc<Semaphore>,
    conn: Conn,
    config: Arc<RedisConfig>,
    marker: Arc<Mark>,
    head: Arc<HeadKeys>,
    clock: Option<Arc<dyn Clock>>,
) {
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut jobs = vec![first];
        while jobs.len() < config.max_batch.max(1) {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let (conn, config, head, marker) =
            (conn.clone(), config.clone(), head.clone(), marker.clone());
        let now = clock.as_ref().map_or(0, |c| c.now().max(1));
        tokio::spawn(async move {
            call_batch(conn, &config, &marker, &head, now, jobs).await;
            drop(permit);
        });
    }
}

/// The parts of a batch call that are not its items'.
pub(crate) struct BatchHead<'a> {
    keys: &'a HeadKeys,
    args: [String; 2],
    /// `1` the marker was seen, `0` not yet, `2` not yet and the prefix is new by the caller's
    /// word (see `batch.lua`), with the write sequence seen (`seq.lua`).
    marker: String,
}

impl<'a> BatchHead<'a> {
    fn new(keys: &'a HeadKeys, now: u64, retention_ms: u64, marker: String) -> Self {
        Self {
            keys,
            args: [num(now), num(retention_ms)],
            marker,
        }
    }

    /// KEYS and ARGV of the call, borrowed from the head, the items and their argument counts.
    fn layout(
        &'a self,
        items: &[(&'a str, &'a Invocation)],
        counts: &'a [String],
    ) -> (Vec<&'a str>, Vec<&'a str>) {
        let mut keys: Vec<&str> = self.keys.keys.iter().map(String::as_str).collect();
        let mut args: Vec<&str> = vec![self.keys.prefix.as_str()];
        args.extend(self.args.iter().map(String::as_str));
        args.push(&self.marker);
        for (&(op, inv), n) in items.iter().zip(counts) {
            keys.extend(inv.keys.iter());
            args.push(op);
            args.push(n);
            args.extend(inv.args.iter());
        }
        (keys, args)
    }
}

pub(crate) fn arg_counts(items: &[(&str, &Invocation)]) -> Vec<String> {
    items.iter().map(|(_, inv)| num(inv.args.len())).collect()
}

/// The KEYS and ARGV of one batch call: what `call_batch` sends.
pub fn batch_invocation<'a>(
    prefix: &str,
    now: u64,
    retention_ms: u64,
    marker_seen: bool,
    items: impl IntoIterator<Item = (&'a str, &'a Invocation)>,
) -> Invocation {
    let items: Vec<_> = items.into_iter().collect();
    let counts = arg_counts(&items);
    let keys = HeadKeys::new(prefix);
    let head = BatchHead::new(
        &keys,
        now,
        retention_ms,
        if marker_seen { "1" } else { "0" }.to_owned(),
    );
    let (keys, args) = head.layout(&items, &counts);
    Invocation {
        keys: keys.into_iter().collect(),
        args: args.into_iter().collect(),
    }
}

/// One batch call of these items: a reply per item, in order.
pub(crate) async fn call_items(
    mut conn: Conn,
    config: &RedisConfig,
    marker: &Mark,
    head: &HeadKeys,
    now: u64,
    parts: &[(&str, &Invocation)],
) -> Result<Vec<Value>, StoreError> {
    let counts = arg_counts(parts);
    let seen = marker.seen();
    let arg = match (seen, config.initialise_on_first_use) {
        (true, _) => "1",
        (false, true) => "2",
        (false, false) => "0",
    };
    let head = BatchHead::new(head, now, config.retention_ms, marker.arg(arg));
    let (keys, args) = head.layout(parts, &counts);
    // Callers stop waiting at their own timeout; this one only ends calls that never return.
    let replies = tokio::time::timeout(
        config.call_timeout.saturating_mul(4),
        fcall::<Value>(&mut conn, Function::Batch, &keys, &args),
    )
    .await
    .map_err(|_| no_answer(config.call_timeout))
    .and_then(|r| r.map_err(unavailable))
    .and_then(items)?;
    let mut replies = replies;
    let sequence = replies.pop();
    if replies.len() != parts.len() {
        return Err(StoreError::Protocol(format!(
            "{} replies to a batch of {}",
            replies.len(),
            parts.len()
        )));
    }
    let (epoch, n, why) = sequence_of(sequence)?;
    marker.saw(&epoch, n);
    marker.found(&why);
    let admitting = |op: &str| matches!(op, "a" | "p" | "s" | "S");
    if !seen
        && parts
            .iter()
            .zip(&replies)
            .any(|((op, _), r)| admitting(op) && !is_lost(r) && !is_uninitialised(r))
    {
        // An admission found the marker: from now on its absence is a loss.
        marker.set_seen();
    }
    Ok(replies)
}

/// A batch call's last reply: the store's write sequence and why it is lost, `{epoch, n, why}`
/// (`seq.lua`).
pub fn sequence_of(reply: Option<Value>) -> Result<(String, u64, String), StoreError> {
    let bad = || StoreError::Protocol("a batch call's reply ends without its sequence".into());
    let parts = items(reply.ok_or_else(bad)?)?;
    match parts.as_slice() {
        [epoch, n, why] => Ok((
            text(epoch)?,
            u64::try_from(crate::decode::int(n)?).map_err(|_| bad())?,
            text(why)?,
        )),
        _ => Err(bad()),
    }
}

/// Whether an item's reply is `{'lost'}`.
pub(crate) fn is_lost(v: &Value) -> bool {
    is_only(v, b"lost")
}

/// Whether an item's reply is `{'uninitialised'}`.
pub(crate) fn is_uninitialised(v: &Value) -> bool {
    is_only(v, b"uninitialised")
}

fn is_only(v: &Value, kind: &[u8]) -> bool {
    matches!(v, Value::Array(a) if a.len() == 1 && matches!(&a[0], Value::BulkString(b) if b == kind))
}

pub(crate) async fn call_batch(
    conn: Conn,
    config: &RedisConfig,
    marker: &Mark,
    head: &HeadKeys,
    now: u64,
    jobs: Vec<Job>,
) {
    let parts: Vec<(&str, &Invocation)> = jobs.iter().map(|j| (j.op, &j.inv)).collect();
    match call_items(conn, config, marker, head, now, &parts).await {
        Ok(replies) => {
            for (job, reply) in jobs.into_iter().zip(replies) {
                let _ = job.reply.send(item_reply(reply));
            }
        }
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
}

/// One item's reply; `{'error', message}` when its script step failed.
pub(crate) fn item_reply(v: Value) -> Result<Value, StoreError> {
    if let Value::Array(a) = &v {
        if a.len() == 2 && a.first().and_then(|k| text(k).ok()).as_deref() == Some("error") {
            let msg = a.get(1).and_then(|m| text(m).ok()).unwrap_or_default();
            return Err(StoreError::Protocol(msg));
        }
    }
    Ok(v)
}
