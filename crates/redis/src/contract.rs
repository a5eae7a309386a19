// The named contract between the Rust side and the scripts: the layout of every argument list
// an admission or a settlement sends and of every reply that carries more than its kind (every
// reply begins with its kind), one table, read twice. The encoder writes each list in
// its table's order, by name (`encode.rs`); the build script (`build.rs`, which includes this
// file) replaces every `@layout.field` in the Lua sources with the field's offset and every
// `@layout#` with the layout's length, and fails the build on a name the table lacks. So a
// field added, moved or renamed here moves on both sides at once.
//
// This file is included by the build script as well: it holds the tables and the schema, and
// nothing else.

/// The schema of what the scripts keep under a prefix, written as its marker's value: an
/// instance of another schema refuses to start on the prefix. It is the one version the
/// scripts and the Rust side share: the build writes it into the scripts (`@schema`), and it
/// changes, by hand and only here, when the meaning or layout of a kept key changes. The
/// library's name is a hash of its text, made by the build, so a change of code alone needs no
/// new schema (`docs/redis.md`).
pub const SCHEMA: &str = "7.6";

macro_rules! layouts {
    ($($(#[$doc:meta])* $ty:ident $lua:literal { $($field:ident $name:literal),+ $(,)? })+) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            #[allow(dead_code)]
            pub enum $ty { $($field),+ }

            #[allow(dead_code)]
            impl $ty {
                /// The layout's name in the scripts (`@name.field`).
                pub const LUA: &'static str = $lua;
                /// Every field, in the order sent.
                pub const ALL: &'static [$ty] = &[$($ty::$field),+];
                /// The fields' names in the scripts, in the order sent.
                pub const NAMES: &'static [&'static str] = &[$($name),+];
                /// How many arguments the layout takes.
                pub const LEN: usize = Self::NAMES.len();
                /// The field's offset from the layout's first argument.
                pub const fn at(self) -> usize {
                    self as usize
                }
            }
        )+

        /// Every layout: its name in the scripts and its fields' names, in order.
        #[allow(dead_code)]
        pub const LAYOUTS: &[(&str, &[&str])] = &[$(($lua, $ty::NAMES)),+];
    };
}

layouts! {
    /// An admission's header (`admit_one`), before its kill-switch targets and its checks.
    Admit "admit" {
        Id "id",
        Ttl "ttl",
        Retention "retention",
        NCheck "n_check",
        PriceInput "price_input",
        PriceCached "price_cached",
        PriceOutput "price_output",
        ExpiredInput "expired_input",
        ExpiredCached "expired_cached",
        ExpiredOutput "expired_output",
        Size "size",
        NKill "n_kill",
    }
    /// A shadow plan's header (`admit_shadowed`): its checks' number, nothing for a ticket.
    Shadow "shadow" {
        NCheck "n_check",
    }
    /// Each check of an admission, in the plan's order: what the store does (`r`: count,
    /// `k`: a count already counted, `l`: lease, `b`: reserve, `v`: verdict); then the kind's
    /// layout (`rate` for `r` and `k`, `lease`, `budget`; none for a verdict). Its reason stays
    /// on the Rust side: a refusal names its check by its place.
    Check "check" {
        Kind "kind",
    }
    /// A count's scope.
    RateScope "rate" {
        Key "key",
        Limit "limit",
        Window "window",
    }
    /// A lease's scope.
    LeaseScope "lease" {
        Key "key",
        Limit "limit",
    }
    /// A reservation's scope.
    BudgetScope "budget" {
        Key "key",
        Limit "limit",
        Unit "unit",
        PeriodLen "period_len",
        Label "label",
        Amount "amount",
        Carry "carry",
    }
    /// An admission's refusal by one of its checks (`deny` in `ledger.lua`): the reply's
    /// kind, the check's place in the plan, what is left, the wait (-1: none) and the time to
    /// the reset (-1: none).
    DenyReply "deny" {
        Kind "kind",
        Check "check",
        Remaining "remaining",
        RetryAfter "retry_after",
        Reset "reset",
    }
    /// An admission's answer when it admits (`admit_one`): its kind and when its holds expire;
    /// then one `quota` per check, in the plan's order.
    AdmitReply "admitted" {
        Kind "kind",
        ExpiresAt "expires_at",
    }
    /// What a check of an admitted request has left, and the time to its window's or period's
    /// reset (-1: none).
    Quota "quota" {
        Remaining "remaining",
        Reset "reset",
    }
    /// An admission refused by a kill switch: the target switched off and the reason given.
    KilledReply "killed" {
        Kind "kind",
        Target "target",
        Reason "reason",
    }
    /// A renewal that renewed: the leases' and reservation's new expiry.
    Renewed "renewed" {
        Kind "kind",
        ExpiresAt "expires_at",
    }
    /// A settlement or release of a request that had ended already: how it ended.
    EndedReply "ended" {
        Kind "kind",
        How "how",
    }
    /// A settlement or release that ended its request: its kind, then what each budget and
    /// tool-call scope was charged, in the plan's order.
    DoneReply "done" {
        Kind "kind",
    }
    /// A slice exchange's header (`slice_orders` in `slices.lua`, op `S`): the divisor of a
    /// grant and whether the kill switches are to be answered (0/1); then the orders, each its
    /// kind (`r`, `l`, `b`) and its layout.
    SliceHeader "slices" {
        Divisor "divisor",
        Kills "kills",
    }
    /// A rate slice's order: take up to `take` attempts ahead, after giving back `back` counted
    /// in the window that started at `back_start`.
    RateOrder "rate_order" {
        Key "key",
        Limit "limit",
        Window "window",
        Take "take",
        Back "back",
        BackStart "back_start",
    }
    /// A lease slice's order: hold `slots` slots until `ttl` from now (`create`: 0/1).
    LeaseOrder "lease_order" {
        Slice "slice",
        Key "key",
        Limit "limit",
        Slots "slots",
        Ttl "ttl",
        Create "create",
    }
    /// A budget slice's order: charge what was settled in all since the last report, keep at
    /// least `keep` reserved, and hold `amount` (`create`: 0/1).
    BudgetOrder "budget_order" {
        Slice "slice",
        Key "key",
        Limit "limit",
        Unit "unit",
        PeriodLen "period_len",
        Label "label",
        PeriodId "period_id",
        Amount "amount",
        Keep "keep",
        Settled "settled",
        Ttl "ttl",
        Create "create",
    }
    /// A rate order's answer: what was granted and the window after it.
    RateGrant "rate_grant" {
        Granted "granted",
        Start "start",
        Current "current",
        Previous "previous",
    }
    /// A lease order's answer: the slots the slice holds and the scope's leases held in all.
    LeaseGrant "lease_grant" {
        Slots "slots",
        Held "held",
    }
    /// A budget order's answer: the slice's amount and the scope's committed total.
    BudgetGrant "budget_grant" {
        Amount "amount",
        Committed "committed",
    }
    /// A settlement or a release (`finish_one`).
    Finish "finish" {
        Id "id",
        Retention "retention",
        Ending "ending",
        HasUsage "has_usage",
        Input "input",
        Cached "cached",
        Output "output",
        Write5m "write_5m",
        Write1h "write_1h",
        ToolCalls "tool_calls",
        Fees "fees",
    }
}
