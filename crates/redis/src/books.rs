//! What a spend ledger needs of the store: settled amounts added back when the books are
//! rebuilt, a loss acknowledged, and expiries. The sweep appends each expired request's
//! charges to the stream `P:expired` while `P:ledger` exists; an instance with a ledger reads
//! them, writes them, then deletes them. Two instances reading the same entries write them
//! twice, which the ledger's key on the request id makes harmless.

use redis::Value;
use tollgate_core::{Expiry, ExpiryCharge, Period, StoreError, Unit};

use crate::conn::{no_answer, unavailable};
use crate::decode::{items, text};
use crate::encode::key;
use crate::shards::shard_of;

/// Where an expiry is in the store, to delete it once written: (shard, stream entry id).
pub type ExpiryTag = (usize, String);

impl crate::store::RedisStore {
    /// [`tollgate_core::Store::usage`], and with `carry` (the cap and the limit),
    /// [`tollgate_core::Store::usage_carrying`] (`usage.lua`).
    pub(crate) fn usage_of(
        &self,
        scope_id: &str,
        period: Option<Period>,
        carry: Option<(u64, u64)>,
    ) -> impl std::future::Future<Output = Result<tollgate_core::ScopeUsage, StoreError>> + Send
    {
        use crate::encode::{Invocation, num, period_arg};
        let p = &self.shards[shard_of(scope_id, self.shards.len())];
        let (len, label) = period.map_or(("-1".to_owned(), String::new()), |per| {
            period_arg(per, self.wall_now())
        });
        let (cap, limit) = carry.unwrap_or((0, 0));
        let inv = Invocation::of(
            &[
                &key(p, "l", scope_id),
                &key(p, "b", scope_id),
                &format!("{p}:x"),
                &format!("{p}:clock"),
            ],
            &[
                p,
                &num(self.now_arg()),
                &len,
                &label,
                &num(self.config.retention_ms),
                &num(cap),
                &num(limit),
            ],
        );
        async move {
            let reply = self.call(crate::conn::Function::Usage, inv).await?;
            let n = |i: usize| {
                reply
                    .get(i)
                    .map(crate::decode::int)
                    .transpose()
                    .map(|v| v.unwrap_or(0).max(0) as u64)
            };
            Ok(tollgate_core::ScopeUsage {
                settled: n(0)?,
                reserved: n(1)?,
                leases: n(2)?,
                carried: n(3)?,
                at_ms: n(4)?,
            })
        }
    }

