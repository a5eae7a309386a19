//! The conformance cases of agent operations: tool calls reserved and settled as a budget, and
//! repeats of one request refused after every other control.

use tollgate_core::{Decision, Dimension, Finish, Reason, RequestFacts, Store, Usage};

use super::{admit, budget_of, deny, leases_of, reason, settle, setup};
use crate::{Harness, facts, policy};

/// A round of operation `op`.
fn round(id: &str, op: &str) -> RequestFacts {
    let mut f = facts(id, "u", 10, 10);
    f.identity = f.identity.with(Dimension::Operation, op);
    f
}

/// A round with a fingerprint (the same request when the same `fp`).
fn same(id: &str, op: &str, fp: u64) -> RequestFacts {
    RequestFacts {
        fingerprint: Some(fp),
        ..round(id, op)
    }
}

fn calls(n: u64) -> Usage {
    Usage {
        input_tokens: 10,
        output_tokens: 5,
        tool_calls: n,
        ..Usage::default()
    }
}

const HOUR: tollgate_core::Period = tollgate_core::Period::Fixed(3_600_000);
const CALLS: &str = "calls|tenant:acme/operation:op1?tool_calls";

/// Each round reserves one tool call and settles the calls its answer made; the round after the
/// limit is reached is refused, and one round may go past it by what it emits.
pub async fn tool_calls_are_reserved_and_settled<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        name = "calls"
        key = "operation"
        tool_calls = { limit = 3, period = "1h" }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, round("a", "op1")).await, None);
    assert_eq!(budget_of(&s, CALLS, HOUR).await, (0, 1));
    assert_eq!(
        settle(&s, "a", calls(2)).await,
        Finish::Done { charged: vec![2] }
    );
    assert_eq!(budget_of(&s, CALLS, HOUR).await, (2, 0));
    // Two made, one reserved by a round in flight: the next round has none left.
    assert_eq!(reason(&s, &p, round("b", "op1")).await, None);
    let d = deny(&s, &p, round("c", "op1")).await;
    assert_eq!(d.reason, Reason::ToolCallLimit);
    assert_eq!((d.limit, d.remaining, d.requested), (3, 0, 1));
    assert_eq!(d.scope.key(), "tenant:acme/operation:op1");
    assert!(d.retry_after_ms.is_some());
    // The round in flight makes five calls: past the limit by what one round emitted.
    assert_eq!(
        settle(&s, "b", calls(5)).await,
        Finish::Done { charged: vec![5] }
    );
    assert_eq!(budget_of(&s, CALLS, HOUR).await, (7, 0));
    assert_eq!(
        reason(&s, &p, round("d", "op1")).await,
        Some(Reason::ToolCallLimit)
    );
    // Another operation has its own.
    assert_eq!(reason(&s, &p, round("e", "op2")).await, None);
    // Released without usage, a round is charged its reserved call (the default `full`).
    let r = s.release("e", None).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r, Finish::Done { charged: vec![1] });
}

/// A rule's budget and its tool calls are counters of their own, and the budget's refusal comes
/// first.
pub async fn tool_calls_come_after_the_budget<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        name = "calls"
        key = "operation"
        budget = { tokens = 30, period = "1h" }
        tool_calls = { limit = 1, period = "1h" }
        "#,
    );
    let (s, _) = setup(h).await;
    assert_eq!(reason(&s, &p, round("a", "op1")).await, None);
    assert_eq!(
        settle(&s, "a", calls(1)).await,
        Finish::Done {
            charged: vec![15, 1]
        }
    );
    let budget = "calls|tenant:acme/operation:op1";
    assert_eq!(budget_of(&s, budget, HOUR).await, (15, 0));
    assert_eq!(budget_of(&s, CALLS, HOUR).await, (1, 0));
    // A round reserves 20 tokens, and 15 are left: the budget refuses first, although the
    // calls are used up too.
    assert_eq!(
        reason(&s, &p, round("b", "op1")).await,
        Some(Reason::BudgetLimit)
    );
    let small = RequestFacts {
        input_tokens: 5,
        max_output_tokens: Some(5),
        ..round("c", "op1")
    };
    assert_eq!(reason(&s, &p, small).await, Some(Reason::ToolCallLimit));
}

/// The same request past `max_identical` within the window is refused `loop_detected`, after
/// every other control, taking nothing; a refused repeat still counts; the window passes.
pub async fn repeats_are_refused_last<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        name = "loops"
        key = "operation"
        concurrency = { limit = 2 }
        loops = { max_identical = 2, window = "1m" }
        "#,
    );
    let (s, clock) = setup(h).await;
    assert_eq!(reason(&s, &p, same("a", "op1", 7)).await, None);
    assert_eq!(reason(&s, &p, same("b", "op1", 7)).await, None);
    // Both leases held: the third identical request meets concurrency first.
    assert_eq!(
        reason(&s, &p, same("c", "op1", 7)).await,
        Some(Reason::ConcurrencyLimit)
    );
    settle(&s, "a", calls(0)).await;
    let d = deny(&s, &p, same("d", "op1", 7)).await;
    assert_eq!(d.reason, Reason::LoopDetected);
    assert_eq!(d.limit, 2);
    assert_eq!(d.scope.key(), "tenant:acme/operation:op1");
    // Refused by a repeat: nothing taken.
    assert_eq!(leases_of(&s, "loops|tenant:acme/operation:op1").await, 1);
    // Another request, or the same in another operation, is not a repeat.
    assert_eq!(reason(&s, &p, same("e", "op1", 8)).await, None);
    settle(&s, "e", calls(0)).await;
    assert_eq!(reason(&s, &p, same("f", "op2", 7)).await, None);
    // Once the window has passed (two windows: the sliding window weighs the previous one).
    clock.advance(120_001);
    assert_eq!(reason(&s, &p, same("g", "op1", 7)).await, None);
}

