//! Diagnostic: decode latency of one layer per weight format, alternating two layers so the
//! weights come from DRAM. `cargo run --release -p kt-benches --example decode [-- METHOD]`
//! (`int8`, `bf16`, `int4` or any method name, e.g. RAWINT4; GB/s for the first three).
use kt_core::kernels::KernelSet;
use kt_core::method::Method;
use kt_core::moe::Workspace;
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    // THREADS=1: a lone core's decode (the same rate in every memory state of our VMs).
    let pool = kt_benches::pool(kt_benches::env_or("THREADS", 2));
    // DECODE_I shrinks the intermediate size: with tiny experts what remains is fixed overhead.
    let i: usize = kt_benches::env_or("DECODE_I", 768);
    let (e, k, h) = (128, 8, 2048);
    let mut rng = Rng::new(2);
    let formats: Vec<Method> = match std::env::args().nth(1).as_deref() {
        Some("int8") => vec![Method::AmxInt8],
        Some("bf16") => vec![Method::Bf16],
        Some("int4") => vec![Method::AmxInt4],
        Some(name) => vec![Method::parse(name).expect("a method name")],
        None => vec![Method::Bf16, Method::AmxInt8, Method::AmxInt4],
    };
    for format in formats {
        let layers: Vec<_> = (0..2)
            .map(|_| {
                kt_benches::synthetic_layer_as(
                    &pool,
                    e,
                    k,
                    h,
                    i,
                    64,
                    KernelSet::best().unwrap(),
                    format,
                )
            })
            .collect();
        // ROWWISE=0: the prefill's down scheme (one column block per thread, whatever the
        // width) instead of the decode's.
        let mut layers = layers;
        if kt_benches::env_or("ROWWISE", 1) == 0 {
            layers.iter_mut().for_each(|l| l.set_rowwise_down_limit(0));
        }
        let mut ws = Workspace::new();
        // TOKENS=4: a four-token decode step.
        let tokens: usize = kt_benches::env_or("TOKENS", 1);
        let x = rng.normals(tokens * h, 1.0);
        let mut out = vec![0f32; tokens * h];
        let mut best = f64::MAX;
        let mut times = Vec::new();
        let iters = kt_benches::env_or("ITERS", 200);
        for it in 0..iters {
            let (ids, w) = kt_benches::routing(&mut rng, tokens, e, k);
            let t = Instant::now();
            layers[it % 2]
                .forward_f32(&pool, &mut ws, &x, &ids, &w, &mut out)
                .unwrap();
            let dt = t.elapsed().as_secs_f64();
            best = best.min(dt);
            times.push(dt);
        }
        times.sort_by(f64::total_cmp);
        // Weight bytes of one token's 8 experts, for the methods without scale bytes; other
        // methods and several tokens (their distinct experts vary): latency only.
        let bytes = match format {
            Method::Bf16 => Some(8 * 3 * h * i * 2),
            Method::AmxInt8 => Some(8 * 3 * h * i),
            Method::AmxInt4 => Some(8 * 3 * h * i / 2),
            _ => None,
        }
        .filter(|_| tokens == 1);
        let rate = bytes.map_or(String::new(), |b| {
            format!(" ({:.1} GB/s)", b as f64 / times[iters / 2] / 1e9)
        });
        println!(
            "{format:?}: median {:.3} ms{rate}, best {:.3} ms",
            times[iters / 2] * 1e3,
            best * 1e3
        );
    }
    println!(
        "probe {:.1} GB/s",
        kt_core::probe::dram_read_gbps(&pool, 1 << 30, 3).unwrap()
    );
    // Kernel alone: one 32-row int8 group (k = 2048) from cache, 1 row.
    let set = KernelSet::best().unwrap();
    let int8 = kt_core::formats::int8::kernels::vector_kernel(set.level());
    let kk = 2048;
    let group = vec![1u8; 32 * kk];
    let sums = [0i32; 32];
    let a = kt_core::kernels::group_dot::activation_row(&vec![129u8; kk]);
    let mut out = [0i32; 32];
    let t = Instant::now();
    for _ in 0..20000 {
        // SAFETY: sizes as the kernel contract requires.
        unsafe {
            (int8.dot)(
                &[a.as_ptr()],
                kk,
                group.as_ptr(),
                sums.as_ptr(),
                out.as_mut_ptr(),
            )
        };
        std::hint::black_box(&out);
    }
    let dt = t.elapsed().as_secs_f64() / 20000.0;
    println!(
        "int8 kernel, 1 row x 32 x {kk} from cache: {:.2} us ({:.1} GB/s)",
        dt * 1e6,
        (32 * kk) as f64 / dt / 1e9
    );
}
