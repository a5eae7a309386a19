//! The store's replication history, read by the watch: a primary promoted from a replica whose
//! history stopped before what an instance had seen is a partial loss, whatever wrote the
//! missing part (the write sequence counts the scripts' writes only; an idempotency key's kept
//! answer or a note would go unseen by it).
//!
//! `INFO replication` names the primary's history (`master_replid`) and how far it goes
//! (`master_repl_offset`). A replica promoted keeps the history it followed as
//! `master_replid2`, up to `second_repl_offset - 1`. So after a change of history: the old one
//! continued up to or past what was seen is nothing lost; continued to less is a loss; not
//! continued at all (a restart, another server) says nothing by itself, and the marker and the
//! write sequence decide.

/// A history and how far an instance saw it go, in an epoch of the write sequence (a loss
/// acknowledged since, or a store rebuilt, starts another: what came before is settled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) id: String,
    pub(crate) offset: u64,
    pub(crate) epoch: String,
}

/// What `INFO replication` says of a primary's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Info {
    pub(crate) id: String,
    pub(crate) offset: u64,
    /// The history it followed before its promotion, and where its copy ended.
    pub(crate) before: Option<(String, u64)>,
}

pub(crate) fn parse(info: &str) -> Option<Info> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    if field("role")? != "master" {
        return None;
    }
    let number = |name: &str| field(name).and_then(|v| v.parse::<i64>().ok());
    let before = match (field("master_replid2"), number("second_repl_offset")) {
        (Some(id), Some(second)) if second > 0 && id.bytes().any(|b| b != b'0') => {
            Some((id.to_owned(), u64::try_from(second - 1).unwrap_or(0)))
        }
        _ => None,
    };
    Some(Info {
        id: field("master_replid")?.to_owned(),
        offset: u64::try_from(number("master_repl_offset")?).unwrap_or(0),
        before,
    })
}

/// What a new reading means against what was seen: the loss's words when the history was cut
/// short.
pub(crate) fn cut_short(seen: &Seen, now: &Info) -> Option<String> {
    if now.id == seen.id {
        return None;
    }
    match &now.before {
        Some((id, ended)) if *id == seen.id && *ended < seen.offset => {
            Some(format!("history {id} {ended} {}", seen.offset))
        }
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn info(id: &str, offset: u64, before: Option<(&str, i64)>) -> String {
        let (id2, second) = before.unwrap_or(("0000000000000000000000000000000000000000", -1));
        format!(
            "# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_replid:{id}\r\n\
             master_replid2:{id2}\r\nmaster_repl_offset:{offset}\r\nsecond_repl_offset:{second}\r\n"
        )
    }

    #[test]
    fn a_history_cut_short_is_a_loss_and_one_continued_is_not() {
        let seen = Seen {
            id: "a".repeat(40),
            offset: 5000,
            epoch: "e".into(),
        };
        let old = "a".repeat(40);
        let read = |s: &str| parse(s).unwrap();
        // The same history, further on.
        assert_eq!(cut_short(&seen, &read(&info(&old, 6000, None))), None);
        // Promoted from a replica that had it all.
        let caught_up = read(&info(&"b".repeat(40), 5100, Some((&old, 5001))));
        assert_eq!(cut_short(&seen, &caught_up), None);
        // Promoted from a replica that had it up to 4000.
        let lagged = read(&info(&"b".repeat(40), 4100, Some((&old, 4001))));
        assert_eq!(
            cut_short(&seen, &lagged),
            Some(format!("history {old} 4000 5000"))
        );
        // A restart: a new history that continues none (the marker and the sequence decide).
        assert_eq!(
            cut_short(&seen, &read(&info(&"c".repeat(40), 0, None))),
            None
        );
        // A replica is not read.
        assert_eq!(parse("role:slave\r\nmaster_replid:x\r\n"), None);
    }
}
