#![no_main]
// An upstream's status and rate-limit headers: a hold of 1 ms to ten minutes or none, never a
// panic, whatever the numbers and dates say.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_gateway::fuzz_provider(data);
});
