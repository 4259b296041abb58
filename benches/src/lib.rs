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

/// Random bf16 expert tensors as a caller of `load_weights_from_tensors` holds them: gate and
/// up `[e][i][h]`, down `[e][h][i]`, values N(0, 0.02²) from a fixed seed.
pub struct SyntheticTensors {
    gate: Vec<u16>,
    up: Vec<u16>,
    down: Vec<u16>,
    shape: (usize, usize, usize),
}

impl SyntheticTensors {
    /// `e` experts of hidden size `h` and intermediate size `i`.
    pub fn new(e: usize, h: usize, i: usize) -> Self {
        let mut rng = Rng::new(1);
        let mut mk = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| kt_core::dtype::f32_to_bf16_bits(rng.normal() * 0.02))
                .collect()
        };
        let (gate, up, down) = (mk(e * i * h), mk(e * i * h), mk(e * h * i));
        SyntheticTensors {
            gate,
            up,
            down,
            shape: (e, h, i),
        }
    }

    /// The tensors as a load's source (valid while `self` lives).
    pub fn source(&self) -> TensorSource {
        let (experts, hidden, intermediate) = self.shape;
        TensorSource {
            gate: self.gate.as_ptr() as *const u8,
            up: self.up.as_ptr() as *const u8,
            down: self.down.as_ptr() as *const u8,
            dtype: FloatType::BF16,
            experts,
            hidden,
            intermediate,
        }
    }
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
    let tensors = SyntheticTensors::new(e, h, i);
    let src = tensors.source();
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
/// With `EVEN_ROUTING=1` every expert gets the same number of rows (token t picks experts
/// t·k.. t·k+k-1 modulo e), to tell the cost of uneven experts from the kernels'.
pub fn routing(rng: &mut Rng, tokens: usize, e: usize, k: usize) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::with_capacity(tokens * k);
    let even = env_or("EVEN_ROUTING", 0) == 1;
    for t in 0..tokens {
        if even {
            ids.extend((0..k).map(|j| ((t * k + j) % e) as i64));
        } else {
            ids.extend(rng.distinct(e, k).into_iter().map(|v| v as i64));
        }
    }
    (ids, vec![1.0 / k as f32; tokens * k])
}

/// `rows` activation rows of `k` values in a fixed pattern (-1.1..=1.1, differing per row), for
/// the kernel diagnostics that time one panel over and over.
pub fn pattern_rows(rows: usize, k: usize) -> Vec<Vec<f32>> {
    (0..rows)
        .map(|r| {
            (0..k)
                .map(|i| ((i * 7 + r) % 23) as f32 * 0.1 - 1.1)
                .collect()
        })
        .collect()
}
