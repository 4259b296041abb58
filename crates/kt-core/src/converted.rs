//! Expert weights converted by the original kt-kernel's `convert_cpu_weights.py` (AMXINT8 and
//! AMXINT4), read and written byte for byte.
//!
//! Two layouts exist. Merged (default): safetensors shards with 1-D tensors
//! `blk.{L}.ffn_{gate,up,down}_exps.{e}.numa.{N}.weight` (I8, also for INT4's packed nibbles)
//! and `....scale` (F32, one per output row). Folders (`--no-merge-safetensor`):
//! `_layer_{L}/_numa_{N}/{INT8|INT4}_{gate|up|down}_{e}_{B}Byte_{quant|scale}_.kt`, raw bytes,
//! `B` = the file size. Part `N` of `threadpool_count` holds rows `[N·I/tp, (N+1)·I/tp)` of
//! gate/up and the same columns of down (re-quantised per part), so files only fit a layer with
//! the same `threadpool_count`. The matrix bytes are the tiled layout of [`crate::quant`], which
//! is also this crate's in-memory layout: loading is a copy.
use crate::moe::{Proj, WeightFormat};
use crate::weights::Checkpoint;
use crate::{kt_bail, kt_ensure, Error, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The projections in file-name spelling.
pub const PROJS: [(Proj, &str); 3] = [(Proj::Gate, "gate"), (Proj::Up, "up"), (Proj::Down, "down")];

/// Name prefix of the `.kt` files of a format ("INT8" / "INT4").
pub fn kt_prefix(format: WeightFormat) -> Result<&'static str> {
    match format {
        WeightFormat::Int8 => Ok("INT8"),
        WeightFormat::Int4 => Ok("INT4"),
        WeightFormat::Bf16 | WeightFormat::Gguf => {
            kt_bail!(Invalid, "converted files hold AMXINT8 or AMXINT4 weights")
        }
    }
}

fn proj_name(proj: Proj) -> &'static str {
    PROJS.iter().find(|(p, _)| *p == proj).unwrap().1
}

/// Merged-layout tensor name of (layer, expert, projection, part, weight|scale).
pub fn merged_key(layer: usize, expert: usize, proj: Proj, part: usize, scale: bool) -> String {
    format!(
        "blk.{layer}.ffn_{}_exps.{expert}.numa.{part}.{}",
        proj_name(proj),
        if scale { "scale" } else { "weight" }
    )
}

/// `.kt` file name of (format, expert, projection, weight|scale) with `bytes` bytes.
pub fn kt_file_name(prefix: &str, expert: usize, proj: Proj, scale: bool, bytes: usize) -> String {
    format!(
        "{prefix}_{}_{expert}_{bytes}Byte_{}_.kt",
        proj_name(proj),
        if scale { "scale" } else { "quant" }
    )
}

/// Shape facts of one layer: what every part's files must hold.
#[derive(Debug, Clone, Copy)]
pub struct LayerShape {
    /// Layer index in the names.
    pub layer: usize,
    /// Experts the files must provide (the largest logical id + 1).
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Intermediate size I (all parts together).
    pub intermediate: usize,
    /// `threadpool_count` the files were converted for.
    pub parts: usize,
    /// AMXINT8 or AMXINT4.
    pub format: WeightFormat,
}

impl LayerShape {
    /// (rows, columns) of one part of a projection.
    pub fn part_dims(&self, proj: Proj) -> (usize, usize) {
        let ip = self.intermediate / self.parts;
        match proj {
            Proj::Down => (self.hidden, ip),
            _ => (ip, self.hidden),
        }
    }

    /// Bytes of one part's quantised matrix and of its scales.
    pub fn part_bytes(&self, proj: Proj) -> (usize, usize) {
        let (n, k) = self.part_dims(proj);
        let q = match self.format {
            WeightFormat::Int4 => n * k / 2,
            _ => n * k,
        };
        (q, n * 4)
    }
}

/// `.kt` files by (part, expert, projection index, is_scale).
type KtFiles = HashMap<(usize, usize, usize, bool), (PathBuf, Mmap)>;

/// Gives one part of one expert's projection as (matrix bytes, fp32 scale bytes), borrowed
/// from wherever they live (a loaded layer), so writing never copies a whole layer.
pub type PartBytes<'a> = dyn Fn(usize, Proj, usize) -> Result<(&'a [u8], &'a [u8])> + 'a;

enum Store {
    Merged(Checkpoint),
    Folders(KtFiles),
}

/// One layer's converted files, opened (memory-mapped) and checked against the layer's shape.
pub struct ConvertedLayer {
    shape: LayerShape,
    store: Store,
    origin: PathBuf,
}

impl std::fmt::Debug for ConvertedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ConvertedLayer({}, {:?})",
            self.origin.display(),
            self.shape
        )
    }
}

