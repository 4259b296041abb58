//! What the CPU and the OS let us run, decided once per process.
//!
//! A feature counts only when CPUID reports it *and* the OS saves its register state (XCR0);
//! AMX additionally needs Linux's per-process permission (`arch_prctl(ARCH_REQ_XCOMP_PERM)`).
//! `KT_KERNEL_CPU_VARIANT` may lower the level (to test slower paths), never raise it.
use crate::{Error, Result};
use std::sync::OnceLock;

/// Kernel levels, ordered from the most portable to the fastest. The names are the original
/// kt-kernel's variant names (plus `generic` for CPUs without AVX2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Plain Rust, any x86-64 (or other) CPU.
    Generic,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ.
    Avx512Base,
    /// + AVX512-VNNI.
    Avx512Vnni,
    /// + AVX512-VBMI.
    Avx512Vbmi,
    /// + AVX512-BF16.
    Avx512Bf16,
    /// + AMX tiles (TILE, INT8, BF16) with OS permission.
    Amx,
}

/// All levels, lowest first.
pub const LEVELS: [Level; 7] = [
    Level::Generic,
    Level::Avx2,
    Level::Avx512Base,
    Level::Avx512Vnni,
    Level::Avx512Vbmi,
    Level::Avx512Bf16,
    Level::Amx,
];

impl Level {
    /// The original's variant string (`amx`, `avx512_bf16`, ..., `avx2`; `generic` below AVX2).
    pub fn name(self) -> &'static str {
        match self {
            Level::Generic => "generic",
            Level::Avx2 => "avx2",
            Level::Avx512Base => "avx512_base",
            Level::Avx512Vnni => "avx512_vnni",
            Level::Avx512Vbmi => "avx512_vbmi",
            Level::Avx512Bf16 => "avx512_bf16",
            Level::Amx => "amx",
        }
    }

    /// Parse a variant name; accepts the original's spellings with or without underscores.
    pub fn parse(s: &str) -> Option<Level> {
        let norm: String = s
            .trim()
            .to_ascii_lowercase()
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect();
        LEVELS
            .iter()
            .copied()
            .find(|l| l.name().replace('_', "") == norm)
            .or(match norm.as_str() {
                "scalar" | "none" => Some(Level::Generic),
                "avx512" => Some(Level::Avx512Base),
                _ => None,
            })
    }

    /// Features this level adds to the one below it (names as in /proc/cpuinfo).
    fn added_features(self) -> &'static [&'static str] {
        match self {
            Level::Generic => &[],
            Level::Avx2 => &["avx2", "fma", "f16c"],
            Level::Avx512Base => &["avx512f", "avx512bw", "avx512vl", "avx512dq"],
            Level::Avx512Vnni => &["avx512_vnni"],
            Level::Avx512Vbmi => &["avx512vbmi"],
            Level::Avx512Bf16 => &["avx512_bf16"],
            Level::Amx => &["amx_tile", "amx_int8", "amx_bf16", "amx_permission"],
        }
    }

    /// Every feature this level needs: levels are cumulative, like the original's chain.
    pub fn required_features(self) -> Vec<&'static str> {
        LEVELS
            .iter()
            .take_while(|l| **l <= self)
            .flat_map(|l| l.added_features().iter().copied())
            .collect()
    }
}

/// Individual features as usable by this process (CPUID and OS state both agree).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Features {
    /// CPU vendor string from CPUID leaf 0.
    pub vendor: String,
    /// CPU brand string.
    pub brand: String,
    /// (name, usable) for every feature we look at, in a fixed order.
    pub flags: Vec<(&'static str, bool)>,
    /// AMX tiles reported by CPUID and enabled in XCR0 (before asking Linux for permission).
    pub amx_hardware: bool,
    /// Linux granted this process the AMX tile data state.
    pub amx_permission: bool,
}

impl Features {
    /// Whether the named feature is usable.
    pub fn has(&self, name: &str) -> bool {
        self.flags.iter().any(|(n, ok)| *n == name && *ok)
    }

    /// Highest level whose features are all present.
    pub fn best_level(&self) -> Level {
        let mut best = Level::Generic;
        for level in LEVELS {
            if self.missing(level).is_empty() {
                best = level;
            }
        }
        best
    }

