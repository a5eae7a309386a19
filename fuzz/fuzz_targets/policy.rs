#![no_main]
// Policy and fixture files: parse or give an error, never panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = tollgate_core::Policy::from_toml(text);
        let _ = tollgate_core::replay::Fixture::from_toml(text);
    }
});
