#![no_main]
// Price catalogs (LiteLLM's format, as `tollgate prices diff` reads them): no panic, every figure
// within the bound, and a catalog's diff with itself empty.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = tollgate_prices::Catalog::parse(text) {
        for e in c.models.values() {
            for (_, v) in e.figures() {
                assert!(v <= tollgate_prices::MAX_MICRO);
            }
        }
        assert!(c.diff(&c).is_empty());
    }
});
