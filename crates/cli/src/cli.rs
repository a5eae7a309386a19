//! Command-line arguments.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Tollgate: admission control for LLM requests. `serve` runs the gateway (`serve --demo` tries
/// it at once); `admin` steers a running one; `check`, `count`, `hash-key` prepare its
/// configuration; `replay`, `whatif` and `spend` answer what a policy does and did.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a fixture of timed events through the real pipeline on two paths.
    Replay {
        /// The fixture (TOML).
        fixture: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
        /// The store: `memory` (default) or `redis://HOST:PORT[/DB]` (a fresh key prefix per run).
        #[arg(long, default_value = "memory")]
        store: String,
    },
    /// Hammer a Redis store with concurrent admissions and write a history (for the
    /// multi-process overshoot proof and fault tests).
    #[command(hide = true)]
    StressStore(crate::stress::StressArgs),
    /// Serve the OpenAI-compatible gateway.
    Serve {
        /// The configuration (TOML): listener, store, upstreams, keys, policy. Without it,
        /// give --demo.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Start with a built-in demo configuration and a simulated upstream.
        #[arg(long, conflicts_with = "config")]
        demo: bool,
        /// Listen here instead of the configured address (e.g. 127.0.0.1:0 for a free port).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Print the `sha256:` hash of an API key, for the `[[keys]]` table.
    HashKey {
        /// The key.
        key: String,
    },
    /// Count a request body's tokens the way the gateway will charge them.
    Count {
        /// The model whose tokenizer counts (replaces the body's `model`).
        #[arg(long)]
        model: Option<String>,
        /// The request body (JSON); standard input when absent.
        #[arg(long)]
        request: Option<PathBuf>,
        /// The body format; detected from its fields when absent.
        #[arg(long, value_enum)]
        format: Option<BodyFormat>,
        /// Count with this `tokenizer.json` (an open model's own tokenizer).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// Call a running gateway's admin API: status, usage, kill switches, reload.
    Admin(AdminArgs),
    /// Replay recorded decision records under another policy and report what it would change.
    Whatif {
        /// The decision records (JSON lines, as `[records] path` writes them).
        #[arg(long)]
        records: PathBuf,
        /// The policy to try: a policy file, or a gateway configuration with `[policy]`.
        #[arg(long)]
        policy: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
    },
    /// Spend from the ledger (`[ledger]`), summed by tenant, key, model, user or day.
    Spend {
        /// The ledger's URL, `postgres://…`.
        #[arg(
            long,
            conflicts_with = "ledger_env",
            required_unless_present = "ledger_env"
        )]
        ledger: Option<String>,
        /// The environment variable holding the ledger's URL, instead of `--ledger`.
        #[arg(long)]
        ledger_env: Option<String>,
        /// What to group by.
        #[arg(long, value_enum, default_value_t = SpendBy::Tenant)]
        by: SpendBy,
        /// From this UTC day or time, included (`2026-12-01`, `2026-12-01T08:00:00Z`).
        #[arg(long)]
        from: String,
        /// To this UTC day or time, excluded.
        #[arg(long)]
        to: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
        format: ReportFormat,
    },
    /// What a model costs and where each figure comes from (`prices MODEL`), or how two price
    /// catalogs differ (`prices diff A B`).
    #[command(args_conflicts_with_subcommands = true)]
    Prices {
        /// The model, as requests name it.
        model: Option<String>,
        /// A policy file, or a gateway configuration with `[policy]`, whose `[prices]` apply
        /// over the catalog.
        #[arg(long)]
        policy: Option<PathBuf>,
        /// `diff A B`.
        #[command(subcommand)]
        command: Option<PricesCommand>,
    },
    /// Validate a gateway configuration (what `serve --config` takes), a replay fixture or a
    /// policy file, without serving.
    Check {
        /// The configuration, fixture or policy (TOML); told apart by what it holds.
        #[arg(required_unless_present = "config", conflicts_with = "config")]
        file: Option<PathBuf>,
        /// The same, as an option (`check FILE` and `check --config FILE` are one).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

/// `tollgate prices` subcommands.
#[derive(Debug, Subcommand)]
pub enum PricesCommand {
    /// Every figure that differs between two catalogs (files in LiteLLM's
    /// `model_prices_and_context_window.json` format, or `builtin`).
    Diff {
        /// The catalog before.
        a: String,
        /// The catalog after.
        b: String,
    },
}

/// `tollgate admin`.
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    /// The admin listener, e.g. `http://127.0.0.1:8081` (every subcommand but `init-store
    /// --config` needs it).
    #[arg(long, env = "TOLLGATE_ADMIN_URL")]
    pub url: Option<String>,
    /// The environment variable that holds the admin token.
    #[arg(long, default_value = "TOLLGATE_ADMIN_TOKEN")]
    pub token_env: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// What to do.
    #[command(subcommand)]
    pub command: AdminCommand,
}

