//! `cargo bench`: the BF16 panel kernels (per ISA, GFLOP/s) and whole-layer decode/prefill on
//! the Qwen3-30B-A3B shape (GB/s of expert weights, GFLOP/s).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kt_benches::{pool, routing, synthetic_layer_as};
use kt_core::isa::Level;
use kt_core::kernels::{runnable_levels, KernelSet};
use kt_core::method::Method;
use kt_core::moe::Workspace;
use kt_core::rng::Rng;

fn panel_kernels(c: &mut Criterion) {
    let k = 2048;
    let mut rng = Rng::new(3);
    let panel: Vec<u16> = (0..32 * k)
        .map(|_| kt_core::dtype::f32_to_bf16_bits(rng.normal()))
        .collect();
    let mut g = c.benchmark_group("panel_dot_k2048");
    let mut sets: Vec<KernelSet> = runnable_levels()
        .into_iter()
        .map(|l| KernelSet::for_level(l).unwrap())
        .collect();
    sets.dedup_by_key(|s| s.name());

    for set in sets {
        for rows in [1, set.rows_per_block()] {
            let a: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
            let refs: Vec<&[f32]> = a.iter().map(|r| r.as_slice()).collect();
            let mut out = vec![0f32; rows * 32];
            g.throughput(Throughput::Elements((2 * rows * 32 * k) as u64));
            g.bench_function(BenchmarkId::new(set.name(), rows), |b| {
                b.iter(|| set.panel_dot(&refs, &panel, &mut out))
            });
        }
    }
    if let Ok(set) = KernelSet::with_bf16(kt_core::isa::global().unwrap().detected, 1) {
        let rows = set.bf16().unwrap().rows_per_block;
        let a: Vec<Vec<u32>> = (0..rows)
            .map(|_| (0..k / 2).map(|i| 0x3f80_3f80 ^ i as u32).collect())
            .collect();
        let refs: Vec<&[u32]> = a.iter().map(|r| r.as_slice()).collect();
        let mut out = vec![0f32; rows * 32];
        g.throughput(Throughput::Elements((2 * rows * 32 * k) as u64));
        g.bench_function(BenchmarkId::new("avx512-bf16dot", rows), |b| {
            b.iter(|| set.panel_dot_bf16(&refs, &panel, &mut out))
        });
    }
    g.finish();
}

fn int_kernels(c: &mut Criterion) {
    // Every vector int8 variant this CPU runs (VNNI, AVX-512BW, AVX2), in-cache, k = 2048.
    let detected = kt_core::isa::global().unwrap().detected;
    let sets: Vec<KernelSet> = [Level::Avx2, Level::Avx512Base, Level::Avx512Vnni]
        .into_iter()
        .filter(|l| *l <= detected)
        .map(|l| KernelSet::for_level(l).unwrap())
        .collect();
    let k = 2048;
    let mut rng = Rng::new(4);
    let w8: Vec<i8> = (0..32 * k)
        .map(|_| (rng.below(255) as i32 - 127) as i8)
        .collect();
    let w4: Vec<i8> = (0..32 * k)
        .map(|_| (rng.below(15) as i32 - 7) as i8)
        .collect();
    let g8 = kt_core::quant::pack_amx_int8(&w8, 32, k).unwrap();
    let g4 = kt_core::quant::pack_amx_int4(&w4, 32, k).unwrap();
    let sums = [0i32; 32];
    let mut grp = c.benchmark_group("int_dot_k2048");
    for set in &sets {
        let int8 = kt_core::formats::int8::kernels::vector_kernel(set.level());
        let int4 = kt_core::formats::int4::kernels::vector_kernel(set.level());
        for (name, kern, group) in [("int8", int8, &g8), ("int4", int4, &g4)] {
            let f = kern.dot;
            for rows in [1, kern.rows] {
                let a: Vec<Vec<u8>> = (0..rows)
                    .map(|_| {
                        let biased: Vec<u8> = (0..k).map(|_| 1 + rng.below(255) as u8).collect();
                        kt_core::kernels::group_dot::activation_row(&biased)
                    })
                    .collect();
                let ptrs: Vec<*const u8> = a.iter().map(|r| r.as_ptr()).collect();
                let mut out = vec![0i32; rows * 32];
                grp.throughput(Throughput::Elements((2 * rows * 32 * k) as u64));
                grp.bench_function(
                    BenchmarkId::new(format!("{name}-{}", kern.name), rows),
                    |b| {
                        // SAFETY: sizes follow the kernel contract (k % 128 == 0, 32-row groups).
                        b.iter(|| unsafe {
                            f(&ptrs, k, group.as_ptr(), sums.as_ptr(), out.as_mut_ptr())
                        })
                    },
                );
            }
        }
    }
    grp.finish();
}

