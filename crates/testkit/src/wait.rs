//! Waiting on an event rather than for a length of time: a condition polled until it holds,
//! within a bound that fails the test when it is passed.

use std::time::{Duration, Instant};

/// How often a condition is read again.
const EVERY: Duration = Duration::from_millis(20);

/// Polls `f` until it holds; fails the test, naming `what`, if it does not within `within`.
pub async fn until_within(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(EVERY).await;
    }
}

/// [`until_within`] ten seconds.
pub async fn until(what: &str, f: impl AsyncFnMut() -> bool) {
    until_within(what, Duration::from_secs(10), f).await;
}

/// [`until_within`] for a thread without a runtime: polls `f` until it holds.
pub fn until_blocking(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(EVERY);
    }
}

/// Polls `f` until it gives a value; fails the test with the last reason it gave for not yet
/// (`Err`) if none comes within `within`.
pub async fn poll<T>(within: Duration, mut f: impl AsyncFnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(why) => assert!(Instant::now() < deadline, "{why} (after {within:?})"),
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// Reads `f` until `done` holds of what it read, or `within` has passed; the last reading
/// either way (for a test that then says what it expected of it).
pub async fn at_most<T>(
    within: Duration,
    mut f: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        let v = f().await;
        if done(&v) || Instant::now() >= deadline {
            return v;
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// [`at_most`] for a thread without a runtime.
pub fn at_most_blocking<T>(
    within: Duration,
    mut f: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        let v = f();
        if done(&v) || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(EVERY);
    }
}
