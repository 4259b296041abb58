//! Diagnostic: how fast do the AMXINT8/AMXINT4 decode kernels (one row) stream 32-row groups
//! from DRAM, against the read probe in the same minute? One long run of groups per thread
//! (`THREADS`, default 1: a lone core's rate is the same in every memory state of the VMs we
//! run on). `INT4=1` for AMXINT4; `PF=<bytes>[+1]` the prefetch setting (+1: into L2; 0 off);
//! `K` the inputs per row (2048). The walk: in address order, or `ALT=1` gate and up of a decode
//! (group by group from two halves of the buffer), or `EXPERTS=n` experts of n gate and n up
//! groups visited in a scattered order, gate and up alternating within each.
//! `cargo run --release -p kt-benches --example group_stream`
use kt_core::kernels::prefetch::{set_of, Family};
use kt_core::kernels::KernelSet;
use kt_core::pack::AlignedBuf;
use std::time::Instant;

fn main() {
    let pool = kt_benches::pool(kt_benches::env_or("THREADS", 1));
    let int4 = kt_benches::env_or("INT4", 0) == 1;
    let k: usize = kt_benches::env_or("K", 2048);
    let group = if int4 { 16 * k } else { 32 * k };
    let groups = (1usize << 30) / group;
    let buf = AlignedBuf::<u8>::zeroed(groups * group).unwrap();
    let base = buf.as_ptr() as usize;
    pool.parallel_for_all(groups, &|g| unsafe {
        let s = std::slice::from_raw_parts_mut((base as *mut u8).add(g * group), group);
        for (i, v) in s.iter_mut().enumerate() {
            *v = (i * 37 + g) as u8 & 0x77;
        }
    })
    .unwrap();
    let family = if int4 {
        Family::ByteGroups
    } else {
        Family::Int8Groups
    };
    set_of(family, kt_benches::env_or("PF", 0));
    let level = KernelSet::best().unwrap().level();
    let kernel = if int4 {
        kt_core::formats::int4::kernels::vector_kernel(level)
    } else {
        kt_core::formats::int8::kernels::vector_kernel(level)
    };
    let a = kt_core::kernels::group_dot::activation_row(&vec![129u8; k]);
    let ap = a.as_ptr() as usize;
    let sums = [0i32; 32];
    let alt = kt_benches::env_or("ALT", 0) == 1;
    let experts: usize = kt_benches::env_or("EXPERTS", 0);
    // MUL=1: the experts in address order (7919: scattered).
    let mul: usize = kt_benches::env_or("MUL", 7919);
    let run = || {
        let t = Instant::now();
        let threads = pool.total_threads();
        let per = groups / threads;
        pool.parallel_for_all(threads, &|t| {
            let mut out = [0i32; 32];
            let half = per / 2;
            for i in t * per..(t + 1) * per {
                let j = i - t * per;
                let g = if experts > 0 {
                    let per_expert = 2 * experts;
                    let count = per / per_expert;
                    let e = (j / per_expert * mul) % count.max(1);
                    let within = j % per_expert;
                    t * per + e * per_expert + within / 2 + (within % 2) * experts
                } else if alt {
                    t * per + j / 2 + (j % 2) * half
                } else {
                    i
                };
                // SAFETY: group g lies inside the buffer; one activation row of k values; 32
                // sums and outputs; the kernel is this CPU's.
                unsafe {
                    (kernel.dot)(
                        &[ap as *const u8],
                        k,
                        (base as *const u8).add(g * group),
                        sums.as_ptr(),
                        out.as_mut_ptr(),
                    )
                };
                std::hint::black_box(&out);
            }
        })
        .unwrap();
        (per * threads * group) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let (mut probe, mut real) = (vec![], vec![]);
    for _ in 0..kt_benches::env_or("ROUNDS", 6) {
        probe.push(kt_core::probe::dram_read_gbps(&pool, 1 << 30, 1).unwrap());
        real.push(run());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, r) = (med(&mut probe), med(&mut real));
    println!(
        "{} k {k}, {} thread(s), {}: {r:.1} GB/s, probe {p:.1} GB/s ({:.0}%)",
        if int4 { "AMXINT4" } else { "AMXINT8" },
        pool.total_threads(),
        kernel.name,
        100.0 * r / p
    );
}