/// The group-scaled formats' kernels on one 32-row panel (k = 2048): the integer few-row
/// kernels (4-bit codes), the fp32 fused kernel (E4M3 codes) and the bf16-panel decoders.
/// Throughput counts weights (× bits/8 = bytes streamed).
fn kgroup_kernels(c: &mut Criterion) {
    use kt_core::codes::{CodeKind, ScaleType, INT4_VALUES};
    use kt_core::formats::kgroup::{int_dot, kernels};
    let detected = kt_core::isa::global().unwrap().detected;
    let levels: Vec<Level> = [Level::Avx2, Level::Avx512Vnni, Level::Avx512Bf16]
        .into_iter()
        .filter(|l| *l <= detected)
        .collect();
    let k = 2048;
    let mut rng = Rng::new(6);
    let nibbles: Vec<u8> = (0..16 * k).map(|_| rng.below(256) as u8).collect();
    let bytes: Vec<u8> = (0..32 * k).map(|_| rng.below(0x7E) as u8).collect();
    // bf16 1.0 (0x3F80) per group and row; E8M0 2^-7 for the byte codes.
    let bf16_scales: Vec<u8> = (0..(k / 32) * 32).flat_map(|_| [0x80u8, 0x3F]).collect();
    let e8m0_scales: Vec<u8> = vec![120; (k / 32) * 32];
    let mut grp = c.benchmark_group("kgroup_k2048");
    grp.throughput(Throughput::Elements((32 * k) as u64));
    type KernelFor = fn(Level) -> Option<(int_dot::IntFusedFn, usize)>;
    let families: [(&str, KernelFor); 3] = [
        ("int", int_dot::int_fused_for),
        ("gemm", int_dot::int_gemm_for),
        ("finegemm", int_dot::int_fine_gemm_for),
    ];
    for level in &levels {
        for ((family, kernel_for), (kind, st, scales)) in families.into_iter().flat_map(|f| {
            [
                (CodeKind::Int4, ScaleType::Bf16, &bf16_scales),
                (CodeKind::E2M1, ScaleType::E8M0, &e8m0_scales),
            ]
            .map(|k| (f, k))
        }) {
            let (int, max_rows) = kernel_for(*level).unwrap();
            let w = int_dot::WeightBytes::of(kind, st);
            for rows in [1, max_rows] {
                // Decode counts weights streamed; the many-row kernels multiply-adds.
                grp.throughput(Throughput::Elements(
                    (32 * k * if family == "int" { 1 } else { rows }) as u64,
                ));
                let data: Vec<Vec<u8>> = (0..rows)
                    .map(|_| {
                        let mut row = vec![0u8; int_dot::row_bytes(k, 32)];
                        int_dot::prepare_row(&rng.normals(k, 1.0), 32, &w, &mut row);
                        row
                    })
                    .collect();
                let ptrs: Vec<*const u8> = data.iter().map(|r| r.as_ptr()).collect();
                let mut out = vec![0f32; 32 * rows];
                let (c, s, o) = (nibbles.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
                let id = BenchmarkId::new(format!("{family}-{kind:?}-{level:?}"), rows);
                // SAFETY: rows prepared for k inputs, a 32 × k panel, its scales, 32 outputs
                // per row; the level was detected.
                grp.bench_function(id, |b| {
                    b.iter(|| unsafe { int(&ptrs, k, (0, k), 32, 32, c, s, &w, o) })
                });
            }
        }
        grp.throughput(Throughput::Elements((32 * k) as u64));
        let set = kernels::kernels_for(CodeKind::E4M3, *level);
        if let Some((fused, max_rows)) = set.fused {
            for rows in [1, max_rows] {
                let xs: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
                let ptrs: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
                let mut out = vec![0f32; 32 * rows];
                let (c, s, o) = (bytes.as_ptr(), e8m0_scales.as_ptr(), out.as_mut_ptr());
                let id = BenchmarkId::new(format!("fused-E4M3-{level:?}"), rows);
                // SAFETY: as above, fp32 rows of k inputs and no NaN codes.
                grp.bench_function(id, |b| {
                    b.iter(|| unsafe { fused(&ptrs, k / 2, 16, c, s, ScaleType::E8M0, o) })
                });
            }
        }
        for (kind, codes) in [(CodeKind::Int4, &nibbles), (CodeKind::E4M3, &bytes)] {
            let decode = kernels::kernels_for(kind, *level).decode;
            // NVFP4's stored scales (E4M3), which the decoder widens itself.
            let e4m3 = ScaleType::E4M3;
            let e4m3_scales = vec![e4m3.encode_at_least(0.01) as u8; (k / 32) * 32];
            let mut out = vec![0u16; 32 * k];
            let (c, s, o) = (codes.as_ptr(), e4m3_scales.as_ptr(), out.as_mut_ptr());
            let id = BenchmarkId::new(format!("decode-{kind:?}"), format!("{level:?}"));
            // SAFETY: k/2 lines of codes, their scales, 64 values per line out.
            grp.bench_function(id, |b| {
                b.iter(|| unsafe { decode(c, k / 2, 16, s, e4m3, &INT4_VALUES, o) })
            });
        }
    }
    // The activation rows the integer kernels read (every decode's x and SwiGLU rows), with
    // this CPU's widest vectors; elements are inputs.
    let w = int_dot::WeightBytes::of(CodeKind::Int4, ScaleType::Bf16);
    let x = rng.normals(k, 1.0);
    let mut row = vec![0u8; int_dot::row_bytes(k, 32)];
    grp.throughput(Throughput::Elements(k as u64));
    grp.bench_function("prepare-row", |b| {
        b.iter(|| int_dot::prepare_row_parts(&x, 32, &w, false, &mut row))
    });
    grp.finish();
}

fn layer(c: &mut Criterion) {
    let pool = pool(2);
    // Per format two layers, alternated, so weights come from DRAM.
    for (format, name, bytes_per_weight) in [
        (Method::Bf16, "moe_bf16_qwen3_30b_a3b", 2.0),
        (Method::AmxInt8, "moe_int8_qwen3_30b_a3b", 1.0),
        (Method::AmxInt4, "moe_int4_qwen3_30b_a3b", 0.5),
        (
            Method::Fp8,
            "moe_fp8_qwen3_30b_a3b",
            1.0 + 4.0 / (128.0 * 128.0),
        ),
        (
            Method::Fp8PerChannel,
            "moe_fp8_perchannel_qwen3_30b_a3b",
            1.0,
        ),
        (
            Method::RawInt4,
            "moe_rawint4_qwen3_30b_a3b",
            0.5 + 2.0 / 32.0,
        ),
        (
            Method::GptqInt4,
            "moe_gptq_int4_qwen3_30b_a3b",
            0.5 + 2.0 / 128.0,
        ),
        (Method::MxFp4, "moe_mxfp4_qwen3_30b_a3b", 0.5 + 1.0 / 32.0),
        (Method::NvFp4, "moe_nvfp4_qwen3_30b_a3b", 0.5 + 1.0 / 16.0),
        (Method::MxFp8, "moe_mxfp8_qwen3_30b_a3b", 1.0 + 1.0 / 32.0),
    ] {
        layer_format(c, &pool, format, name, bytes_per_weight);
    }
}

fn layer_format(
    c: &mut Criterion,
    pool: &kt_core::pool::Pool,
    format: Method,
    name: &str,
    bytes_per_weight: f64,
) {
    let (e, k, h, i) = (128, 8, 2048, 768);
    let layers = [
        synthetic_layer_as(pool, e, k, h, i, 512, KernelSet::best().unwrap(), format),
        synthetic_layer_as(pool, e, k, h, i, 512, KernelSet::best().unwrap(), format),
    ];
    let mut ws = Workspace::new();
    let mut rng = Rng::new(5);
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    for tokens in [1usize, 32, 512] {
        let x = rng.normals(tokens * h, 1.0);
        // Fresh routing per call (cycled): one fixed routing would keep a decode's few
        // experts of both layers in the last-level cache (int4: 2 × 9.4 MB).
        let routings: Vec<_> = (0..16).map(|_| routing(&mut rng, tokens, e, k)).collect();
        let mut out = vec![0f32; tokens * h];
        let distinct: usize = routings
            .iter()
            .map(|(ids, _)| {
                let mut v = ids.clone();
                v.sort();
                v.dedup();
                v.len()
            })
            .sum::<usize>()
            / routings.len();
        g.throughput(Throughput::Bytes(
            (distinct as f64 * 3.0 * (h * i) as f64 * bytes_per_weight) as u64,
        ));
        let mut call = 0usize;
        g.bench_function(BenchmarkId::new("tokens", tokens), |b| {
            b.iter(|| {
                call += 1;
                let (ids, w) = &routings[(call / 2) % routings.len()];
                layers[call % 2]
                    .forward_f32(pool, &mut ws, &x, ids, w, &mut out)
                    .unwrap()
            })
        });
    }
    g.finish();
}

/// GGUF dot kernels: 32 weight rows (k = 2048) against 1 and 8 activation rows, the
/// single-row kernel per pair and `dot_many` (the multi-row kernel, a weight row decoded once
/// per 4 activation rows). Throughput counts multiply-adds (Gelem/s × 2 = GOP/s).
fn ggml_kernels(c: &mut Criterion) {
    use kt_core::ggml::{quantize, quantize_activation, DotKernel, GgmlType};
    let k = 2048;
    let mut rng = kt_core::rng::Rng::new(5);
    let mut grp = c.benchmark_group("ggml_dot_k2048");
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let kernel = DotKernel::best(ty).unwrap();
        let w = quantize(ty, &rng.normals(32 * k, 0.02)).unwrap();
        let rb = ty.row_bytes(k).unwrap();
        let format = ty.activation_format().unwrap();
        for acts_n in [1, 8] {
            let acts: Vec<Vec<u8>> = (0..acts_n)
                .map(|_| quantize_activation(format, &rng.normals(k, 1.0)).unwrap())
                .collect();
            let refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
            let mut out = vec![0f32; acts_n * 32];
            grp.throughput(Throughput::Elements((32 * k * acts_n) as u64));
            let label = format!("{}-{}", ty.name(), kernel.name());
            grp.bench_function(BenchmarkId::new(format!("{label}/pairs"), acts_n), |b| {
                b.iter(|| {
                    for (i, a) in refs.iter().enumerate() {
                        for j in 0..32 {
                            out[i * 32 + j] = kernel.dot(k, &w[j * rb..(j + 1) * rb], a);
                        }
                    }
                })
            });
            if acts_n > 1 && kernel.has_rows_kernel() {
                grp.bench_function(BenchmarkId::new(format!("{label}/many"), acts_n), |b| {
                    b.iter(|| kernel.dot_many(k, &w, &refs, &mut out, 32))
                });
            }
            if kernel.has_x8() {
                let gb = kernel.memory_row_bytes(k).unwrap() * 8;
                let mut groups = vec![0u8; 4 * gb];
                for g in 0..4 {
                    kernel.repack_x8(
                        &w[g * 8 * rb..(g + 1) * 8 * rb],
                        k,
                        &mut groups[g * gb..(g + 1) * gb],
                    );
                }
                grp.bench_function(BenchmarkId::new(format!("{label}/x8"), acts_n), |b| {
                    b.iter(|| kernel.dot_x8(k, &groups, &refs, &mut out, 32))
                });
            }
        }
    }
    grp.finish();
}

