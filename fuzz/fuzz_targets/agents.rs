#![no_main]
// Client bodies through loop detection and trimming's turns, in every format: no panic, the
// fingerprint unchanged when the body is written again, turns disjoint and in order.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_gateway::fuzz_agents(data);
});
