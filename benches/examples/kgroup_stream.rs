//! Diagnostic: how fast does the group-scaled 4-bit decode kernel (MXFP4, one row) stream
//! panels from DRAM, against the read probe in the same minute? Large buffers (no layer
//! structure: one long run of panels per thread; `THREADS`, default 2). `cargo run --release -p
//! kt-benches --example kgroup_stream`
use kt_core::codes::{CodeKind, ScaleType};
use kt_core::formats::kgroup::int_dot::{int_fused_for, prepare_row, row_bytes, WeightBytes};
use kt_core::kernels::KernelSet;
use kt_core::pack::AlignedBuf;
use std::time::Instant;

fn main() {
    let pool = kt_benches::pool(kt_benches::env_or("THREADS", 2));
    let (k, chunk, group) = (2048usize, 32usize, 32usize);
    let panel = 16 * k; // 4-bit codes of a 32-row panel
    let panel_scales = 32 * (k / group);
    let panels = (1usize << 30) / panel;
    let codes = AlignedBuf::<u8>::zeroed(panels * panel).unwrap();
    let scales = AlignedBuf::<u8>::zeroed(panels * panel_scales).unwrap();
    let (cb, sb) = (codes.as_ptr() as usize, scales.as_ptr() as usize);
    pool.parallel_for_all(panels, &|p| unsafe {
        let c = std::slice::from_raw_parts_mut((cb as *mut u8).add(p * panel), panel);
        for (i, v) in c.iter_mut().enumerate() {
            *v = (i * 37 + p) as u8;
        }
        let s = std::slice::from_raw_parts_mut((sb as *mut u8).add(p * panel_scales), panel_scales);
        s.fill(127);
    })
    .unwrap();
    // PF=<bytes>[+1]: the prefetch setting (bytes ahead, +1 for lines into L2); 0 = off.
    let pf: usize = kt_benches::env_or("PF", 4096 | 1);
    kt_core::kernels::prefetch::set_of(kt_core::kernels::prefetch::Family::CodeGroups, pf);
    let level = KernelSet::best().unwrap().level();
    let (kernel, _) = int_fused_for(level).expect("an integer kernel");
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.125).collect();
    let w = WeightBytes::of(CodeKind::E2M1, ScaleType::E8M0);
    let mut row = vec![0u8; row_bytes(k, chunk)];
    prepare_row(&x, chunk, &w, &mut row);
    let rp = row.as_ptr() as usize;
    // ROWS=1|2: activation rows per call (a 1- or 2-token decode's kernel).
    let rows: usize = kt_benches::env_or("ROWS", 1);
    // EXPERT_PANELS=n: a decode's gate/up walk (experts of n gate and n up panels visited in
    // a scattered order, gate and up alternating), laid out as INTERLEAVE says: 0, gate's
    // codes then up's, their scales apart likewise (four streams per expert); 1, one stream
    // (each panel's scales after its codes, up's panel after gate's); 2, the layer's layout
    // (gate and up panels alternating in the codes, and in the scales: two streams); 3, codes
    // as 0 and scales as 2 (three). AMD Zen 5, two threads, n 24, share of the read probe:
    // 0: 81-84%, 1: 68-69%, 2: 90-91%, 3: 85-86% (address order: 92%).
    let expert_panels: usize = kt_benches::env_or("EXPERT_PANELS", 0);
    let mode: usize = kt_benches::env_or("INTERLEAVE", 0);
    let interleave = mode == 1;
    let slot = panel + panel_scales;
    let slots = panels * panel / slot;
    if interleave {
        pool.parallel_for_all(slots, &|q| unsafe {
            let s = (cb as *mut u8).add(q * slot + panel);
            std::slice::from_raw_parts_mut(s, panel_scales).fill(127);
        })
        .unwrap();
    }
    let cached: usize = kt_benches::env_or("CACHED", 0);
    let run = |shared_scales: bool| {
        let t = Instant::now();
        let threads = pool.total_threads();
        let per = slots / threads;
        pool.parallel_for_all(threads, &|t| {
            for j in 0..per {
                let p = t * per + j;
                let p = if cached > 0 { p % cached } else { p };
                let mut out = [0f32; 64];
                let (c, s) = if expert_panels > 0 {
                    let n = expert_panels;
                    let count = per / (2 * n);
                    let e = (j / (2 * n) * 7919) % count.max(1);
                    let (w, base) = (j % (2 * n), t * per + e * 2 * n);
                    if interleave {
                        let q = base + w;
                        (cb + q * slot, cb + q * slot + panel)
                    } else if mode == 2 {
                        let q = base + w;
                        (cb + q * panel, sb + q * panel_scales)
                    } else if mode == 3 {
                        let q = base + (w % 2) * n + w / 2;
                        (cb + q * panel, sb + (base + w) * panel_scales)
                    } else {
                        let q = base + (w % 2) * n + w / 2;
                        (cb + q * panel, sb + q * panel_scales)
                    }
                } else {
                    let s = if shared_scales { 0 } else { p * panel_scales };
                    (cb + p * panel, sb + s)
                };
                // SAFETY: panel p and its scales lie inside the buffers; one prepared row of k
                // inputs; 32 outputs.
                unsafe {
                    kernel(
                        &[rp as *const u8; 2][..rows],
                        k,
                        (0, k),
                        chunk,
                        group,
                        c as *const u8,
                        s as *const u8,
                        &w,
                        out.as_mut_ptr(),
                    )
                };
                std::hint::black_box(out);
            }
        })
        .unwrap();
        let panels = per * threads;
        let bytes = panels * (panel + if shared_scales { 0 } else { panel_scales });
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let (mut probe, mut real, mut shared) = (vec![], vec![], vec![]);
    for _ in 0..kt_benches::env_or("ROUNDS", 8) {
        probe.push(kt_core::probe::dram_read_gbps(&pool, 1 << 30, 1).unwrap());
        real.push(run(false));
        shared.push(run(true));
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (pm, pb) = med(&mut probe);
    for (name, v) in [
        ("codes + scales", &mut real),
        ("codes, one panel's scales", &mut shared),
    ] {
        let (m, b) = med(v);
        println!(
            "MXFP4 R={rows} {name}: median {m:.1} GB/s ({:.0}% of probe median), best {b:.1} ({:.0}% of probe best)",
            100.0 * m / pm,
            100.0 * b / pb
        );
    }
    println!("probe median {pm:.1} GB/s, best {pb:.1}");
}