    /// Features a level needs that this CPU/OS lacks.
    pub fn missing(&self, level: Level) -> Vec<&'static str> {
        level
            .required_features()
            .into_iter()
            .filter(|f| !self.has(f))
            .collect()
    }

    /// Detect the running CPU. Asks Linux for AMX permission if the hardware has AMX.
    pub fn detect() -> Features {
        detect_x86()
    }

    /// These features with the comma-separated `names` (the [`Features::flags`] spelling)
    /// marked unusable: `KT_KERNEL_CPU_DISABLE`, to run on one CPU the kernels another CPU
    /// would pick (say `avx_vnni`: the AVX2 kernels of a CPU without it). An unknown name is
    /// an error naming the known ones.
    pub fn without(mut self, names: &str) -> Result<Features> {
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some(flag) = self.flags.iter_mut().find(|(n, _)| *n == name) else {
                let known: Vec<_> = self.flags.iter().map(|(n, _)| *n).collect();
                return Err(Error::Invalid(format!(
                    "KT_KERNEL_CPU_DISABLE names {name:?}, not a feature kt-kernel looks at; \
                     known: {known:?}"
                )));
            };
            flag.1 = false;
        }
        Ok(self)
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_x86() -> Features {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let leaf0 = __cpuid(0);
    let mut vendor = Vec::new();
    for r in [leaf0.ebx, leaf0.edx, leaf0.ecx] {
        vendor.extend_from_slice(&r.to_le_bytes());
    }
    let max_leaf = leaf0.eax;
    let max_ext = __cpuid(0x8000_0000).eax;
    let mut brand = Vec::new();
    if max_ext >= 0x8000_0004 {
        for leaf in 0x8000_0002u32..=0x8000_0004 {
            let r = __cpuid(leaf);
            for v in [r.eax, r.ebx, r.ecx, r.edx] {
                brand.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let (l7_edx, l7_1_eax) = if max_leaf >= 7 {
        let l7 = __cpuid_count(7, 0);
        let l71 = __cpuid_count(7, 1);
        (l7.edx, l71.eax)
    } else {
        (0, 0)
    };
    let l1 = __cpuid(1);
    let osxsave = l1.ecx & (1 << 27) != 0;
    let xcr0 = if osxsave { read_xcr0() } else { 0 };
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS context-switches tile state.
    let amx_cpu = l7_edx & (1 << 24) != 0 && l7_edx & (1 << 25) != 0 && l7_edx & (1 << 22) != 0;
    let amx_hardware = amx_cpu && (xcr0 >> 17) & 0b11 == 0b11;
    let amx_permission = amx_hardware && request_amx_permission();
    let avx_vnni = l7_1_eax & (1 << 4) != 0 && (xcr0 & 0b110) == 0b110;

    let flags: Vec<(&'static str, bool)> = vec![
        ("avx2", std::is_x86_feature_detected!("avx2")),
        ("fma", std::is_x86_feature_detected!("fma")),
        ("f16c", std::is_x86_feature_detected!("f16c")),
        ("avx_vnni", avx_vnni),
        ("avx512f", std::is_x86_feature_detected!("avx512f")),
        ("avx512bw", std::is_x86_feature_detected!("avx512bw")),
        ("avx512vl", std::is_x86_feature_detected!("avx512vl")),
        ("avx512dq", std::is_x86_feature_detected!("avx512dq")),
        ("avx512_vnni", std::is_x86_feature_detected!("avx512vnni")),
        ("avx512vbmi", std::is_x86_feature_detected!("avx512vbmi")),
        ("avx512_bf16", std::is_x86_feature_detected!("avx512bf16")),
        ("avx512_fp16", std::is_x86_feature_detected!("avx512fp16")),
        ("amx_tile", amx_hardware),
        ("amx_int8", amx_hardware),
        ("amx_bf16", amx_hardware),
        ("amx_permission", amx_permission),
    ];
    let clean = |b: Vec<u8>| {
        String::from_utf8_lossy(&b)
            .trim_matches(char::from(0))
            .trim()
            .to_string()
    };
    Features {
        vendor: clean(vendor),
        brand: clean(brand),
        flags,
        amx_hardware,
        amx_permission,
    }
}

#[cfg(target_arch = "x86_64")]
fn read_xcr0() -> u64 {
    let (eax, edx): (u32, u32);
    // SAFETY: only called when CPUID.1:ECX.OSXSAVE is set, so XGETBV with ECX=0 is defined.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") eax, out("edx") edx,
            options(nomem, nostack, preserves_flags));
    }
    ((edx as u64) << 32) | eax as u64
}

/// Ask Linux for the AMX tile-data state (`ARCH_REQ_XCOMP_PERM`, XFEATURE 18). Idempotent; the
/// permission is per process, so worker threads created later inherit it.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub fn request_amx_permission() -> bool {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes only reads/writes the u64 we pass.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return false;
        }
        let mut mask: u64 = 0;
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut mask as *mut u64,
        ) == 0
            && mask & (1 << XFEATURE_XTILEDATA) != 0
    }
}

