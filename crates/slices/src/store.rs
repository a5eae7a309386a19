//! [`Store`] over slices: each call goes to the local engine or the store behind, as
//! [`Sliced`]'s own methods decide.

#[allow(clippy::wildcard_imports)]
// the slice layer's types and methods, which the trait calls
use super::*;

impl<S: SliceSource, C: Clock + Clone + 'static> Store for Sliced<S, C> {
    async fn admit(&self, plan: &Plan) -> Result<Decision, StoreError> {
        self.decide(plan, None).await.map(|(d, _)| d)
    }

    async fn admit_shadowed(
        &self,
        plan: &Plan,
        shadow: &Plan,
    ) -> Result<(Decision, ShadowOutcome), StoreError> {
        let (d, o) = self.decide(plan, Some(shadow)).await?;
        Ok((d, o.unwrap_or(ShadowOutcome::Failed)))
    }

    async fn settle(&self, id: &str, usage: Usage) -> Result<Finish, StoreError> {
        self.finish(id, Some(usage), true).await
    }

    async fn release(&self, id: &str, usage: Option<Usage>) -> Result<Finish, StoreError> {
        self.finish(id, usage, false).await
    }

    async fn renew(&self, id: &str) -> Result<Renewal, StoreError> {
        self.renew_here(id).await
    }

    async fn set_kill(&self, target: &str, reason: Option<&str>) -> Result<(), StoreError> {
        self.inner.set_kill(target, reason).await?;
        let local = self.clock.now();
        let mut st = self.lock()?;
        let now = st.book.est(local);
        let kept = reason.map(|r| tollgate_core::decision::Killed::anchored(r, now));
        st.book.set_kill(target, kept.as_deref());
        Ok(())
    }

    async fn kills(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.inner.kills().await
    }

    async fn usage(
        &self,
        scope_id: &str,
        period: Option<Period>,
    ) -> Result<ScopeUsage, StoreError> {
        self.usage_here(scope_id, period, None).await
    }

    async fn usage_carrying(
        &self,
        scope_id: &str,
        period: Period,
        carry: (u64, u64),
    ) -> Result<ScopeUsage, StoreError> {
        self.usage_here(scope_id, Some(period), Some(carry)).await
    }

    async fn claim_key(&self, key: KeyUse<'_>) -> Result<KeyClaim, StoreError> {
        self.inner.claim_key(key).await
    }

    async fn end_claim(
        &self,
        key: &str,
        request_id: &str,
        response: Option<&[u8]>,
        keep_ms: u64,
    ) -> Result<(), StoreError> {
        self.inner
            .end_claim(key, request_id, response, keep_ms)
            .await
    }
}

/// What the trait's reads need beyond the slice layer's decisions.
impl<S: SliceSource, C: Clock + Clone + 'static> Sliced<S, C> {
    /// A plan that reads rate windows: the store's reading, with the attempts of this
    /// instance's slices not yet made given back (the store counts a slice as used).
    pub(super) async fn peek(&self, plan: &Plan) -> Result<Decision, StoreError> {
        let mut d = self.inner.admit(plan).await?;
        if let Decision::Admit(a) = &mut d {
            let st = self.lock()?;
            for q in &mut a.quotas {
                if let Some(Kind::Peek(c)) = plan.checks.get(q.check).map(|c| &c.kind) {
                    q.remaining = q.remaining.saturating_add(st.book.unused(c)).min(c.limit);
                }
            }
        }
        Ok(d)
    }

    async fn usage_here(
        &self,
        scope_id: &str,
        period: Option<Period>,
        carry: Option<(u64, u64)>,
    ) -> Result<ScopeUsage, StoreError> {
        let mut u = match (period, carry) {
            (Some(p), Some(c)) => self.inner.usage_carrying(scope_id, p, c).await?,
            _ => self.inner.usage(scope_id, period).await?,
        };
        let c = {
            let mut st = self.lock()?;
            let State { book, engine, .. } = &mut *st;
            book.correction(engine, scope_id, period, self.clock.now())?
        };
        u.leases = u
            .leases
            .saturating_sub(c.slice_leases)
            .saturating_add(c.local_leases);
        u.reserved = u
            .reserved
            .saturating_sub(c.slice_amount)
            .saturating_add(c.local_reserved);
        u.settled = u.settled.saturating_add(c.unreported);
        Ok(u)
    }
}
