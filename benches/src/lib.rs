//! Shared set-up for the kt-core benchmarks: a synthetic BF16 MoE layer.
use kt_core::dtype::FloatType;
use kt_core::kernels::KernelSet;
use kt_core::method::Method;
use kt_core::moe::{MoeConfig, MoeLayer, TensorSource};
use kt_core::pool::{Pool, PoolConfig};
use kt_core::rng::Rng;

/// The environment variable `name` as a number, or `default` when unset or unparsable
/// (diagnostic examples' knobs, e.g. `ITERS`).
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A loaded layer of the given shape with random bf16 weights.
pub fn synthetic_layer(
    pool: &Pool,
    e: usize,
    k: usize,
    h: usize,
    i: usize,
    max_tokens: usize,
    kernels: KernelSet,
) -> MoeLayer {
    synthetic_layer_as(pool, e, k, h, i, max_tokens, kernels, Method::Bf16)
}

/// Like [`synthetic_layer`], stored in `format`.
#[allow(clippy::too_many_arguments)]
pub fn synthetic_layer_as(
    pool: &Pool,
    e: usize,
    k: usize,
    h: usize,
    i: usize,
    max_tokens: usize,
    kernels: KernelSet,
    format: Method,
) -> MoeLayer {
    let mut rng = Rng::new(1);
    let mut mk = |n: usize| -> Vec<u16> {
        (0..n)
            .map(|_| kt_core::dtype::f32_to_bf16_bits(rng.normal() * 0.02))
            .collect()
    };
    let (g, u, d) = (mk(e * i * h), mk(e * i * h), mk(e * h * i));
    let src = TensorSource {
        gate: g.as_ptr() as *const u8,
        up: u.as_ptr() as *const u8,
        down: d.as_ptr() as *const u8,
        dtype: FloatType::BF16,
        experts: e,
        hidden: h,
        intermediate: i,
    };
    let cfg = MoeConfig {
        layer_idx: 0,
        num_experts: e,
        top_k: k,
        hidden: h,
        intermediate: i,
        max_tokens,
        swiglu_limit: 0.0,
        swiglu_alpha: 0.0,
    };
    let mut layer = MoeLayer::with_method(cfg, pool.parts(), kernels, format).expect("valid shape");
    layer.load(pool, &src, None).expect("load");
    layer
}

/// A pool of `threads` pinned threads in one sub-pool.
pub fn pool(threads: usize) -> Pool {
    Pool::new(PoolConfig::split(threads, 1, None).expect("config")).expect("pool")
}

/// Random top-k routing for `tokens` tokens.
pub fn routing(rng: &mut Rng, tokens: usize, e: usize, k: usize) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        ids.extend(rng.distinct(e, k).into_iter().map(|v| v as i64));
    }
    (ids, vec![1.0 / k as f32; tokens * k])
}