/// Whether `path` holds converted files for `layer` (either layout).
pub fn has_converted_layer(path: &Path, layer: usize) -> bool {
    if path.join(format!("_layer_{layer}")).is_dir() {
        return true;
    }
    Checkpoint::open(path).is_ok_and(|c| c.has(&merged_key(layer, 0, Proj::Gate, 0, false)))
}

impl ConvertedLayer {
    /// Open layer `shape.layer` under `path` (a converter output directory) and check that
    /// every expert the layer needs is there with the sizes `shape` implies.
    pub fn open(path: &Path, shape: LayerShape) -> Result<ConvertedLayer> {
        kt_prefix(shape.format)?;
        kt_ensure!(
            shape.parts > 0 && shape.intermediate.is_multiple_of(shape.parts),
            Invalid,
            "intermediate size {} does not split into {} parts",
            shape.intermediate,
            shape.parts
        );
        if !path.exists() {
            kt_bail!(NotFound, "weight path {} does not exist", path.display());
        }
        let folder = path.join(format!("_layer_{}", shape.layer));
        let store = if folder.is_dir() {
            Store::Folders(open_folders(&folder, &shape)?)
        } else {
            let ckpt = Checkpoint::open(path)?;
            let first = merged_key(shape.layer, 0, Proj::Gate, 0, false);
            kt_ensure!(
                ckpt.has(&first),
                NotFound,
                "{} holds no converted weights for layer {} (neither {first} nor a _layer_{} \
                 folder)",
                path.display(),
                shape.layer,
                shape.layer
            );
            let found = (0..)
                .take_while(|&n| ckpt.has(&merged_key(shape.layer, 0, Proj::Gate, n, false)))
                .count();
            check_parts(found, &shape, path)?;
            Store::Merged(ckpt)
        };
        let layer = ConvertedLayer {
            shape,
            store,
            origin: path.to_path_buf(),
        };
        // Every (part, expert, projection) present with the right sizes, before any copy.
        for part in 0..shape.parts {
            for e in 0..shape.experts {
                for (proj, _) in PROJS {
                    layer.part(e, proj, part)?;
                }
            }
        }
        Ok(layer)
    }

    /// The layer's shape.
    pub fn shape(&self) -> &LayerShape {
        &self.shape
    }

    /// Quantised bytes and fp32 scale bytes of one part of one expert's projection.
    pub fn part(&self, expert: usize, proj: Proj, part: usize) -> Result<(&[u8], &[u8])> {
        let (want_q, want_s) = self.shape.part_bytes(proj);
        let pi = PROJS.iter().position(|(p, _)| *p == proj).unwrap();
        let get = |scale: bool| -> Result<(&[u8], String)> {
            match &self.store {
                Store::Merged(ckpt) => {
                    let key = merged_key(self.shape.layer, expert, proj, part, scale);
                    let (bytes, dtype) = ckpt.raw(&key)?;
                    let want_dtype = if scale { "F32" } else { "I8" };
                    kt_ensure!(
                        dtype == want_dtype,
                        Format,
                        "{key} has dtype {dtype}, converted files store {want_dtype}"
                    );
                    Ok((bytes, key))
                }
                Store::Folders(files) => match files.get(&(part, expert, pi, scale)) {
                    Some((path, map)) => Ok((&map[..], path.display().to_string())),
                    None => kt_bail!(
                        NotFound,
                        "{}: expert {expert} {} {} of part {part} is missing",
                        self.origin.display(),
                        proj_name(proj),
                        if scale { "scale" } else { "quant" }
                    ),
                },
            }
        };
        let (q, qname) = get(false)?;
        let (s, sname) = get(true)?;
        for (bytes, want, name, what) in
            [(q, want_q, qname, "weights"), (s, want_s, sname, "scales")]
        {
            if bytes.len() != want {
                let (n, k) = self.shape.part_dims(proj);
                let hint =
                    if what == "weights" && (bytes.len() * 2 == want || bytes.len() == want * 2) {
                        " (the other of AMXINT8/AMXINT4?)"
                    } else {
                        ""
                    };
                kt_bail!(
                    Format,
                    "{name}: {} bytes of {what}, expected {want} for a {n}x{k} part of a {} layer \
                     with threadpool_count={}{hint}",
                    bytes.len(),
                    kt_prefix(self.shape.format)?,
                    self.shape.parts
                );
            }
        }
        Ok((q, s))
    }
}

fn check_parts(found: usize, shape: &LayerShape, path: &Path) -> Result<()> {
    kt_ensure!(
        found == shape.parts,
        Invalid,
        "{} was converted with --threadpool-count {found}, but this layer runs with \
         threadpool_count={}; the parts split the intermediate dimension and are quantised per \
         part, so they cannot be regrouped: use threadpool_count={found} or convert again",
        path.display(),
        shape.parts
    );
    Ok(())
}

