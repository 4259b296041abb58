//! The quantizer and byte order against files written by the original kt-kernel 0.7.2.
use super::*;
use crate::rng::Rng;
use std::path::PathBuf;

#[test]
fn layouts_are_bijections_and_round_trip() {
    let (n, k) = (64, 256);
    let mut rng = Rng::new(4);
    let q8: Vec<i8> = (0..n * k)
        .map(|_| (rng.below(256) as i32 - 128) as i8)
        .collect();
    assert_eq!(
        unpack_amx_int8(&pack_amx_int8(&q8, n, k).unwrap(), n, k).unwrap(),
        q8
    );
    let q4: Vec<i8> = (0..n * k)
        .map(|_| (rng.below(16) as i32 - 8) as i8)
        .collect();
    assert_eq!(
        unpack_amx_int4(&pack_amx_int4(&q4, n, k).unwrap(), n, k).unwrap(),
        q4
    );
    let mut seen = vec![false; n * k];
    for r in 0..n {
        for c in 0..k {
            let o = amx_int8_offset(r, c, k);
            assert!(!seen[o]);
            seen[o] = true;
        }
    }
    // Every 64-byte line holds 16 rows x 4 consecutive inputs (the vpdpbusd operand).
    assert_eq!(
        amx_int8_offset(0, 0, k) / 64,
        amx_int8_offset(15, 3, k) / 64
    );
    // Shapes the tiles cannot hold are refused.
    assert!(pack_amx_int8(&vec![0; 16 * 64], 16, 64).is_err());
    assert!(pack_amx_int4(&vec![0; 32 * 64], 32, 64).is_err());
}

/// The original's file offset of (r, c), written from its buffer's address arithmetic
/// independently of [`file_runs`]: (byte, nibble).
fn file_offset(int4: bool, r: usize, c: usize, n: usize, k: usize) -> (usize, usize) {
    let (nb, step) = if int4 { (128, 128) } else { (64, 64) };
    let (nb0, kb0) = (r / nb * nb, c / FILE_K_BLOCK * FILE_K_BLOCK);
    let (nbs, kbs) = (nb.min(n - nb0), FILE_K_BLOCK.min(k - kb0));
    let (rg, kc) = ((r - nb0) / 32 * 32, c - kb0);
    let base = nb0 * k + kb0 * nbs + rg * kbs + kc / step * step * 32;
    let (rr, cc) = (r % 32, kc % step);
    let inner = |j: usize| (rr / 16) * 1024 + (j / 4) * 64 + (rr % 16) * 4 + j % 4;
    if int4 {
        (base / 2 + inner(cc % 64), cc / 64)
    } else {
        (base + inner(cc), 0)
    }
}

#[test]
fn wide_matrices_use_the_originals_row_and_column_blocks_in_files() {
    let mut rng = Rng::new(12);
    // k beyond one 3584 block (and a short last block); n with a short last row block.
    for (int4, n, k) in [
        (false, 160, 7168),
        (false, 96, 3584 + 640),
        (true, 160, 7168),
        (true, 288, 3584 + 256),
        (false, 64, 2048),
    ] {
        let v: Vec<i8> = (0..n * k)
            .map(|_| if int4 { rng.below(15) as i32 - 7 } else { rng.below(255) as i32 - 127 } as i8)
            .collect();
        let mem = if int4 {
            pack_amx_int4(&v, n, k)
        } else {
            pack_amx_int8(&v, n, k)
        }
        .unwrap();
        let mut file = vec![0u8; mem.len()];
        to_file_layout(int4, n, k, &mem, &mut file).unwrap();
        for r in 0..n {
            for c in 0..k {
                let (at, nib) = file_offset(int4, r, c, n, k);
                let got = if int4 {
                    ((file[at] >> (4 * nib)) << 4) as i8 >> 4
                } else {
                    file[at] as i8
                };
                assert_eq!(got, v[r * k + c], "int4={int4} {n}x{k} ({r},{c})");
            }
        }
        let mut back = vec![0u8; mem.len()];
        from_file_layout(int4, n, k, &file, &mut back).unwrap();
        assert!(back == mem);
        if k <= FILE_K_BLOCK {
            assert!(file == mem, "narrow matrices keep one layout");
        }
    }
    // The worked example (INT8, 64 x 7168) from the original's address arithmetic.
    let at = |r, c| file_offset(false, r, c, 64, 7168).0;
    assert_eq!(
        [at(0, 0), at(0, 3584), at(31, 3647), at(32, 0), at(63, 7167)],
        [0, 229376, 231423, 114688, 458751]
    );
}

