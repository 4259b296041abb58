//! Against the files the original 0.7.2 converter wrote (`shared/fixtures/amx`, made from the
//! synthetic checkpoint `amx/hf`, layer 1, E=4, H=128, I=256).
use super::*;
use crate::kernels::KernelSet;
use crate::moe::{MoeConfig, MoeLayer, Workspace};
use crate::pool::Pool;
use crate::rng::Rng;
use crate::weights::{Checkpoint, HfLayerSource};

fn fixtures() -> Option<PathBuf> {
    crate::testutil::fixtures("amx")
}

fn pool(parts: usize) -> Pool {
    crate::testutil::pool(parts, 2)
}

fn shape(format: Method, parts: usize) -> LayerShape {
    LayerShape {
        layer: 1,
        experts: 4,
        hidden: 128,
        intermediate: 256,
        parts,
        method: format,
    }
}

fn layer(format: Method, parts: usize) -> MoeLayer {
    let cfg = MoeConfig {
        layer_idx: 1,
        num_experts: 4,
        top_k: 2,
        hidden: 128,
        intermediate: 256,
        max_tokens: 8,
        swiglu_limit: 0.0,
        swiglu_alpha: 0.0,
    };
    MoeLayer::with_method(cfg, parts, KernelSet::best().unwrap(), format).unwrap()
}

const SETS: [(Method, &str); 2] = [(Method::AmxInt8, "int8"), (Method::AmxInt4, "int4")];