/// Admin subcommands.
#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The policy in force, the store's state, kill switches, requests in flight.
    Status,
    /// A scope's usage: settled, reserved, leases, and its budget.
    Usage {
        /// The scope's storage id, `rule|key`, e.g. `tenant|tenant:acme` (a rule's name alone
        /// for a rule without dimensions).
        #[arg(long)]
        scope: String,
        /// A UTC day or time in the period to show, answered from the spend ledger
        /// (`2026-11-30`); default the current period, from the store.
        #[arg(long)]
        at: Option<String>,
    },
    /// Switch a target off on every instance sharing the store.
    Kill {
        /// `all`, `tenant:<id>`, `key:<id>`, `model:<name>` or `user:<id>`.
        target: String,
        /// Shown to the clients refused.
        #[arg(long)]
        reason: String,
    },
    /// Switch a target on again.
    Lift {
        /// The target, as given to `kill`.
        target: String,
    },
    /// Read the configuration file again (the old one stays if the new one is invalid).
    Reload,
    /// Declare an empty store new and let admissions begin (refused when the spend ledger holds
    /// books, or when a loss is written down: an empty store that forgot is not new).
    InitStore {
        /// Initialise the store (and ask the ledger) this configuration names directly, without
        /// a running gateway: before the first start.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Accept that the store forgot its state: spent budgets and kill switches it held are
    /// gone, and admissions resume on every instance.
    AcknowledgeLoss,
    /// Limits set at run time for one value: set, list, clear.
    Limit {
        /// What to do.
        #[command(subcommand)]
        command: LimitCommand,
    },
    /// Virtual keys issued at run time: create, list, rotate, revoke.
    Keys {
        /// What to do.
        #[command(subcommand)]
        command: KeysCommand,
    },
}

/// `tollgate admin limit`.
#[derive(Debug, Subcommand)]
pub enum LimitCommand {
    /// Set, raise or lower one rule's limit for one value, e.g. `tenant:acme budget 50USD`.
    Set {
        /// `tenant:acme`, `key:vk_…`, `tenant:acme/user:alice`.
        value: String,
        /// `requests`, `concurrency`, `budget` or `tool_calls`.
        control: String,
        /// In the rule's unit: `50USD`, `$12.50`, `200000`, `120`.
        limit: String,
        /// The rule, when several are keyed on the value with the control.
        #[arg(long)]
        rule: Option<String>,
    },
    /// The limits set at run time.
    List,
    /// The rule's own limit again.
    Clear {
        /// As given to `set`.
        value: String,
        /// As given to `set`.
        control: String,
        /// As given to `set`.
        #[arg(long)]
        rule: Option<String>,
    },
}

/// `tollgate admin keys`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Issue a key; its secret is printed once.
    Create {
        /// Its tenant.
        #[arg(long)]
        tenant: String,
        /// A label (default: its id).
        #[arg(long)]
        name: Option<String>,
        /// A fixed end user.
        #[arg(long)]
        user: Option<String>,
        /// Let requests name their end user.
        #[arg(long)]
        allow_user: bool,
        /// A model it may use (repeat for more; default all).
        #[arg(long = "model")]
        models: Vec<String>,
        /// What it may do: `proxy` (default), `reservations` or `both`.
        #[arg(long)]
        uses: Option<String>,
        /// How long it lives, e.g. `30d`.
        #[arg(long, conflicts_with = "expires_at")]
        expires_in: Option<String>,
        /// When it stops working, RFC 3339 (UTC).
        #[arg(long)]
        expires_at: Option<String>,
        /// A label of your own, `name=value` (repeat for more).
        #[arg(long = "meta")]
        metadata: Vec<String>,
        /// A limit of its own, `control=limit` on the rule keyed on `key` (repeat for more),
        /// e.g. `requests=600` or `budget=10USD`.
        #[arg(long = "limit")]
        limits: Vec<String>,
    },
    /// The keys issued, without their secrets.
    List,
    /// A new secret for a key; the old one works for the grace period.
    Rotate {
        /// The key's id (`vk_…`).
        id: String,
        /// How long the old secret keeps working (default `1h`; `0s` for not at all).
        #[arg(long)]
        grace: Option<String>,
        /// Only from this version of the key (`keys list` shows it); another change made
        /// since refuses the rotation, which changes nothing.
        #[arg(long = "from-version")]
        from: Option<u64>,
    },
    /// Stop every secret of a key, on every instance.
    Revoke {
        /// The key's id (`vk_…`).
        id: String,
    },
}

/// Replay output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A table for people.
    Table,
    /// JSON for machines.
    Json,
}

/// What `spend` groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpendBy {
    /// Tenant.
    Tenant,
    /// Virtual key.
    Key,
    /// Model.
    Model,
    /// End user (digests).
    User,
    /// UTC day.
    Day,
}

/// Output formats of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    /// A table for people.
    Table,
    /// JSON for machines.
    Json,
    /// CSV for spreadsheets.
    Csv,
}

/// Request body formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BodyFormat {
    /// OpenAI chat completions (`messages`).
    Chat,
    /// OpenAI completions (`prompt`).
    Completions,
    /// OpenAI embeddings (`input`).
    Embeddings,
    /// Anthropic Messages (estimate).
    Anthropic,
    /// OpenAI Responses API (`input`, estimate; told from embeddings by `instructions`,
    /// `max_output_tokens`, `tools` or an input of items).
    Responses,
}