/// Map every `.kt` file of a `_layer_L` folder, checking names, sizes and the part count.
fn open_folders(folder: &Path, shape: &LayerShape) -> Result<KtFiles> {
    let prefix = kt_prefix(shape.format)?;
    let mut parts = Vec::new();
    for entry in std::fs::read_dir(folder)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("_numa_")
            .and_then(|n| n.parse::<usize>().ok())
        {
            parts.push(n);
        }
    }
    parts.sort_unstable();
    kt_ensure!(
        parts.iter().enumerate().all(|(i, &n)| i == n),
        Format,
        "{}: _numa_ folders {parts:?} are not numbered 0..{}",
        folder.display(),
        parts.len()
    );
    check_parts(parts.len(), shape, folder)?;
    let mut files = HashMap::new();
    for part in 0..shape.parts {
        let dir = folder.join(format!("_numa_{part}"));
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            let Some(rest) = name.strip_suffix("_.kt") else {
                continue;
            };
            let fields: Vec<&str> = rest.split('_').collect();
            let [fmt, proj, e, bytes, kind] = fields[..] else {
                kt_bail!(Format, "{}: unexpected .kt file name", path.display());
            };
            if fmt != prefix {
                kt_bail!(
                    Format,
                    "{}: an {fmt} file, but the method is AMX{prefix}",
                    path.display()
                );
            }
            let (Some(pi), Ok(e), Some(Ok(bytes)), true) = (
                PROJS.iter().position(|(_, n)| *n == proj),
                e.parse::<usize>(),
                bytes.strip_suffix("Byte").map(str::parse::<usize>),
                kind == "quant" || kind == "scale",
            ) else {
                kt_bail!(Format, "{}: unexpected .kt file name", path.display());
            };
            let file = File::open(&path)?;
            let len = file.metadata()?.len() as usize;
            kt_ensure!(
                len == bytes,
                Format,
                "{}: the name says {bytes} bytes but the file has {len} (truncated?)",
                path.display()
            );
            // SAFETY: read-only map of a file we just checked; like every mmap reader, a
            // concurrent truncation by another process could fault.
            let map = unsafe { Mmap::map(&file) }?;
            files.insert((part, e, pi, kind == "scale"), (path, map));
        }
    }
    Ok(files)
}

/// Write one layer in the folder layout: `dir/_layer_{L}/_numa_{N}/*.kt`. `part(e, proj, n)`
/// gives the bytes (as [`ConvertedLayer::part`] returns them). Each file is written to a
/// temporary name and renamed, so a crash never leaves a half-written file under a final name.
pub fn write_folders(dir: &Path, shape: &LayerShape, part: &PartBytes) -> Result<()> {
    let prefix = kt_prefix(shape.format)?;
    for n in 0..shape.parts {
        let sub = dir
            .join(format!("_layer_{}", shape.layer))
            .join(format!("_numa_{n}"));
        std::fs::create_dir_all(&sub)?;
        for e in 0..shape.experts {
            for (proj, _) in PROJS {
                let (q, s) = part(e, proj, n)?;
                for (bytes, scale) in [(q, false), (s, true)] {
                    let name = kt_file_name(prefix, e, proj, scale, bytes.len());
                    write_atomically(&sub.join(name), bytes)?;
                }
            }
        }
    }
    Ok(())
}

/// Write one layer's expert shard in the merged layout (the tensors only; the converter adds
/// the index and the non-expert shard). Byte-identical to the original's shard: the same
/// safetensors serialisation, no metadata.
pub fn write_merged_shard(
    file: &Path,
    shape: &LayerShape,
    part: &PartBytes,
) -> Result<Vec<String>> {
    use safetensors::tensor::{Dtype, TensorView};
    let mut owned: Vec<(String, Dtype, &[u8])> = Vec::new();
    for n in 0..shape.parts {
        for e in 0..shape.experts {
            for (proj, _) in [PROJS[2], PROJS[0], PROJS[1]] {
                let (q, s) = part(e, proj, n)?;
                owned.push((merged_key(shape.layer, e, proj, n, false), Dtype::I8, q));
                owned.push((merged_key(shape.layer, e, proj, n, true), Dtype::F32, s));
            }
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(name, dtype, bytes)| {
            let elems = bytes.len() / if *dtype == Dtype::F32 { 4 } else { 1 };
            TensorView::new(*dtype, vec![elems], bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::Format(format!("{name}: {e}")))
        })
        .collect::<Result<_>>()?;
    // Streamed to a temporary name, then renamed: no whole-shard buffer, no half-written shard.
    let tmp = partial_name(file);
    safetensors::tensor::serialize_to_file(views, None, &tmp)
        .map_err(|e| Error::Format(format!("writing {}: {e}", file.display())))?;
    File::open(&tmp)?.sync_data()?;
    std::fs::rename(&tmp, file)?;
    // Weight-map order of the original's index: part, expert, down/gate/up, weight then scale.
    Ok(owned.into_iter().map(|(name, _, _)| name).collect())
}

/// The temporary name a file is written under before its rename.
pub fn partial_name(path: &Path) -> PathBuf {
    path.with_extension(format!(
        "{}.partial-{}",
        path.extension().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ))
}

/// Write `bytes` to `path` through a temporary file in the same directory and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = partial_name(path);
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests;
