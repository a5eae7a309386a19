#![no_main]
// Request bodies in every format: no panic, and bounded counts agree with full counts.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_tokens::fuzz_check(data);
});
