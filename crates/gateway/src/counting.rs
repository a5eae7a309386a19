//! Counting large bodies off the async workers: in a bounded pool of blocking threads, one slot
//! a core, and each tenant within its share (half the slots, at least one), so that one
//! tenant's large bodies neither stall other requests' I/O nor take every slot from the others.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

/// The pool.
#[derive(Debug)]
pub struct CountPool {
    slots: Arc<Semaphore>,
    share: usize,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl CountPool {
    /// A pool of `slots` (at least one).
    pub fn new(slots: usize) -> Self {
        let slots = slots.max(1);
        Self {
            slots: Arc::new(Semaphore::new(slots)),
            share: (slots / 2).max(1),
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// A pool of one slot a core.
    pub fn per_core() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Runs `work` in the pool for `tenant`, once the tenant is within its share and a slot is
    /// free (each in the order asked); `None` if it could not run (the runtime shutting down).
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: &str,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let own = self.tenant(tenant)?;
        let _share = own.acquire_owned().await.ok()?;
        let _slot = self.slots.clone().acquire_owned().await.ok()?;
        tokio::task::spawn_blocking(work).await.ok()
    }

    fn tenant(&self, tenant: &str) -> Option<Arc<Semaphore>> {
        let mut t = self.tenants.lock().ok()?;
        Some(
            t.entry(tenant.to_owned())
                .or_insert_with(|| Arc::new(Semaphore::new(self.share)))
                .clone(),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A tenant flooding the pool holds its share and no more: another tenant's count runs
    /// while the flood's wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flooding_tenant_keeps_to_its_share() {
        let pool = Arc::new(CountPool::new(2));
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let mut flood = Vec::new();
        for _ in 0..4 {
            let (pool, running, most, held) =
                (pool.clone(), running.clone(), most.clone(), held.clone());
            flood.push(tokio::spawn(async move {
                pool.run("flood", move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let _ = held.lock().unwrap().recv();
                    running.fetch_sub(1, Ordering::SeqCst);
                })
                .await
            }));
        }
        // The flood's first count is running (and holding its share) before the other asks.
        while running.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The other tenant is served while the flood's counts wait.
        let other = tokio::time::timeout(Duration::from_secs(5), pool.run("other", || 7)).await;
        assert_eq!(other.unwrap(), Some(7));
        for _ in 0..4 {
            release.send(()).unwrap();
        }
        for f in flood {
            assert_eq!(f.await.unwrap(), Some(()));
        }
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "the flood took more than its share"
        );
    }
}
