#![no_main]
//! Fuzz target: see `kt_core::fuzzing::shard_index`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kt_core::fuzzing::shard_index(data));
