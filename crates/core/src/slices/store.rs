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
        let kept = reason.map(|r| crate::decision::Killed::anchored(r, now));
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
        self.usage_here(scope_id, period).await
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