#[test]
fn original_files_load_equal_to_our_quantizer_and_write_back_byte_identical() {
    let Some(root) = fixtures() else { return };
    let hf = Checkpoint::open(&root.join("hf")).unwrap();
    let src = HfLayerSource::new(hf, 1, 4, 128, 256).unwrap();
    let mut rng = Rng::new(3);
    let x = rng.normals(5 * 128, 1.0);
    let ids: Vec<i64> = (0..10).map(|i| (i * 3 % 4) as i64).collect();
    let w: Vec<f32> = (0..10).map(|i| 0.2 + 0.1 * i as f32).collect();
    for (format, bits) in SETS {
        for tp in [1, 2] {
            let pool = pool(tp);
            let mut quantized = layer(format, tp);
            quantized.load(&pool, &src, None).unwrap();
            for layout in ["merged", "kt"] {
                let dir = root.join(format!("{bits}-tp{tp}-{layout}"));
                let files = ConvertedLayer::open(&dir, shape(format, tp)).unwrap();
                let mut loaded = layer(format, tp);
                loaded.load_converted(&pool, &files, None).unwrap();
                for n in 0..tp {
                    for e in 0..4 {
                        for (proj, _) in PROJS {
                            let (q, s) = files.part(e, proj, n).unwrap();
                            let ours = file_form(&quantized, format, tp, e, proj, n);
                            assert!(ours.0 == q, "{dir:?} e={e} {proj:?} part {n}");
                            assert!(ours.1 == s, "{dir:?} e={e} {proj:?} part {n} scales");
                            assert!(file_form(&loaded, format, tp, e, proj, n) == ours);
                        }
                    }
                }
                // Same bytes, same kernels: bit-identical outputs.
                let mut outs = [vec![0f32; x.len()], vec![0f32; x.len()]];
                for (l, out) in [&quantized, &loaded].into_iter().zip(outs.iter_mut()) {
                    l.forward_f32(&pool, &mut Workspace::new(), &x, &ids, &w, out)
                        .unwrap();
                }
                assert_eq!(outs[0], outs[1]);
            }
            // Writing back: the .kt files and the merged expert shard equal the original's.
            let tmp =
                std::env::temp_dir().join(format!("kt-write-{bits}-{tp}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir_all(&tmp).unwrap();
            let fill = |w: LayerWriter| {
                for n in 0..tp {
                    for e in 0..4 {
                        for (proj, _) in PROJS {
                            let (q, s) = file_form(&quantized, format, tp, e, proj, n);
                            let s: Vec<f32> = s
                                .chunks_exact(4)
                                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                                .collect();
                            w.put(e, proj, n, &q, &s).unwrap();
                        }
                    }
                }
                w.finish().unwrap();
            };
            fill(LayerWriter::folders(&tmp, shape(format, tp)).unwrap());
            let theirs = root.join(format!("{bits}-tp{tp}-kt/_layer_1"));
            for n in 0..tp {
                let dir = theirs.join(format!("_numa_{n}"));
                let mut count = 0;
                for entry in std::fs::read_dir(&dir).unwrap() {
                    let p = entry.unwrap().path();
                    let mine = tmp
                        .join("_layer_1")
                        .join(format!("_numa_{n}"))
                        .join(p.file_name().unwrap());
                    assert_eq!(
                        std::fs::read(&p).unwrap(),
                        std::fs::read(&mine).unwrap(),
                        "{p:?}"
                    );
                    count += 1;
                }
                assert_eq!(count, 24);
                assert_eq!(
                    std::fs::read_dir(tmp.join(format!("_layer_1/_numa_{n}")))
                        .unwrap()
                        .count(),
                    24
                );
            }
            let shard = tmp.join("shard.safetensors");
            fill(LayerWriter::merged(&shard, shape(format, tp)).unwrap());
            let original = root.join(format!(
                "{bits}-tp{tp}-merged/model-00001-of-00002.safetensors"
            ));
            assert!(
                std::fs::read(&shard).unwrap() == std::fs::read(&original).unwrap(),
                "{original:?}"
            );
            // Nothing temporary is left behind.
            for entry in std::fs::read_dir(&tmp).unwrap() {
                let name = entry.unwrap().file_name().to_string_lossy().to_string();
                assert!(!is_partial_name(&name), "{name}");
            }
            std::fs::remove_dir_all(&tmp).unwrap();
        }
    }
}

/// A layer's part in the original's file form: matrix bytes and little-endian scale bytes.
fn file_form(
    l: &MoeLayer,
    format: Method,
    tp: usize,
    e: usize,
    proj: Proj,
    n: usize,
) -> (Vec<u8>, Vec<u8>) {
    let (q, s) = l.quantized_part(e, proj, n).unwrap();
    let (pn, pk) = shape(format, tp).part_dims(proj);
    let mut file = vec![0u8; q.len()];
    crate::quant::to_file_layout(format == Method::AmxInt4, pn, pk, q, &mut file).unwrap();
    (file, s.iter().flat_map(|v| v.to_le_bytes()).collect())
}

#[test]
fn safetensors_headers_equal_the_librarys() {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let mut rng = Rng::new(5);
    let dtypes = [
        Dtype::BF16,
        Dtype::F32,
        Dtype::I8,
        Dtype::F8_E4M3,
        Dtype::F16,
        Dtype::I64,
    ];
    for trial in 0..20 {
        let n = 1 + rng.below(12);
        let entries: Vec<TensorEntry> = (0..n)
            .map(|i| TensorEntry {
                name: format!("t{}.{}\"x", rng.below(1000), i),
                dtype: dtypes[rng.below(dtypes.len())],
                shape: (0..1 + rng.below(3)).map(|_| 1 + rng.below(9)).collect(),
            })
            .collect();
        let data: Vec<Vec<u8>> = entries
            .iter()
            .map(|t| (0..t.bytes()).map(|_| rng.below(256) as u8).collect())
            .collect();
        let views: Vec<(String, TensorView)> = entries
            .iter()
            .zip(&data)
            .map(|(t, d)| {
                (
                    t.name.clone(),
                    TensorView::new(t.dtype, t.shape.clone(), d).unwrap(),
                )
            })
            .collect();
        let want = safetensors::tensor::serialize(views, None).unwrap();
        let (header, offsets) = safetensors_header(&entries).unwrap();
        let mut got = header.clone();
        got.resize(want.len(), 0);
        for (t, (d, (b, _))) in entries.iter().zip(data.iter().zip(&offsets)) {
            got[header.len() + b..header.len() + b + t.bytes()].copy_from_slice(d);
        }
        assert!(got == want, "trial {trial}");
        // And the in-place writer produces the same file.
        let path =
            std::env::temp_dir().join(format!("kt-st-{trial}-{}.safetensors", std::process::id()));
        let w = SafetensorsWriter::create(&path, &entries).unwrap();
        for (t, d) in entries.iter().zip(&data).rev() {
            w.write(&t.name, d).unwrap();
        }
        w.finish().unwrap();
        assert!(std::fs::read(&path).unwrap() == want);
        std::fs::remove_file(&path).unwrap();
    }
    // An unfinished writer leaves nothing behind; a missing tensor is an error.
    let path = std::env::temp_dir().join(format!("kt-st-x-{}.safetensors", std::process::id()));
    let e = [TensorEntry {
        name: "a".into(),
        dtype: Dtype::F32,
        shape: vec![2],
    }];
    drop(SafetensorsWriter::create(&path, &e).unwrap());
    assert!(!path.exists() && !partial_name(&path).exists());
    let w = SafetensorsWriter::create(&path, &e).unwrap();
    assert!(w.write("a", &[0; 4]).is_err() && w.write("b", &[0; 8]).is_err());
    assert!(w
        .finish()
        .unwrap_err()
        .to_string()
        .contains("never written"));
    assert!(!path.exists() && !partial_name(&path).exists());
}

/// Copy a fixture folder so a test can damage it.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let p = entry.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &dst);
        } else {
            std::fs::copy(&p, &dst).unwrap();
        }
    }
}