/// Online quantization's inner loop (`load_weights_from_tensors` for the native formats): 32
/// rows of 2048 f32 values (in cache) to codes and group scales, the dispatched vector variant
/// against the scalar twin; throughput in bytes of f32 input.
fn online_quantize(c: &mut Criterion) {
    use kt_core::codes::{CodeKind, ScaleType};
    use kt_core::encode::{quantize_row, quantize_row_scalar};
    let (k, rows) = (2048, 32);
    let values = Rng::new(6).normals(rows * k, 0.02);
    let mut g = c.benchmark_group("online_quantize_k2048");
    g.throughput(Throughput::Bytes((4 * rows * k) as u64));
    let cases = [
        ("MXFP4", CodeKind::E2M1, ScaleType::E8M0, 1.0, 32),
        ("NVFP4", CodeKind::E2M1, ScaleType::E4M3, 1e-4, 16),
        ("RAWINT4", CodeKind::Int4, ScaleType::Bf16, 1.0, 32),
        ("MXFP8", CodeKind::E4M3, ScaleType::E8M0, 1.0, 32),
    ];
    type Quantizer = fn(CodeKind, ScaleType, f32, &[f32], usize, &mut [u8], &mut [u16]);
    let variants: [(&str, Quantizer); 2] =
        [("vector", quantize_row), ("scalar", quantize_row_scalar)];
    for (name, kind, st, global, group) in cases {
        let mut codes = vec![0u8; k * kind.bits() / 8];
        let mut scales = vec![0u16; k / group];
        for (variant, f) in variants {
            g.bench_function(BenchmarkId::new(name, variant), |b| {
                b.iter(|| {
                    for row in values.chunks_exact(k) {
                        f(kind, st, global, row, group, &mut codes, &mut scales);
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    online_quantize,
    panel_kernels,
    int_kernels,
    kgroup_kernels,
    ggml_kernels,
    layer
);
criterion_main!(benches);