/// Without Linux there is no way to ask for AMX state here.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub fn request_amx_permission() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_x86() -> Features {
    Features::default()
}

/// The level in force for this process: the best the CPU allows, or the cap requested.
#[derive(Debug, Clone)]
pub struct Selection {
    /// What the hardware and OS allow.
    pub features: Features,
    /// Best level the CPU supports.
    pub detected: Level,
    /// Level actually used (≤ detected).
    pub chosen: Level,
    /// The `KT_KERNEL_CPU_VARIANT` value, if set.
    pub requested: Option<String>,
}

/// Choose the level given detected features and an optional cap. Asking for a level the CPU
/// cannot run is an error naming the missing features.
pub fn select(features: Features, requested: Option<&str>) -> Result<Selection> {
    let detected = features.best_level();
    let chosen = match requested.map(str::trim).filter(|s| !s.is_empty()) {
        None => detected,
        Some(req) => {
            let Some(level) = Level::parse(req) else {
                let names: Vec<_> = LEVELS.iter().map(|l| l.name()).collect();
                return Err(Error::Invalid(format!(
                    "KT_KERNEL_CPU_VARIANT={req:?} is not a known variant; use one of {names:?}"
                )));
            };
            if level > detected {
                return Err(Error::Unsupported(format!(
                    "KT_KERNEL_CPU_VARIANT={req:?} asks for more than this CPU offers \
                     (best here: {}); missing: {}",
                    detected.name(),
                    features.missing(level).join(", ")
                )));
            }
            level
        }
    };
    Ok(Selection {
        features,
        detected,
        chosen,
        requested: requested.map(str::to_string),
    })
}

/// Whether this process may run `level`'s instructions: the CPU and OS allow them and
/// `KT_KERNEL_CPU_VARIANT` does not cap below them. For kernels chosen per call (activation
/// quantizers, load-time helpers) instead of once per layer; false if the selection failed
/// (that error surfaces where the layer is built).
pub fn allows(level: Level) -> bool {
    global().is_ok_and(|s| s.chosen >= level)
}

/// Whether the CPU has feature `name` (the [`Features::flags`] spelling, e.g. `"avx_vnni"`),
/// for kernels that pick among variants of one level; false if detection failed.
pub fn has_feature(name: &str) -> bool {
    global().is_ok_and(|s| s.features.has(name))
}

/// Whether the fused FP8/MXFP8 decode kernels read subnormal E4M3 codes as zero. Their fast
/// decode makes those codes fp32 denormals, and an Intel core takes a microcode assist for
/// each instruction that reads one (an Intel Xeon ran FP8 at 150-180 ns per 64-byte line with
/// 7 such codes in 127, against 3-4 without), while AMD cores (Zen 3, Zen 4) run them at full
/// speed: so zero on Intel, exact elsewhere. `KT_KERNEL_FP8_SUBNORMALS=zero|exact` overrides;
/// any other value is an error (layer builds check it first).
pub fn fp8_subnormal_setting() -> Result<bool> {
    static FLUSH: OnceLock<Result<bool>> = OnceLock::new();
    FLUSH
        .get_or_init(|| {
            let intel = global().is_ok_and(|s| s.features.vendor == "GenuineIntel");
            let flush = match std::env::var("KT_KERNEL_FP8_SUBNORMALS").as_deref() {
                Ok("zero") => true,
                Ok("exact") => false,
                Ok(v) if !v.trim().is_empty() => {
                    return Err(Error::Invalid(format!(
                        "KT_KERNEL_FP8_SUBNORMALS={v:?}: use zero or exact (unset: zero on \
                         Intel CPUs, exact elsewhere)"
                    )))
                }
                _ => intel,
            };
            if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
                let how = if flush { "read as zero" } else { "exact" };
                eprintln!("[kt_kernel] fused fp8 decode: subnormal codes {how}");
            }
            Ok(flush)
        })
        .clone()
}

