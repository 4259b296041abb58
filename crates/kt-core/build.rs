//! Compiles the C++ tile kernels in `cpp_kernels/`: the AMX emulator everywhere (tests run the
//! tile programs through it), the hardware AMX kernels on x86-64 when the compiler knows the
//! AMX flags (then `cfg(kt_amx_hw)` is set and the runtime may dispatch to them).
use std::path::PathBuf;

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../cpp_kernels");
    println!("cargo::rustc-check-cfg=cfg(kt_amx_hw)");
    for f in ["amx_program.hpp", "amx_hw.cpp", "amx_emu.cpp"] {
        println!("cargo::rerun-if-changed={}", root.join(f).display());
    }

    let base = || {
        let mut b = cc::Build::new();
        b.cpp(true)
            .std("c++17")
            .opt_level(2)
            .warnings(true)
            .extra_warnings(true)
            .include(&root);
        b
    };
    base().file(root.join("amx_emu.cpp")).compile("kt_amx_emu");

    let target_x86 = std::env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|a| a == "x86_64");
    if target_x86 {
        let mut hw = base();
        let flags = [
            "-mamx-tile",
            "-mamx-int8",
            "-mamx-bf16",
            "-mavx512f",
            "-mavx512bw",
        ];
        if flags
            .iter()
            .all(|f| hw.is_flag_supported(f).unwrap_or(false))
        {
            for f in flags {
                hw.flag(f);
            }
            hw.file(root.join("amx_hw.cpp")).compile("kt_amx_hw");
            println!("cargo::rustc-cfg=kt_amx_hw");
        } else {
            println!(
                "cargo::warning=the C++ compiler lacks -mamx-*: AMX kernels are left out of this build"
            );
        }
    }
}
