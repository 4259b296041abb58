//! Against the files the original 0.7.2 converter wrote (`shared/fixtures/amx`, made from the
//! synthetic checkpoint `amx/hf`, layer 1, E=4, H=128, I=256).
use super::*;
use crate::kernels::KernelSet;
use crate::moe::{MoeConfig, MoeLayer, Workspace};
use crate::pool::{Pool, PoolConfig};
use crate::rng::Rng;
use crate::weights::HfLayerSource;

fn fixtures() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/amx");
    p.is_dir().then_some(p)
}

fn pool(parts: usize) -> Pool {
    let mut cfg = PoolConfig::split(2.max(parts), parts, None).unwrap();
    cfg.pin = false;
    Pool::new(cfg).unwrap()
}

fn shape(format: WeightFormat, parts: usize) -> LayerShape {
    LayerShape {
        layer: 1,
        experts: 4,
        hidden: 128,
        intermediate: 256,
        parts,
        format,
    }
}

fn layer(format: WeightFormat, parts: usize) -> MoeLayer {
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
    MoeLayer::with_format(cfg, parts, KernelSet::best().unwrap(), format).unwrap()
}

const SETS: [(WeightFormat, &str); 2] =
    [(WeightFormat::Int8, "int8"), (WeightFormat::Int4, "int4")];

#[test]
fn original_files_load_equal_to_our_quantiser_and_write_back_byte_identical() {
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
            let mut quantised = layer(format, tp);
            quantised.load(&pool, &src, None).unwrap();
            for layout in ["merged", "kt"] {
                let dir = root.join(format!("{bits}-tp{tp}-{layout}"));
                let files = ConvertedLayer::open(&dir, shape(format, tp)).unwrap();
                let mut loaded = layer(format, tp);
                loaded.load_converted(&pool, &files, None).unwrap();
                for n in 0..tp {
                    for e in 0..4 {
                        for (proj, _) in PROJS {
                            let ours = quantised.quantised_part(e, proj, n).unwrap();
                            let (q, s) = files.part(e, proj, n).unwrap();
                            assert_eq!(ours.0, q, "{dir:?} e={e} {proj:?} part {n}");
                            assert_eq!(ours.1, s, "{dir:?} e={e} {proj:?} part {n} scales");
                            assert_eq!(loaded.quantised_part(e, proj, n).unwrap(), ours);
                        }
                    }
                }
                // Same bytes, same kernels: bit-identical outputs.
                let mut outs = [vec![0f32; x.len()], vec![0f32; x.len()]];
                for (l, out) in [&quantised, &loaded].into_iter().zip(outs.iter_mut()) {
                    l.forward_f32(&pool, &mut Workspace::new(), &x, &ids, &w, out)
                        .unwrap();
                }
                assert_eq!(outs[0], outs[1]);
            }
            // Writing back: the .kt files and the merged expert shard equal the original's.
            let tmp =
                std::env::temp_dir().join(format!("kt-write-{bits}-{tp}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let part = |e: usize, proj: Proj, n: usize| quantised.quantised_part(e, proj, n);
            write_folders(&tmp, &shape(format, tp), &part).unwrap();
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
            }
            let shard = tmp.join("shard.safetensors");
            write_merged_shard(&shard, &shape(format, tp), &part).unwrap();
            let original = root.join(format!(
                "{bits}-tp{tp}-merged/model-00001-of-00002.safetensors"
            ));
            assert!(
                std::fs::read(&shard).unwrap() == std::fs::read(&original).unwrap(),
                "{original:?}"
            );
            std::fs::remove_dir_all(&tmp).unwrap();
        }
    }
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
            shape(WeightFormat::Int8, 1),
        );
        assert!(
            e.contains("--threadpool-count 2") && e.contains("threadpool_count=1"),
            "{e}"
        );
    }
    // Wrong method for the files.
    let e = err(&root.join("int4-tp1-kt"), shape(WeightFormat::Int8, 1));
    assert!(e.contains("INT4"), "{e}");
    let e = err(&root.join("int4-tp1-merged"), shape(WeightFormat::Int8, 1));
    assert!(e.contains("AMXINT8/AMXINT4"), "{e}");
    // Wrong shape (H).
    let mut s = shape(WeightFormat::Int8, 1);
    s.hidden = 256;
    assert!(err(&root.join("int8-tp1-merged"), s).contains("expected"));
    // More experts than the files hold.
    let mut s = shape(WeightFormat::Int8, 1);
    s.experts = 5;
    assert!(err(&root.join("int8-tp1-kt"), s).contains("expert 4"));
    // Layer that is not there.
    let mut s = shape(WeightFormat::Int8, 1);
    s.layer = 7;
    assert!(err(&root.join("int8-tp1-merged"), s).contains("layer 7"));
    // A truncated and a missing .kt file.
    let tmp = std::env::temp_dir().join(format!("kt-damage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    copy_tree(&root.join("int8-tp1-kt"), &tmp);
    let numa = tmp.join("_layer_1/_numa_0");
    let victim = numa.join("INT8_up_2_32768Byte_quant_.kt");
    std::fs::write(&victim, vec![0u8; 1000]).unwrap();
    assert!(err(&tmp, shape(WeightFormat::Int8, 1)).contains("truncated"));
    std::fs::remove_file(&victim).unwrap();
    let e = err(&tmp, shape(WeightFormat::Int8, 1));
    assert!(
        e.contains("expert 2 up quant") && e.contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
    // Not a converted folder at all.
    assert!(err(&root.join("hf"), shape(WeightFormat::Int8, 1)).contains("no converted weights"));
}
