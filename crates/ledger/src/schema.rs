//! The ledger's tables, brought up to date at start-up: each migration once, in order, in a
//! transaction of its own under an advisory lock.

use tokio_postgres::Client;

use crate::LedgerError;

/// Migrations in order; a released one is never edited, only followed by another.
const MIGRATIONS: &[&str] = &[
    // 1: endings, charges, kill switches.
    "CREATE TABLE tollgate_endings (
        request_id text PRIMARY KEY,
        ending text NOT NULL,
        at_ms bigint NOT NULL,
        tenant text,
        key_id text,
        model text,
        end_user text,
        input_tokens bigint NOT NULL,
        cached_tokens bigint NOT NULL,
        output_tokens bigint NOT NULL,
        tool_calls bigint NOT NULL,
        cost_micro_usd bigint,
        written_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX tollgate_endings_at ON tollgate_endings (at_ms);
    CREATE TABLE tollgate_charges (
        request_id text NOT NULL,
        scope text NOT NULL,
        label text NOT NULL,
        period_ms bigint NOT NULL,
        period_id bigint NOT NULL,
        period_start_ms bigint NOT NULL,
        period_end_ms bigint NOT NULL,
        unit text NOT NULL,
        amount bigint NOT NULL,
        PRIMARY KEY (request_id, scope, label)
    );
    CREATE INDEX tollgate_charges_period ON tollgate_charges (period_end_ms, scope);
    CREATE TABLE tollgate_kills (
        target text PRIMARY KEY,
        reason text NOT NULL,
        at_ms bigint NOT NULL
    );",
    // 2: a request's charges are written with its ending, and only when its ending is new
    // (one statement), so they need no key of their own: a third of a write's index work.
    "ALTER TABLE tollgate_charges DROP CONSTRAINT tollgate_charges_pkey;",
    // 3: virtual keys issued at run time, by the digest of their secret (never the secret).
    "CREATE TABLE tollgate_keys (
        digest text PRIMARY KEY,
        record text NOT NULL,
        at_ms bigint NOT NULL
    );",
    // 4: limits set at run time for one value, by scope and control.
    "CREATE TABLE tollgate_limits (
        field text PRIMARY KEY,
        record text NOT NULL,
        at_ms bigint NOT NULL
    );",
    // 5: an issued key is one record by its id, with a version every change raises (a
    // compare-and-set) and its secrets' digests; a revoked key keeps its record, without
    // secrets, so that nothing can bring one back. The records by digest are carried over.
    "CREATE TABLE tollgate_key_records (
        id text PRIMARY KEY,
        version bigint NOT NULL,
        record text NOT NULL,
        at_ms bigint NOT NULL
    );
    INSERT INTO tollgate_key_records (id, version, record, at_ms)
    SELECT k.id, 1,
        ((c.r - 'rotated') || jsonb_build_object('version', 1, 'change', 'carried-over',
            'secrets', k.secrets))::text,
        k.at_ms
    FROM (
        SELECT record::jsonb->>'id' AS id, max(at_ms) AS at_ms,
            jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
                'digest', digest,
                'since_ms', record::jsonb->'created_at_ms',
                'until_ms', CASE WHEN coalesce((record::jsonb->>'rotated')::boolean, false)
                    THEN record::jsonb->'expires_at_ms' END))) AS secrets
        FROM tollgate_keys GROUP BY 1
    ) k
    JOIN LATERAL (
        SELECT record::jsonb AS r FROM tollgate_keys WHERE record::jsonb->>'id' = k.id
        ORDER BY coalesce((record::jsonb->>'rotated')::boolean, false),
            (record::jsonb->>'created_at_ms')::bigint DESC
        LIMIT 1
    ) c ON true;
    DROP TABLE tollgate_keys;",
    // 6: per shard of the store, its write sequence's epoch and the highest sequence an
    // instance has seen, so that a restarted instance notices a store that went back in time.
    "CREATE TABLE tollgate_store_marks (
        shard integer PRIMARY KEY,
        epoch text NOT NULL,
        high bigint NOT NULL
    );",
];

/// An arbitrary constant: the advisory lock the migrations are run under.
const LOCK: i64 = 0x746f_6c6c_6761_7465;

pub(crate) async fn migrate(c: &Client) -> Result<(), LedgerError> {
    c.batch_execute(
        "CREATE TABLE IF NOT EXISTS tollgate_migrations (
            version int PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )",
    )
    .await?;
    for (i, sql) in MIGRATIONS.iter().enumerate() {
        let version = i32::try_from(i + 1).map_err(|e| LedgerError(e.to_string()))?;
        c.batch_execute("BEGIN").await?;
        let step = async {
            c.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
                .await?;
            let done = c
                .query_opt(
                    "SELECT 1 FROM tollgate_migrations WHERE version = $1",
                    &[&version],
                )
                .await?;
            if done.is_none() {
                c.batch_execute(sql).await?;
                c.execute(
                    "INSERT INTO tollgate_migrations (version) VALUES ($1)",
                    &[&version],
                )
                .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        };
        match step.await {
            Ok(()) => c.batch_execute("COMMIT").await?,
            Err(e) => {
                let _ = c.batch_execute("ROLLBACK").await;
                return Err(e.into());
            }
        }
    }
    Ok(())
}
