//! Diagnostic: prefill latency of one quantized layer, alternating two layers; prints a marker
//! once set-up is done so `perf record -D` can skip it.
//! `cargo run --release -p kt-benches --example prefill -- int8 512` (or any method name, e.g.
//! FP8); env ITERS, WARMUP (untimed calls first; 30 on hardware tiles), EXPERTS, THREADS.
use kt_core::kernels::KernelSet;
use kt_core::method::Method;
use kt_core::moe::Workspace;
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    // THREADS=1 shows how much of two threads' time is the second core's contention.
    let pool = kt_benches::pool(kt_benches::env_or("THREADS", 2));
    let format = match std::env::args().nth(1).as_deref() {
        Some("int4") => Method::AmxInt4,
        Some("bf16") => Method::Bf16,
        Some("int8") | None => Method::AmxInt8,
        Some(name) => Method::parse(name).expect("a method name"),
    };
    let tokens: usize = std::env::args()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    // EXPERTS shrinks the layer (e.g. 8: every expert gets every token, weights fit in L3).
    let e: usize = kt_benches::env_or("EXPERTS", 128);
    let (k, h, i) = (8, 2048, 768);
    let mut rng = Rng::new(3);
    let layers: Vec<_> = (0..2)
        .map(|_| {
            kt_benches::synthetic_layer_as(
                &pool,
                e,
                k,
                h,
                i,
                tokens,
                KernelSet::best().unwrap(),
                format,
            )
        })
        .collect();
    let mut ws = Workspace::new();
    let x = rng.normals(tokens * h, 1.0);
    let mut out = vec![0f32; tokens * h];
    let iters = kt_benches::env_or("ITERS", 20);
    // On hardware tiles the first prefills tune the tiles' weight prefetch (4 + 3·12 calls,
    // kernels::amx::amx_tune_begin): untimed, so the timed calls run the chosen setting.
    let on_tiles = KernelSet::best()
        .unwrap()
        .amx()
        .is_some_and(|a| !a.emulated);
    let warmup = kt_benches::env_or("WARMUP", if on_tiles { 42 } else { 0 });
    for it in 0..warmup {
        let (ids, w) = kt_benches::routing(&mut rng, tokens, e, k);
        layers[it % 2]
            .forward_f32(&pool, &mut ws, &x, &ids, &w, &mut out)
            .unwrap();
    }
    eprintln!("set-up done");
    let mut times = Vec::new();
    for it in 0..iters {
        let (ids, w) = kt_benches::routing(&mut rng, tokens, e, k);
        let t = Instant::now();
        layers[it % 2]
            .forward_f32(&pool, &mut ws, &x, &ids, &w, &mut out)
            .unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let flop = 2.0 * 3.0 * (h * i * tokens * k) as f64;
    println!(
        "{format:?} {tokens} tokens: median {:.2} ms ({:.0} GFLOP/s), best {:.2} ms",
        times[iters / 2] * 1e3,
        flop / times[iters / 2] / 1e9,
        times[0] * 1e3
    );
}
