#![no_main]
//! Fuzz target: see `kt_core::fuzzing::converted_merged`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kt_core::fuzzing::converted_merged(data));