/// [`fp8_subnormal_setting`] where it is valid, else exact (a layer build has refused it).
pub fn flush_subnormal_codes() -> bool {
    fp8_subnormal_setting().unwrap_or(false)
}

/// The process-wide selection, made on first use from the CPU and `KT_KERNEL_CPU_VARIANT`.
pub fn global() -> Result<&'static Selection> {
    static SELECTION: OnceLock<Result<Selection>> = OnceLock::new();
    SELECTION
        .get_or_init(|| {
            let requested = std::env::var("KT_KERNEL_CPU_VARIANT").ok();
            let disabled = std::env::var("KT_KERNEL_CPU_DISABLE").unwrap_or_default();
            let sel = Features::detect()
                .without(&disabled)
                .and_then(|f| select(f, requested.as_deref()));
            if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
                match &sel {
                    Ok(s) => eprintln!(
                        "[kt_kernel] cpu: {} | detected {} | chosen {} | flags: {}",
                        s.features.brand,
                        s.detected.name(),
                        s.chosen.name(),
                        s.features
                            .flags
                            .iter()
                            .filter(|(_, ok)| *ok)
                            .map(|(n, _)| *n)
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                    Err(e) => eprintln!("[kt_kernel] cpu variant error: {e}"),
                }
            }
            sel
        })
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(names: &[&'static str]) -> Features {
        let all = Level::Amx.required_features();
        Features {
            flags: all.iter().map(|n| (*n, names.contains(n))).collect(),
            ..Features::default()
        }
    }

    #[test]
    fn disabled_features_are_unusable_and_unknown_ones_refused() {
        let mut all = fake(&["avx2", "fma", "f16c"]);
        all.flags.push(("avx_vnni", true));
        let f = all.clone().without(" avx_vnni ,").unwrap();
        assert!(!f.has("avx_vnni") && f.has("avx2"));
        assert_eq!(f.best_level(), Level::Avx2);
        assert_eq!(
            all.clone().without("fma").unwrap().best_level(),
            Level::Generic
        );
        let err = all.without("avx_vnn").unwrap_err().to_string();
        assert!(
            err.contains("KT_KERNEL_CPU_DISABLE") && err.contains("avx_vnni"),
            "{err}"
        );
    }

    #[test]
    fn best_level_follows_features() {
        assert_eq!(fake(&[]).best_level(), Level::Generic);
        assert_eq!(fake(&["avx2", "fma", "f16c"]).best_level(), Level::Avx2);
        let bf16_no_vbmi = fake(&[
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512dq",
            "avx512_vnni",
            "avx512_bf16",
        ]);
        // bf16 without vbmi stays at vnni: levels are cumulative, like the original's chain.
        assert_eq!(bf16_no_vbmi.best_level(), Level::Avx512Vnni);
    }

    #[test]
    fn cap_may_lower_never_raise() {
        let f = fake(&["avx2", "fma", "f16c"]);
        assert_eq!(
            select(f.clone(), Some("generic")).unwrap().chosen,
            Level::Generic
        );
        assert_eq!(select(f.clone(), None).unwrap().chosen, Level::Avx2);
        let err = select(f.clone(), Some("avx512_bf16")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("avx512f") && msg.contains("avx512_bf16"),
            "{msg}"
        );
        assert!(matches!(select(f, Some("avx9000")), Err(Error::Invalid(_))));
    }

    #[test]
    fn parse_accepts_original_spellings() {
        assert_eq!(Level::parse("AVX512_BF16"), Some(Level::Avx512Bf16));
        assert_eq!(Level::parse("avx512bf16"), Some(Level::Avx512Bf16));
        assert_eq!(Level::parse("avx512_base"), Some(Level::Avx512Base));
        for l in LEVELS {
            assert_eq!(Level::parse(l.name()), Some(l));
        }
    }

    #[test]
    fn detection_is_consistent_with_std() {
        let f = Features::detect();
        assert_eq!(f.has("avx2"), std::is_x86_feature_detected!("avx2"));
        assert!(f.best_level() >= Level::Generic);
        // AMX permission cannot exist without the hardware.
        assert!(!f.amx_permission || f.amx_hardware);
    }
}
