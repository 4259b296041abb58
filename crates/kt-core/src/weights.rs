//! Expert weights from Hugging Face safetensors checkpoints (one file, or shards with or without
//! `model.safetensors.index.json`). Files are memory-mapped; the maps are released when the
//! source is dropped, right after the layer has packed its own copy.
use crate::dtype::FloatType;
use crate::expert::{ExpertSource, Proj};
use crate::pack::{BlockScale, MatrixView};
use crate::{kt_bail, kt_ensure, Error, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct TensorLoc {
    file: usize,
    offset: usize,
    len: usize,
    dtype: String,
    shape: Vec<usize>,
}

/// An opened checkpoint: every tensor name → its location in a mapped file.
pub struct Checkpoint {
    dir: PathBuf,
    maps: Vec<Mmap>,
    tensors: HashMap<String, TensorLoc>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Checkpoint({}, {} files, {} tensors)",
            self.dir.display(),
            self.maps.len(),
            self.tensors.len()
        )
    }
}

impl Checkpoint {
    /// Open every `*.safetensors` file in `path` (a directory or a single file).
    pub fn open(path: &Path) -> Result<Checkpoint> {
        Self::open_subset(path, &|_| true)
    }

    /// Like [`Checkpoint::open`], but when a `model.safetensors.index.json` lists the shards,
    /// only those holding a tensor whose name passes `wanted` are opened (one layer of a
    /// many-shard checkpoint then maps one or two files, not all of them).
    pub fn open_subset(path: &Path, wanted: &dyn Fn(&str) -> bool) -> Result<Checkpoint> {
        if !path.exists() {
            kt_bail!(NotFound, "weight path {} does not exist", path.display());
        }
        let files: Vec<PathBuf> = if path.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| crate::error::io_error_at(path, "list", e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .filter(|p| {
                    !p.file_name()
                        .is_some_and(|n| n.to_string_lossy().contains(".partial-"))
                })
                .collect();
            v.sort();
            if v.is_empty() {
                kt_bail!(NotFound, "no .safetensors files in {}", path.display());
            }
            // With an index, only the shards that hold wanted tensors (maybe none).
            if let Some(index) = crate::shard_index::ShardIndex::of(path) {
                let keep = index.shards(wanted);
                v.retain(|p| {
                    p.file_name()
                        .is_some_and(|n| keep.contains(&*n.to_string_lossy()))
                });
            }
            v
        } else {
            vec![path.to_path_buf()]
        };
        let mut maps = Vec::new();
        let mut tensors = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let file = crate::error::open_regular_file(f, "safetensors file")?;
            // The header first: every tensor is checked to lie inside the file before mapping.
            let header = crate::safetensors_file::read_header(&file, f)?;
            // SAFETY: the file is opened read-only; if another process truncates it while
            // mapped, reads could fault — the same contract every safetensors reader has.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| crate::error::io_error_at(f, "map", e))?;
            kt_ensure!(
                header
                    .values()
                    .all(|t| t.offset as usize + t.len <= map.len()),
                Format,
                "{}: changed while being opened",
                f.display()
            );
            for (name, t) in header {
                tensors.insert(
                    name,
                    TensorLoc {
                        file: i,
                        offset: t.offset as usize,
                        len: t.len,
                        dtype: t.dtype,
                        shape: t.shape,
                    },
                );
            }
            maps.push(map);
        }
        Ok(Checkpoint {
            dir: path.to_path_buf(),
            maps,
            tensors,
        })
    }

    /// Every tensor name, in file order (files sorted by name) and by name within a file: the
    /// order in which the original converter meets them.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<(&str, usize)> = self
            .tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.file))
            .collect();
        v.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
        v.into_iter().map(|(n, _)| n).collect()
    }

    /// Drop this process's mapped pages of `name`'s data (the file stays cached by the OS):
    /// keeps the resident memory of a pass over a large checkpoint bounded.
    pub fn release(&self, name: &str) {
        let Some(t) = self.tensors.get(name) else {
            return;
        };
        let page = 4096;
        let (begin, end) = (
            t.offset.next_multiple_of(page),
            (t.offset + t.len) / page * page,
        );
        if end > begin {
            // SAFETY: a read-only shared file mapping: dropping pages only makes later reads
            // fetch them again from the file; no slice of ours is being read at the time.
            let _ = unsafe {
                self.maps[t.file].unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    begin,
                    end - begin,
                )
            };
        }
    }

    /// Like [`Checkpoint::release`] for the bytes `[ptr, ptr + len)` of one of this
    /// checkpoint's maps (e.g. one expert's matrix); other addresses are ignored.
    pub fn release_bytes(&self, ptr: *const u8, len: usize) {
        let page = 4096;
        for map in &self.maps {
            let base = map.as_ptr() as usize;
            let (p, end) = (ptr as usize, ptr as usize + len);
            if p >= base && end <= base + map.len() {
                let (b, e) = (
                    (p - base).next_multiple_of(page),
                    (end - base) / page * page,
                );
                if e > b {
                    // SAFETY: as in `release`: a read-only file mapping; nothing reads these
                    // bytes at the moment (the caller is done with them).
                    let _ = unsafe {
                        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, b, e - b)
                    };
                }
                return;
            }
        }
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Raw bytes and safetensors dtype name ("I8", "F32", ...) of a tensor.
    pub fn raw(&self, name: &str) -> Result<(&[u8], &str)> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::NotFound(format!(
                "tensor {name} is missing from {}",
                self.dir.display()
            ))
        })?;
        Ok((&self.maps[t.file][t.offset..t.offset + t.len], &t.dtype))
    }

    /// The scales of an FP8 weight: `{name}_scale_inv` F32 `[ceil(rows/128), ceil(cols/128)]`
    /// (128 × 128 blocks, DeepSeek-V3), or `{name}_scale` F32 `[rows]` / `[rows, 1]` (one per
    /// output channel).
    fn fp8_scale(&self, name: &str, rows: usize, cols: usize) -> Result<BlockScale> {
        const BLOCK: usize = 128;
        let key = format!("{name}_scale_inv");
        let channel_key = format!("{name}_scale");
        if let Some(t) = self.tensors.get(&key) {
            let want = [rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)];
            kt_ensure!(
                t.dtype == "F32" && t.shape == want && t.len == want[0] * want[1] * 4,
                Format,
                "{key} is {} {:?}; a {rows}x{cols} FP8 weight needs F32 {want:?} (128x128 blocks)",
                t.dtype,
                t.shape
            );
            return Ok(BlockScale {
                scales: self.maps[t.file][t.offset..].as_ptr(),
                cols: want[1],
                block_rows: BLOCK,
                block_cols: BLOCK,
                row0: 0,
                col0: 0,
            });
        }
        let Some(t) = self.tensors.get(&channel_key) else {
            kt_bail!(
                Format,
                "{name} is FP8 but neither {key} (128x128 block scales) nor {channel_key}                  (per-channel scales) is present; other FP8 scalings are not supported"
            );
        };
        kt_ensure!(
            t.dtype == "F32" && (t.shape == [rows] || t.shape == [rows, 1]) && t.len == rows * 4,
            Format,
            "{channel_key} is {} {:?}; a {rows}x{cols} FP8 weight needs F32 [{rows}] (one scale              per output channel)",
            t.dtype,
            t.shape
        );
        Ok(BlockScale {
            scales: self.maps[t.file][t.offset..].as_ptr(),
            cols: 1,
            block_rows: 1,
            block_cols: cols.max(1),
            row0: 0,
            col0: 0,
        })
    }

    fn float_view(&self, name: &str) -> Result<(MatrixView, Vec<usize>)> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::Format(format!(
                "tensor {name} is missing from {}",
                self.dir.display()
            ))
        })?;
        let dtype = match t.dtype.as_str() {
            "BF16" => FloatType::BF16,
            "F16" => FloatType::F16,
            "F32" => FloatType::F32,
            "F8_E4M3" => FloatType::F8E4M3,
            other => kt_bail!(
                Dtype,
                "tensor {name} has dtype {other}; this method reads BF16, F16, F32 or FP8 \
                 (F8_E4M3 + weight_scale_inv or weight_scale) weights"
            ),
        };
        let elems: usize = t.shape.iter().product();
        kt_ensure!(
            elems * dtype.size() == t.len,
            Format,
            "tensor {name}: shape {:?} does not match its {} bytes",
            t.shape,
            t.len
        );
        let bytes = &self.maps[t.file][t.offset..t.offset + t.len];
        let cols = *t.shape.last().unwrap_or(&1);
        let rows = elems.checked_div(cols).unwrap_or(0);
        let mut view = MatrixView::from_bytes(bytes, dtype, rows, cols)?;
        if dtype == FloatType::F8E4M3 {
            view.block_scale = Some(self.fp8_scale(name, rows, cols)?);
        }
        Ok((view, t.shape.clone()))
    }
}

