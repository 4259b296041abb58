//! Helpers shared by the unit tests.
use crate::pool::{Pool, PoolConfig};
use std::path::PathBuf;

/// `shared/fixtures/{name}` beside the repository, if it is there (CI checks it out; a
/// stand-alone crate checkout does not have it, and the tests that need it then pass over it).
pub fn fixtures(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures")
        .join(name);
    p.is_dir().then_some(p)
}

/// An unpinned pool of `threads` threads in `parts` sub-pools.
pub fn pool(parts: usize, threads: usize) -> Pool {
    let mut cfg = PoolConfig::split(threads.max(parts), parts, None).unwrap();
    cfg.pin = false;
    Pool::new(cfg).unwrap()
}
