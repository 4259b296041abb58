//! Harnesses for fuzzing the parsers of untrusted files. Each takes arbitrary bytes, puts them
//! where the parser looks (a file in a scratch folder of this process and thread), and runs
//! the parser and the accessors a load uses. Errors are the expected outcome; a panic, a hang,
//! an abort or an out-of-bounds access is a bug. Used by the cargo-fuzz targets in `fuzz/`
//! (nightly) and by the regression test over the saved corpora and crashes
//! (`tests/fuzz_regressions.rs`, stable).
use crate::converted::{has_converted_layer, ConvertedLayer, LayerShape};
use crate::expert::Proj;
use crate::gguf::{GgufFile, GgufModel};
use crate::method::Method;
use crate::safetensors_file::read_header;
use crate::shard_index::ShardIndex;
use crate::weights::{Checkpoint, HfLayerSource};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A harness: arbitrary bytes in, nothing out (it must simply return).
pub type Harness = fn(&[u8]);

/// The harnesses by name, as the fuzz targets and the corpus folders are named.
pub const TARGETS: [(&str, Harness); 5] = [
    ("safetensors", safetensors),
    ("shard_index", shard_index),
    ("gguf", gguf),
    ("converted_merged", converted_merged),
    ("converted_kt", converted_kt),
];

thread_local! {
    static SCRATCH: PathBuf = {
        let id = format!("kt-fuzz-{}-{:?}", std::process::id(), std::thread::current().id());
        let dir = std::env::temp_dir().join(id.replace(['(', ')'], ""));
        let _ = std::fs::create_dir_all(&dir);
        dir
    };
}

/// A fresh, empty folder `name` in this thread's scratch folder.
fn fresh(name: &str) -> PathBuf {
    let dir = SCRATCH.with(|s| s.join(name));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

fn write(path: &Path, data: &[u8]) {
    std::fs::write(path, data).expect("scratch file");
}

/// A safetensors file as a Hugging Face checkpoint: the header, every tensor's bytes, and the
/// expert discovery of a layer.
pub fn safetensors(data: &[u8]) {
    let dir = fresh("safetensors");
    let file = dir.join("model.safetensors");
    write(&file, data);
    if let Ok(f) = std::fs::File::open(&file) {
        let _ = read_header(&f, &file);
    }
    let Ok(ckpt) = Checkpoint::open(&dir) else {
        return;
    };
    for name in ckpt.names() {
        let _ = ckpt.shape(name);
        let _ = ckpt.raw(name);
    }
    let ckpt = Arc::new(ckpt);
    for layer in 0..2 {
        let _ = HfLayerSource::new(ckpt.clone(), layer, 2, 32, 32);
    }
}

/// `model.safetensors.index.json` text.
pub fn shard_index(data: &[u8]) {
    if let Some(index) = ShardIndex::parse(data) {
        let _ = index.shards(&|_| true);
        let _ = index.shards_with_prefix("model.layers.0.");
        let _ = index.file_of("model.layers.0.mlp.experts.0.gate_proj.weight");
    }
}

/// A GGUF file: header, metadata, tensor table, and the expert tensors' rows.
pub fn gguf(data: &[u8]) {
    let dir = fresh("gguf");
    let file = dir.join("model.gguf");
    write(&file, data);
    if let Ok(g) = GgufFile::open(&file) {
        let _ = (
            g.version(),
            g.alignment(),
            g.data_offset(),
            g.architecture(),
        );
        for (_, value) in g.metadata_entries() {
            let _ = (
                value.as_u64(),
                value.as_i64(),
                value.as_f64(),
                value.as_str(),
            );
            if let Some(a) = value.as_array() {
                let _ = (a.len(), a.element_type());
            }
        }
        for info in g.tensors() {
            let _ = g.tensor_data(info);
            if let Ok(t) = g.expert_tensor(&info.name) {
                let _ = (t.k(), t.n(), t.experts(), t.expert(0), t.row(0, 0));
            }
        }
    }
    let _ = GgufModel::open(&dir);
}

/// The shape every converted-file harness asks for: two experts, one part.
fn shape(method: Method) -> LayerShape {
    LayerShape {
        layer: 0,
        experts: 2,
        hidden: 64,
        intermediate: 64,
        parts: 1,
        method,
    }
}

fn read_all(layer: &ConvertedLayer) {
    for e in 0..2 {
        for proj in [Proj::Gate, Proj::Up, Proj::Down] {
            let _ = layer.part(e, proj, 0);
        }
    }
}

/// A merged converted shard (safetensors of `blk.0.ffn_*_exps.{e}.numa.0.{weight,scale}`).
pub fn converted_merged(data: &[u8]) {
    let dir = fresh("converted_merged");
    write(&dir.join("model-00001-of-00001.safetensors"), data);
    let _ = has_converted_layer(&dir, 0);
    for method in [Method::AmxInt8, Method::AmxInt4] {
        if let Ok(layer) = ConvertedLayer::open(&dir, shape(method)) {
            read_all(&layer);
        }
    }
}

/// A `_layer_0/_numa_0/*.kt` folder. The input is split into the folder's files: each record
/// is a name byte (picking one of the names the loader looks for, or a stray one), two length
/// bytes and that many content bytes.
pub fn converted_kt(data: &[u8]) {
    let dir = fresh("converted_kt");
    let part = dir.join("_layer_0").join("_numa_0");
    std::fs::create_dir_all(&part).expect("scratch folder");
    let mut names = Vec::new();
    for prefix in ["INT8", "INT4"] {
        for e in 0..2 {
            for proj in ["gate", "up", "down"] {
                for kind in ["quant", "scale"] {
                    names.push((prefix, e, proj, kind));
                }
            }
        }
    }
    let mut rest = data;
    while rest.len() >= 3 {
        let pick = rest[0] as usize;
        let len = u16::from_le_bytes([rest[1], rest[2]]) as usize;
        let body = &rest[3..3 + len.min(rest.len() - 3)];
        rest = &rest[3 + body.len()..];
        let name = match names.get(pick % (names.len() + 1)) {
            Some((prefix, e, proj, kind)) => {
                format!("{prefix}_{proj}_{e}_{}Byte_{kind}_.kt", body.len())
            }
            None => format!("stray_{pick}.kt"),
        };
        write(&part.join(name), body);
    }
    let _ = has_converted_layer(&dir, 0);
    for method in [Method::AmxInt8, Method::AmxInt4] {
        if let Ok(layer) = ConvertedLayer::open(&dir, shape(method)) {
            read_all(&layer);
        }
    }
}