#[test]
fn matrix_quantizer_equals_the_row_rules_and_the_layout() {
    let mut rng = Rng::new(21);
    for int4 in [false, true] {
        let (n, k) = (64, 384);
        // fp32 weights: the quantizer sees them rounded to bf16 first.
        let w = rng.normals(n * k, 0.05);
        let view = crate::pack::MatrixView::from_bytes(
            bytemuck_f32(&w),
            crate::dtype::FloatType::F32,
            n,
            k,
        )
        .unwrap();
        let mut out = vec![0u8; matrix_bytes(int4, n, k)];
        let (mut scales, mut sums) = (vec![0f32; n], vec![0i32; n]);
        // SAFETY: `w` is alive.
        unsafe { quantize_matrix(&view, int4, &mut out, &mut scales, Some(&mut sums)) }.unwrap();
        let mut q = vec![0i8; n * k];
        for r in 0..n {
            let row: Vec<f32> = w[r * k..(r + 1) * k]
                .iter()
                .map(|&x| crate::dtype::bf16_bits_to_f32(crate::dtype::f32_to_bf16_bits(x)))
                .collect();
            let d = if int4 {
                quantize_row_int4(&row, &mut q[r * k..(r + 1) * k])
            } else {
                quantize_row_int8(&row, &mut q[r * k..(r + 1) * k])
            };
            assert_eq!(d.to_bits(), scales[r].to_bits());
            let mult = if int4 { 16 } else { 1 };
            assert_eq!(
                sums[r],
                q[r * k..(r + 1) * k]
                    .iter()
                    .map(|&v| mult * v as i32)
                    .sum::<i32>()
            );
        }
        let want = if int4 {
            pack_amx_int4(&q, n, k)
        } else {
            pack_amx_int8(&q, n, k)
        }
        .unwrap();
        assert!(out == want, "int4={int4}");
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 no alignment needs.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

#[test]
fn quantizers_follow_the_rules() {
    let row = [0.5f32, -1.0, 0.25, 1.0 / 127.0];
    let mut q = [0i8; 4];
    let d = quantize_row_int8(&row, &mut q);
    assert_eq!(d, 1.0 * (1.0f32 / 127.0));
    assert_eq!(q, [64, -127, 32, 1]); // 63.5 rounds half to even: 64
    let mut v = [0i8; 4];
    let d4 = quantize_row_int4(&row, &mut v);
    assert_eq!(d4, (1.0f64 / 112.0) as f32);
    assert_eq!(v, [4, -7, 2, 0]); // 56/16 = 3.5 -> 4 (away from zero), 28/16 = 1.75 -> 2
    let mut z = [5i8; 3];
    assert_eq!(quantize_row_int8(&[0.0; 3], &mut z), 0.0);
    assert_eq!(z, [0; 3]);
}

fn fixtures() -> Option<PathBuf> {
    crate::testutil::fixtures("amx")
}

fn tensor_bytes(file: &std::path::Path, name: &str) -> (Vec<u8>, String, Vec<usize>) {
    let data = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("{name} missing in {}", file.display()));
    (
        t.data().to_vec(),
        format!("{:?}", t.dtype()),
        t.shape().to_vec(),
    )
}

fn bf16_matrix(hf: &std::path::Path, name: &str) -> (Vec<f32>, usize, usize) {
    let (bytes, dtype, shape) = tensor_bytes(hf, name);
    assert_eq!(dtype, "BF16");
    let vals = bytes
        .chunks_exact(2)
        .map(|b| crate::dtype::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])))
        .collect();
    (vals, shape[0], shape[1])
}

/// Quantize `[n][k]` columns `c0..c0+kc` row by row like the converter does for one NUMA part.
fn quantize(
    w: &[f32],
    k: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    int4: bool,
) -> (Vec<i8>, Vec<f32>) {
    let kc = cols.len();
    let mut q = vec![0i8; rows.len() * kc];
    let mut scales = Vec::new();
    for (i, r) in rows.enumerate() {
        let row = &w[r * k + cols.start..r * k + cols.end];
        let out = &mut q[i * kc..(i + 1) * kc];
        scales.push(if int4 {
            quantize_row_int4(row, out)
        } else {
            quantize_row_int8(row, out)
        });
    }
    (q, scales)
}

