//! The converter against the original's own output (the fixtures), and on synthetic sharded
//! checkpoints of every input precision: what it writes loads into the same layer as quantizing
//! the checkpoint online.
use super::*;
use crate::converted::ConvertedLayer;
use crate::kernels::KernelSet;
use crate::moe::{MoeConfig, MoeLayer, Workspace};
use crate::rng::Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::BTreeMap;

fn fixtures() -> Option<PathBuf> {
    crate::testutil::fixtures("amx")
}

fn pool(parts: usize) -> Pool {
    crate::testutil::pool(parts, 2)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kt-convert-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn opts(input: &Path, output: &Path, format: Method, parts: usize, merge: bool) -> ConvertOptions {
    ConvertOptions {
        input: input.to_path_buf(),
        output: output.to_path_buf(),
        method: format,
        input_type: None,
        parts,
        merge,
        resume_layer: 0,
    }
}

/// Every file under `dir`, by relative path.
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn fixture_checkpoint_converts_to_the_originals_files_byte_for_byte() {
    let Some(root) = fixtures() else { return };
    for (format, bits) in [(Method::AmxInt8, "int8"), (Method::AmxInt4, "int4")] {
        for tp in [1, 2] {
            for (merge, layout) in [(true, "merged"), (false, "kt")] {
                let out = tmpdir(&format!("fx-{bits}-{tp}-{layout}"));
                let progress = ConvertProgress::default();
                let mut o = opts(&root.join("hf"), &out, format, tp, merge);
                o.input_type = Some(InputType::Bf16);
                let report = convert(&pool(1), &o, &progress).unwrap();
                assert_eq!(report.layers, vec![1]);
                assert_eq!(progress.layers_done.load(Ordering::Relaxed), 1);
                assert_eq!(
                    progress.bytes_done.load(Ordering::Relaxed),
                    progress.bytes_total.load(Ordering::Relaxed)
                );
                let theirs = tree(&root.join(format!("{bits}-tp{tp}-{layout}")));
                let ours = tree(&out);
                assert_eq!(
                    ours.keys().collect::<Vec<_>>(),
                    theirs.keys().collect::<Vec<_>>(),
                    "{bits} tp{tp} {layout}: file set"
                );
                for (name, bytes) in &theirs {
                    assert!(
                        &ours[name] == bytes,
                        "{bits} tp{tp} {layout}: {name} differs"
                    );
                }
                std::fs::remove_dir_all(&out).unwrap();
            }
        }
    }
}

/// How a synthetic checkpoint stores its experts.
#[derive(Clone, Copy, Debug)]
enum Store {
    Bf16,
    F16,
    Fp8,
}

/// A sharded Qwen-MoE-style checkpoint: `layers` layers, each with a norm (not converted) and
/// experts (layer 0 dense, so MoE layers are 1..), one shard per layer plus an index.
fn synthetic_checkpoint(dir: &Path, store: Store, e: usize, h: usize, i: usize, layers: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = Rng::new(40 + store as u64);
    let mut weight_map = serde_json::Map::new();
    for l in 0..layers {
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let norm: Vec<u8> = (0..h)
            .flat_map(|_| crate::dtype::f32_to_bf16_bits(1.0 + 0.1 * rng.normal()).to_le_bytes())
            .collect();
        tensors.push((
            format!("model.layers.{l}.input_layernorm.weight"),
            Dtype::BF16,
            vec![h],
            norm,
        ));
        if l > 0 {
            for x in 0..e {
                for (proj, rows, cols) in
                    [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]
                {
                    let name = format!("model.layers.{l}.mlp.experts.{x}.{proj}.weight");
                    let w = rng.normals(rows * cols, 0.02);
                    match store {
                        Store::Bf16 => tensors.push((
                            name,
                            Dtype::BF16,
                            vec![rows, cols],
                            w.iter()
                                .flat_map(|&v| crate::dtype::f32_to_bf16_bits(v).to_le_bytes())
                                .collect(),
                        )),
                        Store::F16 => tensors.push((
                            name,
                            Dtype::F16,
                            vec![rows, cols],
                            w.iter()
                                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                                .collect(),
                        )),
                        Store::Fp8 => {
                            let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
                            let mut scale = vec![0f32; br * bc];
                            for (r, row) in w.chunks(cols).enumerate() {
                                for (c, v) in row.iter().enumerate() {
                                    let s = &mut scale[(r / 128) * bc + c / 128];
                                    *s = s.max(v.abs() / 448.0);
                                }
                            }
                            let q: Vec<u8> = w
                                .iter()
                                .enumerate()
                                .map(|(idx, &v)| {
                                    let (r, c) = (idx / cols, idx % cols);
                                    crate::dtype::f32_to_e4m3(v / scale[(r / 128) * bc + c / 128])
                                })
                                .collect();
                            tensors.push((name.clone(), Dtype::F8_E4M3, vec![rows, cols], q));
                            tensors.push((
                                format!("{name}_scale_inv"),
                                Dtype::F32,
                                vec![br, bc],
                                scale.iter().flat_map(|v| v.to_le_bytes()).collect(),
                            ));
                        }
                    }
                }
            }
        }
        let file = format!("model-{:05}-of-{layers:05}.safetensors", l + 1);
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for (n, ..) in &tensors {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut config = serde_json::json!({
        "hidden_size": h, "moe_intermediate_size": i, "num_experts": e, "num_experts_per_tok": 2,
    });
    if matches!(store, Store::Fp8) {
        config["quantization_config"] = serde_json::json!({"weight_block_size": [128, 128]});
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"tok\": 1}").unwrap();
}

fn layer(format: Method, e: usize, h: usize, i: usize, l: usize, parts: usize) -> MoeLayer {
    let cfg = MoeConfig {
        layer_idx: l,
        num_experts: e,
        top_k: 2,
        hidden: h,
        intermediate: i,
        max_tokens: 8,
        swiglu_limit: 0.0,
        swiglu_alpha: 0.0,
    };
    MoeLayer::with_method(cfg, parts, KernelSet::best().unwrap(), format).unwrap()
}

#[test]
fn converted_layers_load_equal_to_online_quantization_for_every_input_precision() {
    // H = 3712 > 3584 exercises the original's column blocks of wide matrices in the files.
    for (store, h) in [(Store::Bf16, 256), (Store::F16, 256), (Store::Fp8, 3712)] {
        let (e, i, layers) = (3, 256, 3);
        let input = tmpdir(&format!("in-{store:?}"));
        synthetic_checkpoint(&input, store, e, h, i, layers);
        for (format, parts, merge) in [
            (Method::AmxInt8, 1, true),
            (Method::AmxInt4, 2, false),
            (Method::AmxInt8, 2, true),
        ] {
            let out = tmpdir(&format!("out-{store:?}-{format:?}-{parts}-{merge}"));
            let pool = pool(parts);
            let report = convert(
                &pool,
                &opts(&input, &out, format, parts, merge),
                &Default::default(),
            )
            .unwrap();
            assert_eq!(report.converted, vec![1, 2]);
            if merge {
                assert!(out.join("model-00003-of-00003.safetensors").is_file());
                assert!(out.join("config.json").is_file() && out.join("tokenizer.json").is_file());
                let rest = Checkpoint::open(&out.join("model-00003-of-00003.safetensors")).unwrap();
                assert_eq!(
                    rest.names(),
                    vec![
                        "blk.0.input_layernorm.weight",
                        "blk.1.input_layernorm.weight",
                        "blk.2.input_layernorm.weight"
                    ]
                );
            } else {
                assert!(!out.join("config.json").exists());
            }
            let ckpt = Arc::new(Checkpoint::open(&input).unwrap());
            let mut rng = Rng::new(9);
            let x = rng.normals(4 * h, 1.0);
            let ids: Vec<i64> = (0..8).map(|t| (t % e) as i64).collect();
            let w = vec![0.5f32; 8];
            for l in [1, 2] {
                let mut online = layer(format, e, h, i, l, parts);
                let src = HfLayerSource::new(ckpt.clone(), l, e, h, i).unwrap();
                online.load(&pool, &src, None).unwrap();
                let shape = LayerShape {
                    layer: l,
                    experts: e,
                    hidden: h,
                    intermediate: i,
                    parts,
                    method: format,
                };
                let files = ConvertedLayer::open(&out, shape).unwrap();
                let mut loaded = layer(format, e, h, i, l, parts);
                loaded.load_converted(&pool, &files, None).unwrap();
                for n in 0..parts {
                    for x in 0..e {
                        for (proj, _) in PROJS {
                            assert!(
                                online.quantized_part(x, proj, n).unwrap()
                                    == loaded.quantized_part(x, proj, n).unwrap(),
                                "{store:?} {format:?} layer {l} expert {x} {proj:?} part {n}"
                            );
                        }
                    }
                }
                let mut outs = [vec![0f32; x.len()], vec![0f32; x.len()]];
                for (layer, o) in [&online, &loaded].into_iter().zip(outs.iter_mut()) {
                    layer
                        .forward_f32(&pool, &mut Workspace::new(), &x, &ids, &w, o)
                        .unwrap();
                }
                assert_eq!(outs[0], outs[1]);
            }
            std::fs::remove_dir_all(&out).unwrap();
        }
        std::fs::remove_dir_all(&input).unwrap();
    }
}

#[test]
fn resume_continues_and_checks_what_it_skips() {
    let (e, h, i) = (2, 128, 256);
    let input = tmpdir("resume-in");
    synthetic_checkpoint(&input, Store::Bf16, e, h, i, 4);
    let full = tmpdir("resume-full");
    let pool = pool(1);
    convert(
        &pool,
        &opts(&input, &full, Method::AmxInt8, 1, true),
        &Default::default(),
    )
    .unwrap();
    // Interrupted after layer 1: its shard is there, a stale temporary file too.
    let part = tmpdir("resume-part");
    std::fs::create_dir_all(&part).unwrap();
    let first = shard_name(0, 4);
    std::fs::copy(full.join(&first), part.join(&first)).unwrap();
    let stale = part.join("model-00002-of-00004.safetensors.partial-999999");
    std::fs::write(&stale, b"half").unwrap();
    let mut o = opts(&input, &part, Method::AmxInt8, 1, true);
    o.resume_layer = 2;
    let report = convert(&pool, &o, &Default::default()).unwrap();
    assert_eq!(
        (report.layers.clone(), report.converted.clone()),
        (vec![1, 2, 3], vec![2, 3])
    );
    assert!(!stale.exists());
    assert_eq!(tree(&part), tree(&full));
    // Skipping a layer whose output is missing is an error.
    std::fs::remove_file(part.join(&first)).unwrap();
    let err = convert(&pool, &o, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--resume-layer 2 skips layer 1") && err.contains(&first),
        "{err}"
    );
    for d in [input, full, part] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn bad_inputs_are_refused_with_reasons() {
    let (e, h, i) = (2, 128, 256);
    let input = tmpdir("bad-in");
    synthetic_checkpoint(&input, Store::F16, e, h, i, 2);
    let out = tmpdir("bad-out");
    let pool = pool(1);
    let err = |o: &ConvertOptions| convert(&pool, o, &Default::default()).unwrap_err();
    let mut o = opts(&input, &out, Method::AmxInt8, 1, true);
    o.input_type = Some(InputType::Bf16);
    let e1 = err(&o);
    assert!(
        matches!(e1, Error::Dtype(_)) && e1.to_string().contains("float16"),
        "{e1}"
    );
    // I / parts must keep whole tiles: 256 / 4 = 64 is not a multiple of 128 for int4.
    let e2 = err(&opts(&input, &out, Method::AmxInt4, 4, true)).to_string();
    assert!(e2.contains("64 per part"), "{e2}");
    let e3 = err(&opts(&out.join("nope"), &out, Method::AmxInt8, 1, true));
    assert!(matches!(e3, Error::NotFound(_)), "{e3}");
    let e4 = err(&opts(&input, &input, Method::AmxInt8, 1, true)).to_string();
    assert!(e4.contains("must differ"), "{e4}");
    assert!(InputType::parse("awq").is_err() && InputType::parse("int3").is_err());
    // A missing expert names the tensor.
    std::fs::write(
        input.join("config.json"),
        r#"{"hidden_size": 128, "moe_intermediate_size": 256, "num_experts": 3}"#,
    )
    .unwrap();
    let e5 = err(&opts(&input, &out, Method::AmxInt8, 1, true)).to_string();
    assert!(e5.contains("expert 2 is missing"), "{e5}");
    std::fs::write(input.join("config.json"), "{}").unwrap();
    let e6 = err(&opts(&input, &out, Method::AmxInt8, 1, true)).to_string();
    assert!(e6.contains("hidden_size"), "{e6}");
    // Cancelled before the first matrix: nothing under a final name.
    std::fs::write(
        input.join("config.json"),
        r#"{"hidden_size": 128, "moe_intermediate_size": 256, "num_experts": 2}"#,
    )
    .unwrap();
    let cancelled = ConvertProgress::default();
    cancelled.cancel.store(true, Ordering::Relaxed);
    let e7 = convert(
        &pool,
        &opts(&input, &out, Method::AmxInt8, 1, true),
        &cancelled,
    )
    .unwrap_err();
    assert!(e7.to_string().contains("cancelled"), "{e7}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    for d in [input, out] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn names_are_renamed_like_the_original() {
    assert_eq!(
        renamed_tensor("model.layers.3.self_attn.q_proj.weight"),
        "blk.3.self_attn.q_proj.weight"
    );
    assert_eq!(
        renamed_tensor("model.embed_tokens.weight"),
        "embed_tokens.weight"
    );
    assert_eq!(renamed_tensor("model.norm.weight"), "norm.weight");
    assert_eq!(renamed_tensor("lm_head.weight"), "lm_head.weight");
    assert_eq!(
        renamed_tensor("model.language_model.layers.0.mlp.gate.weight"),
        "blk.0.mlp.gate.weight"
    );
    let index = index_json(&[("a.b".into(), "f1".into()), ("c\"é".into(), "f2".into())]);
    assert_eq!(
        index,
        "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n  \"weight_map\": {\n    \"a.b\": \"f1\",\n    \"c\\\"\\u00e9\": \"f2\"\n  }\n}"
    );
}
