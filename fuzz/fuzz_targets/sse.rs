#![no_main]
// Upstream event streams, split anywhere, through the gateway's meter of both formats: no
// panic, nothing lost or added, and the split changes nothing (tollgate_gateway::sse::fuzz_check).
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_gateway::sse::fuzz_check(data);
});
