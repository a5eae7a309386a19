#![no_main]
// Client bodies against every API's field list: accepted or refused by name, never a panic; a
// refused field declared free lets the body past it.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_gateway::dialect::fields::fuzz_check(data);
});