/// A history that holds one tool call more than `max_identical` times is refused
/// `loop_detected`, after the budgets, with the count; without a fingerprint no repeat is
/// counted.
pub async fn a_history_of_repeated_tool_calls_is_a_loop<H: Harness>(h: &H) {
    let p = policy(
        r#"
        [[scopes]]
        name = "loops"
        key = "operation"
        budget = { tokens = 45, period = "1h" }
        loops = { max_identical = 3, window = "1m" }
        "#,
    );
    let (s, _) = setup(h).await;
    let looping = |id: &str, n: u64| RequestFacts {
        tool_call_repeats: n,
        ..round(id, "op1")
    };
    assert_eq!(reason(&s, &p, looping("a", 3)).await, None);
    let d = deny(&s, &p, looping("b", 4)).await;
    assert_eq!(
        (d.reason, d.limit, d.requested),
        (Reason::LoopDetected, 3, 4)
    );
    assert_eq!(d.retry_after_ms, None);
    // Refused by its history: nothing reserved (20 of 45 held by "a").
    let budget = "loops|tenant:acme/operation:op1";
    assert_eq!(budget_of(&s, budget, HOUR).await, (0, 20));
    // A larger round (30 asked, 25 left) meets the budget first.
    let large = RequestFacts {
        max_output_tokens: Some(20),
        ..looping("c", 9)
    };
    assert_eq!(reason(&s, &p, large).await, Some(Reason::BudgetLimit));
    assert!(matches!(
        admit(&s, &p, looping("d", 0)).await,
        Decision::Admit(_)
    ));
}

fn key_use<'a>(key: &'a str, digest: &'a str, request_id: &'a str) -> tollgate_core::KeyUse<'a> {
    tollgate_core::KeyUse {
        key,
        digest,
        request_id,
        in_flight_ms: 60_000,
    }
}

async fn claim<S: Store>(s: &S, k: tollgate_core::KeyUse<'_>) -> tollgate_core::KeyClaim {
    s.claim_key(k)
        .await
        .unwrap_or_else(|e| panic!("claim: {e}"))
}

async fn end<S: Store>(s: &S, key: &str, id: &str, response: Option<&[u8]>) {
    s.end_claim(key, id, response, 60_000)
        .await
        .unwrap_or_else(|e| panic!("end claim: {e}"));
}

/// An idempotency key is claimed once: the same body again is in flight, another body a
/// conflict; once answered, its response is what a later use gets; only its claimant ends it,
/// once; a claim let go of, or unanswered past its in-flight time, frees the key.
pub async fn idempotency_keys_are_claimed_once<H: Harness>(h: &H) {
    use tollgate_core::KeyClaim;
    let (s, clock) = setup(h).await;
    assert_eq!(
        claim(&s, key_use("k1/a", "d1", "r1")).await,
        KeyClaim::Claimed
    );
    assert_eq!(
        claim(&s, key_use("k1/a", "d1", "r2")).await,
        KeyClaim::InFlight
    );
    assert_eq!(
        claim(&s, key_use("k1/a", "d2", "r3")).await,
        KeyClaim::Conflict
    );
    // Another request cannot end it.
    end(&s, "k1/a", "r2", Some(b"forged")).await;
    assert_eq!(
        claim(&s, key_use("k1/a", "d1", "r4")).await,
        KeyClaim::InFlight
    );
    let answer = b"{\"ok\":true}\xff (any bytes)";
    end(&s, "k1/a", "r1", Some(answer)).await;
    assert_eq!(
        claim(&s, key_use("k1/a", "d1", "r5")).await,
        KeyClaim::Answered(answer.to_vec())
    );
    assert_eq!(
        claim(&s, key_use("k1/a", "d2", "r6")).await,
        KeyClaim::Conflict
    );
    // Ended once: a second end changes nothing.
    end(&s, "k1/a", "r1", None).await;
    assert_eq!(
        claim(&s, key_use("k1/a", "d1", "r7")).await,
        KeyClaim::Answered(answer.to_vec())
    );
    // Let go of (refused, failed): the next use is a new request.
    assert_eq!(
        claim(&s, key_use("k1/b", "d1", "r8")).await,
        KeyClaim::Claimed
    );
    end(&s, "k1/b", "r8", None).await;
    assert_eq!(
        claim(&s, key_use("k1/b", "d9", "r9")).await,
        KeyClaim::Claimed
    );
    // Unanswered past its in-flight time (an instance that died): free again.
    let short = tollgate_core::KeyUse {
        in_flight_ms: 200,
        ..key_use("k1/c", "d1", "r10")
    };
    assert_eq!(claim(&s, short).await, KeyClaim::Claimed);
    clock.advance(400);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert_eq!(
        claim(&s, key_use("k1/c", "d1", "r11")).await,
        KeyClaim::Claimed
    );
}