/// How a checkpoint names a layer's experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `{base}.mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen-MoE, DeepSeek).
    PerExpert {
        /// Layer prefix, e.g. `model.layers.3`.
        base: String,
    },
    /// `{base}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (Mixtral).
    Mixtral {
        /// Layer prefix.
        base: String,
    },
    /// `{base}.mlp.experts.gate_up_proj [E, 2I, H]` + `down_proj [E, H, I]`.
    Packed {
        /// Layer prefix.
        base: String,
    },
}

fn layer_bases(layer: usize) -> Vec<String> {
    [
        "model.layers",
        "language_model.model.layers",
        "model.language_model.layers",
        "layers",
    ]
    .iter()
    .map(|p| format!("{p}.{layer}"))
    .collect()
}

/// Expert weights of one layer of a checkpoint.
pub struct HfLayerSource {
    ckpt: std::sync::Arc<Checkpoint>,
    naming: ExpertNaming,
    experts: usize,
    intermediate: usize,
    views: Vec<[MatrixView; 3]>,
}

// SAFETY: views point into the read-only maps owned by `ckpt`.
unsafe impl Sync for HfLayerSource {}

impl HfLayerSource {
    /// Find layer `layer`'s experts in `ckpt`, expecting `experts` experts of `[I][hidden]`.
    pub fn new(
        ckpt: impl Into<std::sync::Arc<Checkpoint>>,
        layer: usize,
        experts: usize,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self> {
        let ckpt = ckpt.into();
        let naming = Self::detect(&ckpt, layer)?;
        let mut views = Vec::with_capacity(experts);
        match &naming {
            ExpertNaming::PerExpert { base } | ExpertNaming::Mixtral { base } => {
                let (group, names) = match naming {
                    ExpertNaming::Mixtral { .. } => ("block_sparse_moe", ["w1", "w3", "w2"]),
                    _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
                };
                for e in 0..experts {
                    let get = |n: &str| -> Result<MatrixView> {
                        let name = format!("{base}.{group}.experts.{e}.{n}.weight");
                        if !ckpt.has(&name) {
                            kt_bail!(
                                Format,
                                "layer {layer}: expert {e} is missing ({name} not found); the layer \
                                 expects {experts} experts"
                            );
                        }
                        Ok(ckpt.float_view(&name)?.0)
                    };
                    views.push([get(names[0])?, get(names[1])?, get(names[2])?]);
                }
            }
            ExpertNaming::Packed { base } => {
                let (gu, gu_shape) =
                    ckpt.float_view(&format!("{base}.mlp.experts.gate_up_proj"))?;
                let (dn, dn_shape) = ckpt.float_view(&format!("{base}.mlp.experts.down_proj"))?;
                // The file may hold more experts than the layer reads (like per-expert names).
                let held = gu_shape.first().copied().unwrap_or(0);
                kt_ensure!(
                    held >= experts
                        && gu_shape == [held, 2 * intermediate, hidden]
                        && dn_shape == [held, hidden, intermediate],
                    Invalid,
                    "layer {layer}: packed experts have gate_up_proj {gu_shape:?} and down_proj \
                     {dn_shape:?}, expected [E, {}, {hidden}] and [E, {hidden}, {intermediate}] \
                     with E >= {experts}",
                    2 * intermediate
                );
                for e in 0..experts {
                    let g = gu.sub(e * 2 * intermediate, intermediate, 0, hidden)?;
                    let u = gu.sub(e * 2 * intermediate + intermediate, intermediate, 0, hidden)?;
                    let d = dn.sub(e * hidden, hidden, 0, intermediate)?;
                    views.push([g, u, d]);
                }
            }
        }
        Ok(HfLayerSource {
            ckpt,
            naming,
            experts,
            intermediate,
            views,
        })
    }

    /// Recognise the naming scheme of `layer`.
    pub fn detect(ckpt: &Checkpoint, layer: usize) -> Result<ExpertNaming> {
        let mut tried = Vec::new();
        for base in layer_bases(layer) {
            let per = format!("{base}.mlp.experts.0.gate_proj.weight");
            let mix = format!("{base}.block_sparse_moe.experts.0.w1.weight");
            let packed = format!("{base}.mlp.experts.gate_up_proj");
            if ckpt.has(&per) {
                return Ok(ExpertNaming::PerExpert { base });
            }
            if ckpt.has(&mix) {
                return Ok(ExpertNaming::Mixtral { base });
            }
            if ckpt.has(&packed) {
                return Ok(ExpertNaming::Packed { base });
            }
            tried.extend([per, mix, packed]);
        }
        Err(Error::Format(format!(
            "no experts of layer {layer} found in {} (looked for {})",
            ckpt.dir.display(),
            tried.join(", ")
        )))
    }

    /// The naming scheme found.
    pub fn naming(&self) -> &ExpertNaming {
        &self.naming
    }

    /// I of this layer.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// The checkpoint behind it.
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    /// Names of the tensors holding this layer's experts (weights and FP8 block scales).
    pub fn tensor_names(&self) -> Vec<String> {
        let prefix = match &self.naming {
            ExpertNaming::PerExpert { base } | ExpertNaming::Packed { base } => {
                format!("{base}.mlp.experts.")
            }
            ExpertNaming::Mixtral { base } => format!("{base}.block_sparse_moe.experts."),
        };
        self.ckpt
            .names()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .map(str::to_owned)
            .collect()
    }
}

impl ExpertSource for HfLayerSource {
    fn num_experts(&self) -> usize {
        self.experts
    }

    fn matrix(&self, expert: usize, proj: Proj) -> Result<MatrixView> {
        let v = self.views.get(expert).ok_or_else(|| {
            Error::Invalid(format!("expert {expert} outside 0..{}", self.experts))
        })?;
        Ok(v[match proj {
            Proj::Gate => 0,
            Proj::Up => 1,
            Proj::Down => 2,
        }])
    }
}
