//! Diagnostic: online quantization of one S1 layer (128 experts, H 2048, I 768) from bf16
//! tensors, per method, `ITERS` loads each, methods alternating; prints each load's ms.
//! `cargo run --release -p kt-benches --example online_load -- RAWINT4 MXFP4`
use kt_core::kernels::KernelSet;
use kt_core::method::Method;
use kt_core::moe::{MoeConfig, MoeLayer};
use std::time::Instant;

fn main() {
    let pool = kt_benches::pool(kt_benches::env_or("THREADS", 2));
    let (e, h, i) = (128, 2048, 768);
    let tensors = kt_benches::SyntheticTensors::new(e, h, i);
    let src = tensors.source();
    let methods: Vec<Method> = std::env::args()
        .skip(1)
        .map(|m| Method::parse(&m).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let level = kt_core::isa::global().expect("CPU detection").chosen;
    for round in 0..kt_benches::env_or("ITERS", 3) {
        for &method in &methods {
            let cfg = MoeConfig {
                layer_idx: 0,
                num_experts: e,
                top_k: 8,
                hidden: h,
                intermediate: i,
                max_tokens: 16,
                swiglu_limit: 0.0,
                swiglu_alpha: 0.0,
            };
            let kernels = KernelSet::for_level(level).expect("kernels");
            let mut layer = MoeLayer::with_method(cfg, pool.parts(), kernels, method).unwrap();
            let t0 = Instant::now();
            layer.load(&pool, &src, None).expect("load");
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            println!("round {round} {method:?}: {ms:.1} ms");
        }
    }
}