#[test]
fn converted_files_of_the_original_are_reproduced_byte_for_byte() {
    let Some(dir) = fixtures() else {
        eprintln!("shared/fixtures not present; skipped");
        return;
    };
    let hf = dir.join("hf/model.safetensors");
    for (set, int4, tp) in [
        ("int8-tp1", false, 1),
        ("int8-tp2", false, 2),
        ("int4-tp1", true, 1),
        ("int4-tp2", true, 2),
    ] {
        let merged = dir.join(format!("{set}-merged/model-00001-of-00002.safetensors"));
        for e in 0..4 {
            for proj in ["gate", "up", "down"] {
                let (w, n, k) = bf16_matrix(
                    &hf,
                    &format!("model.layers.1.mlp.experts.{e}.{proj}_proj.weight"),
                );
                for part in 0..tp {
                    // gate/up: a block of rows; down: a block of columns, re-quantized per part.
                    let (rows, cols) = if proj == "down" {
                        (0..n, part * k / tp..(part + 1) * k / tp)
                    } else {
                        (part * n / tp..(part + 1) * n / tp, 0..k)
                    };
                    let (pn, pk) = (rows.len(), cols.len());
                    let (q, scales) = quantize(&w, k, rows, cols, int4);
                    let bytes = if int4 {
                        pack_amx_int4(&q, pn, pk)
                    } else {
                        pack_amx_int8(&q, pn, pk)
                    }
                    .unwrap();
                    let key = format!("blk.1.ffn_{proj}_exps.{e}.numa.{part}");
                    let (want, dtype, _) = tensor_bytes(&merged, &format!("{key}.weight"));
                    assert_eq!(dtype, "I8");
                    assert!(bytes == want, "{set} {key}: quantized bytes differ");
                    let (want_scale, _, _) = tensor_bytes(&merged, &format!("{key}.scale"));
                    let got_scale: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                    assert!(got_scale == want_scale, "{set} {key}: scales differ");
                    // And the .kt folder holds the same bytes.
                    let kt = dir.join(format!("{set}-kt/_layer_1/_numa_{part}"));
                    let tag = if int4 { "INT4" } else { "INT8" };
                    let f = kt.join(format!("{tag}_{proj}_{e}_{}Byte_quant_.kt", want.len()));
                    assert_eq!(std::fs::read(&f).unwrap(), want, "{}", f.display());
                }
            }
        }
    }
}

#[test]
fn quantized_values_never_reach_minus_128() {
    // The AVX2 int8 kernel's sign trick relies on |q| ≤ 127.
    let mut rng = Rng::new(8);
    for _ in 0..200 {
        let row = rng.normals(257, 3.0);
        let mut q = vec![0i8; row.len()];
        quantize_row_int8(&row, &mut q);
        assert!(q.iter().all(|&v| v >= -127));
        assert!(q.contains(&127) || q.contains(&-127));
    }
}

#[test]
fn all_finite_sees_nan_and_infinities_anywhere() {
    // NaN at every position of the 8-lane body and of the tail: f32::max would drop it.
    let mut rng = Rng::new(9);
    let row = rng.normals(21, 1.0);
    assert!(all_finite(&row) && all_finite(&[]) && all_finite(&[f32::MAX, -f32::MAX]));
    for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in 0..row.len() {
            let mut r = row.clone();
            r[at] = bad;
            assert!(!all_finite(&r), "{bad} at {at}");
        }
    }
}

#[test]
fn quantizing_a_non_finite_row_is_refused_with_its_index() {
    let (n, k) = (32, 128);
    let mut w = Rng::new(10).normals(n * k, 0.1);
    w[7 * k + 3] = f32::NAN;
    let view =
        crate::pack::MatrixView::from_bytes(bytemuck_f32(&w), crate::dtype::FloatType::F32, n, k)
            .unwrap();
    for int4 in [false, true] {
        let mut out = vec![0u8; matrix_bytes(int4, n, k)];
        let mut scales = vec![0f32; n];
        // SAFETY: `w` outlives the call.
        let err = unsafe { quantize_matrix(&view, int4, &mut out, &mut scales, None) };
        assert!(err.unwrap_err().to_string().contains("weight row 7"));
    }
}