#[test]
fn damaged_or_mismatched_files_are_refused_with_reasons() {
    let Some(root) = fixtures() else { return };
    let err = |dir: &Path, s: LayerShape| ConvertedLayer::open(dir, s).unwrap_err().to_string();
    // threadpool_count mismatch, both layouts.
    for layout in ["merged", "kt"] {
        let e = err(
            &root.join(format!("int8-tp2-{layout}")),
            shape(Method::AmxInt8, 1),
        );
        assert!(
            e.contains("--threadpool-count 2") && e.contains("threadpool_count=1"),
            "{e}"
        );
    }
    // Wrong method for the files.
    let e = err(&root.join("int4-tp1-kt"), shape(Method::AmxInt8, 1));
    assert!(e.contains("INT4"), "{e}");
    let e = err(&root.join("int4-tp1-merged"), shape(Method::AmxInt8, 1));
    assert!(e.contains("AMXINT8/AMXINT4"), "{e}");
    // Wrong shape (H).
    let mut s = shape(Method::AmxInt8, 1);
    s.hidden = 256;
    assert!(err(&root.join("int8-tp1-merged"), s).contains("expected"));
    // More experts than the files hold.
    let mut s = shape(Method::AmxInt8, 1);
    s.experts = 5;
    assert!(err(&root.join("int8-tp1-kt"), s).contains("expert 4"));
    // Layer that is not there.
    let mut s = shape(Method::AmxInt8, 1);
    s.layer = 7;
    assert!(err(&root.join("int8-tp1-merged"), s).contains("layer 7"));
    // A truncated and a missing .kt file.
    let tmp = std::env::temp_dir().join(format!("kt-damage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    copy_tree(&root.join("int8-tp1-kt"), &tmp);
    let numa = tmp.join("_layer_1/_numa_0");
    let victim = numa.join("INT8_up_2_32768Byte_quant_.kt");
    std::fs::write(&victim, vec![0u8; 1000]).unwrap();
    assert!(err(&tmp, shape(Method::AmxInt8, 1)).contains("truncated"));
    std::fs::remove_file(&victim).unwrap();
    let e = err(&tmp, shape(Method::AmxInt8, 1));
    assert!(
        e.contains("expert 2 up quant") && e.contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
    // Not a converted folder at all.
    assert!(err(&root.join("hf"), shape(Method::AmxInt8, 1)).contains("no converted weights"));
}

#[test]
fn the_index_decides_which_shards_hold_a_layer() {
    let Some(root) = crate::testutil::fixtures("amx") else {
        return;
    };
    let tmp = std::env::temp_dir().join(format!("kt-index-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    copy_tree(&root.join("int8-tp1-merged"), &tmp);
    assert!(has_converted_layer(&tmp, 1).unwrap());
    assert!(!has_converted_layer(&tmp, 2).unwrap());
    // An index naming a shard that is not there: nothing is found (the shards on disk are
    // not listed for the layer), rather than a shard taken on the index's word.
    let index = tmp.join(crate::shard_index::INDEX_FILE);
    let text = std::fs::read_to_string(&index).unwrap();
    let shard = text
        .split('"')
        .find(|s| s.ends_with(".safetensors"))
        .unwrap()
        .to_owned();
    std::fs::write(&index, text.replace(&shard, "elsewhere.safetensors")).unwrap();
    assert!(!has_converted_layer(&tmp, 1).unwrap());
    std::fs::remove_dir_all(&tmp).unwrap();
}
