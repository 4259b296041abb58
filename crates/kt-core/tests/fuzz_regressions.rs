//! The parsers of untrusted files on the saved fuzz inputs, on stable Rust: the seed corpora
//! (`fuzz/corpus/<target>`) and every input that once broke a parser
//! (`fuzz/regressions/<target>`), plus a few hundred deterministic mutations of each seed
//! (bytes flipped, the file cut short or grown), through the same harnesses the cargo-fuzz
//! targets run. A harness may return errors; it must not panic, abort or hang.
use kt_core::fuzzing::TARGETS;
use std::path::{Path, PathBuf};

fn saved(sub: &str, target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(sub)
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn every_saved_input_runs_cleanly() {
    for (target, harness) in TARGETS {
        let seeds = saved("corpus", target);
        assert!(!seeds.is_empty(), "no seed corpus for {target}");
        for path in seeds.iter().chain(saved("regressions", target).iter()) {
            harness(&std::fs::read(path).unwrap());
        }
    }
}

/// xorshift64*: deterministic mutations without a dependency.
struct Mutator(u64);

impl Mutator {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        match self.below(4) {
            0 => v.truncate(self.below(v.len() + 1)),
            1 => {
                let extra = self.below(64);
                v.extend((0..extra).map(|_| self.next() as u8));
            }
            _ => {
                // Most structure sits in the first bytes (headers, lengths, counts).
                for _ in 0..1 + self.below(4) {
                    if v.is_empty() {
                        break;
                    }
                    let at = if self.below(2) == 0 {
                        self.below(v.len().min(256))
                    } else {
                        self.below(v.len())
                    };
                    v[at] = match self.below(3) {
                        0 => v[at] ^ (1 << self.below(8)),
                        1 => 0xFF,
                        _ => self.next() as u8,
                    };
                }
            }
        }
        v
    }
}

#[test]
fn mutated_seeds_run_cleanly() {
    let mut m = Mutator(0x9E37_79B9_7F4A_7C15);
    for (target, harness) in TARGETS {
        for seed in saved("corpus", target) {
            let data = std::fs::read(&seed).unwrap();
            for _ in 0..300 {
                harness(&m.mutate(&data));
            }
        }
    }
}