    /// Adds `amount` to what budget scope `scope_id` has settled in the period `field`
    /// (`<label>@<period id>`), kept until `expire_at_ms` (the period's end) plus the retention
    /// at least: the books rebuilt from a ledger, and charges of requests the store forgot.
    pub async fn add_settled(
        &self,
        scope_id: &str,
        field: &str,
        expire_at_ms: u64,
        amount: u64,
    ) -> Result<(), StoreError> {
        let p = &self.shards[shard_of(scope_id, self.shards.len())];
        let k = key(p, "b", scope_id);
        // A lifetime rather than an instant: counted on the clock admissions count by (the
        // store's, or the one the store was given), so that the cell outlives its period there.
        let keep = expire_at_ms
            .saturating_add(self.config.retention_ms)
            .saturating_sub(self.wall_now())
            .max(1);
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("HINCRBY")
            .arg(&k)
            .arg(format!("{field}:s"))
            .arg(amount)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&k)
            .arg(keep)
            .arg("NX")
            .ignore()
            .cmd("PEXPIRE")
            .arg(&k)
            .arg(keep)
            .arg("GT")
            .ignore();
        let mut conn = self.conn.clone();
        tokio::time::timeout(self.config.call_timeout, pipe.query_async::<()>(&mut conn))
            .await
            .map_err(|_| no_answer(self.config.call_timeout))?
            .map_err(unavailable)
    }

    /// Acknowledges that the store lost its state: the marker is written again and the loss
    /// forgotten, on every shard, so admissions resume from what the store holds now (spent
    /// budgets and kill switches it forgot are then gone for good). The store starts a new
    /// epoch of its write sequence: what instances saw of the old one no longer applies.
    pub async fn acknowledge_loss(&self) -> Result<(), StoreError> {
        let epoch = format!(
            "{}{:04}",
            self.wall_now().saturating_mul(1000),
            std::process::id() % 10_000
        );
        for p in self.shards.iter() {
            let mut conn = self.conn.clone();
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("DEL")
                .arg(format!("{p}:lost"))
                .ignore()
                .cmd("SET")
                .arg(format!("{p}:marker"))
                .arg(crate::mark::SCHEMA)
                .ignore()
                .cmd("HSET")
                .arg(format!("{p}:seq"))
                .arg("e")
                .arg(&epoch)
                .arg("n")
                .arg(0)
                .ignore();
            tokio::time::timeout(self.config.call_timeout, pipe.query_async::<()>(&mut conn))
                .await
                .map_err(|_| no_answer(self.config.call_timeout))?
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// Asks the scripts to keep expiries (writes `P:ledger` on every shard); again after a loss.
    pub async fn keep_expiries(&self) -> Result<(), StoreError> {
        for p in self.shards.iter() {
            let mut conn = self.conn.clone();
            redis::cmd("SET")
                .arg(format!("{p}:ledger"))
                .arg("1")
                .query_async::<()>(&mut conn)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// Up to `max` expiries per shard, oldest first.
    pub async fn expiries(&self, max: usize) -> Result<Vec<(ExpiryTag, Expiry)>, StoreError> {
        let mut out = Vec::new();
        for (shard, p) in self.shards.iter().enumerate() {
            let mut conn = self.conn.clone();
            let reply: Value = redis::cmd("XRANGE")
                .arg(format!("{p}:expired"))
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(max)
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            for (id, e) in decode(p, reply)? {
                out.push(((shard, id), e));
            }
        }
        Ok(out)
    }

    /// Deletes expiries written to the ledger.
    pub async fn ack_expiries(&self, tags: &[ExpiryTag]) -> Result<(), StoreError> {
        for (shard, p) in self.shards.iter().enumerate() {
            let ids: Vec<&str> = tags
                .iter()
                .filter(|(s, _)| *s == shard)
                .map(|(_, id)| id.as_str())
                .collect();
            if ids.is_empty() {
                continue;
            }
            let mut conn = self.conn.clone();
            redis::cmd("XDEL")
                .arg(format!("{p}:expired"))
                .arg(&ids)
                .query_async::<()>(&mut conn)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }
}

/// An `XRANGE` reply of `P:expired` (shard prefix `prefix`) as expiries; a malformed entry is
/// a protocol error, never a guess.
pub fn decode(prefix: &str, reply: Value) -> Result<Vec<(String, Expiry)>, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("expiry stream: {what}"));
    let mut out = Vec::new();
    for entry in items(reply)? {
        let mut parts = items(entry)?.into_iter();
        let (Some(id), Some(fields), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("an entry is not [id, fields]"));
        };
        let id = text(&id)?;
        let fields: Vec<String> = items(fields)?.iter().map(text).collect::<Result<_, _>>()?;
        if fields.len() < 4 || fields.len() % 2 != 0 || (fields.len() - 4) % 10 != 0 {
            return Err(bad("wrong number of fields"));
        }
        if fields[0] != "id" || fields[2] != "at" {
            return Err(bad("id and at first"));
        }
        let at = fields[3].parse().map_err(|_| bad("at is not a time"))?;
        let mut charges = Vec::new();
        for c in fields[4..].chunks(10) {
            if [&c[0], &c[2], &c[4], &c[6], &c[8]] != ["k", "f", "u", "l", "c"] {
                return Err(bad("a charge's fields are k, f, u, l, c"));
            }
            charges.push(
                charge(prefix, &c[1], &c[3], &c[5], &c[7], &c[9])
                    .ok_or_else(|| bad("a charge's values"))?,
            );
        }
        out.push((
            id,
            Expiry {
                request_id: fields[1].clone(),
                at,
                charges,
            },
        ));
    }
    Ok(out)
}

fn charge(
    prefix: &str,
    key: &str,
    field: &str,
    unit: &str,
    len: &str,
    amount: &str,
) -> Option<ExpiryCharge> {
    let scope = key.strip_prefix(prefix)?.strip_prefix(":b:")?;
    let (label, period_id) = field.rsplit_once('@')?;
    // Named by its label: a calendar period's length argument is the starts it was given.
    let period = Period::from_label(label).or_else(|| match len.parse::<u64>().ok()? {
        0 => Some(Period::CalendarMonth),
        n => Some(Period::Fixed(n)),
    })?;
    let unit = match unit.as_bytes().first()? {
        b't' => Unit::Tokens,
        b'm' => Unit::MicroUsd,
        b'c' => Unit::ToolCalls,
        _ => return None,
    };
    Some(ExpiryCharge {
        scope: scope.to_owned(),
        period,
        period_id: period_id.parse().ok()?,
        unit,
        amount: amount.parse().ok()?,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn entry(fields: &[&str]) -> Value {
        Value::Array(vec![
            bulk("1-0"),
            Value::Array(fields.iter().map(|f| bulk(f)).collect()),
        ])
    }

    #[test]
    fn entries_decode_and_malformed_ones_are_refused() {
        let good = entry(&[
            "id",
            "r1",
            "at",
            "1000",
            "k",
            "P:b:tenant|tenant:a",
            "f",
            "fixed:86400000@20454",
            "u",
            "t",
            "l",
            "86400000",
            "c",
            "60",
        ]);
        let got = decode("P", Value::Array(vec![good])).unwrap();
        assert_eq!(got[0].1.request_id, "r1");
        assert_eq!(
            got[0].1.charges,
            vec![ExpiryCharge {
                scope: "tenant|tenant:a".into(),
                period: Period::Fixed(86_400_000),
                period_id: 20454,
                unit: Unit::Tokens,
                amount: 60
            }]
        );
        for bad in [
            entry(&["id", "r1"]),
            entry(&["id", "r1", "at", "x"]),
            entry(&[
                "id", "r1", "at", "1", "k", "Q:b:x", "f", "d@1", "u", "t", "l", "1", "c", "1",
            ]),
            entry(&[
                "id", "r1", "at", "1", "k", "P:b:x", "f", "d@1", "u", "z", "l", "1", "c", "1",
            ]),
            entry(&[
                "id", "r1", "at", "1", "k", "P:b:x", "f", "d@1", "u", "t", "l", "1", "c", "-1",
            ]),
            Value::Array(vec![Value::Int(3)]),
        ] {
            assert!(decode("P", Value::Array(vec![bad])).is_err());
        }
    }
}
