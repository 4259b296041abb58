//! Expert weights from Hugging Face safetensors checkpoints (one file, or shards with or without
//! `model.safetensors.index.json`). Files are memory-mapped; the maps are released when the
//! source is dropped, right after the layer has packed its own copy.
use crate::codes::{CodeKind, CodeLayout, CodedMatrix, ScaleLayout, ScaleType};
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
            "{channel_key} is {} {:?}; a {rows}x{cols} FP8 weight needs F32 [{rows}] (one \
             scale per output channel)",
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

    /// The tensor `name` (its location), or a Format error naming what the matrix needs.
    fn tensor(&self, name: &str, wanted: &str) -> Result<&TensorLoc> {
        self.tensors.get(name).ok_or_else(|| {
            Error::Format(format!(
                "tensor {name} is missing from {} ({wanted})",
                self.dir.display()
            ))
        })
    }

    /// The expert matrix whose tensors start with `prefix` (e.g.
    /// `model.layers.3.mlp.experts.7.up_proj`), in whichever format the file stores it: plain
    /// floats, block/channel FP8, or one of the group-scaled formats ([`crate::codes`]).
    pub fn expert_matrix(&self, prefix: &str) -> Result<MatrixView> {
        if self.has(&format!("{prefix}.weight_packed")) {
            return self.rawint4_view(prefix);
        }
        if self.has(&format!("{prefix}.qweight")) {
            return self.gptq_view(prefix);
        }
        let name = format!("{prefix}.weight");
        let t = self.tensor(&name, "the expert's weight")?;
        match t.dtype.as_str() {
            // Bytes with group scales beside them are FP4 codes; bare bytes are refused by
            // float_view with their dtype (e.g. an int8 checkpoint).
            "U8" | "I8"
                if self.has(&format!("{prefix}.scale"))
                    || self.has(&format!("{prefix}.weight_scale")) =>
            {
                self.fp4_view(prefix)
            }
            "F8_E4M3" if self.has(&format!("{prefix}.weight_scale_inv")) => {
                let scale = self.tensor(&format!("{prefix}.weight_scale_inv"), "")?;
                if matches!(scale.dtype.as_str(), "U8" | "F8_E8M0") {
                    let (rows, cols) = (t.shape[0], t.shape.get(1).copied().unwrap_or(0));
                    return self.coded_view(
                        &name,
                        CodeKind::E4M3,
                        (rows, cols),
                        CodeLayout::RowMajor,
                        &format!("{prefix}.weight_scale_inv"),
                        ScaleType::E8M0,
                        ScaleLayout::RowMajor,
                        1.0,
                    );
                }
                Ok(self.float_view(&name)?.0)
            }
            _ => Ok(self.float_view(&name)?.0),
        }
    }

    /// A group-scaled view of `codes` (a `[rows][cols]` matrix in `layout`) with the scales in
    /// `scale_name`; the group size is what the scale shape implies, and must divide `cols`.
    #[allow(clippy::too_many_arguments)] // one call per format, every argument a fact of it
    fn coded_view(
        &self,
        codes: &str,
        kind: CodeKind,
        (rows, cols): (usize, usize),
        layout: CodeLayout,
        scale_name: &str,
        scale_type: ScaleType,
        scale_layout: ScaleLayout,
        global: f32,
    ) -> Result<MatrixView> {
        let t = self.tensor(codes, "the expert's codes")?;
        let code_bytes = rows * cols * kind.bits() / 8;
        kt_ensure!(
            rows > 0 && cols > 0 && cols.is_multiple_of(8) && t.len == code_bytes,
            Format,
            "{codes} is {} {:?} ({} bytes); a {rows}x{cols} matrix of {kind:?} codes needs \
             {code_bytes} bytes",
            t.dtype,
            t.shape,
            t.len
        );
        let st = self.tensor(scale_name, "the group scales")?;
        let dtype_ok = match scale_type {
            ScaleType::E8M0 => matches!(st.dtype.as_str(), "U8" | "F8_E8M0"),
            ScaleType::E4M3 => st.dtype == "F8_E4M3",
            ScaleType::Bf16 => st.dtype == "BF16",
            ScaleType::F16 => st.dtype == "F16",
        };
        let (scale_rows, groups) = match (scale_layout, st.shape.as_slice()) {
            (ScaleLayout::RowMajor, [r, g]) => (*r, *g),
            (ScaleLayout::Transposed, [g, r]) => (*r, *g),
            _ => (0, 0),
        };
        let want = match scale_layout {
            ScaleLayout::RowMajor => format!("[{rows}, {cols}/group]"),
            ScaleLayout::Transposed => format!("[{cols}/group, {rows}]"),
        };
        kt_ensure!(
            dtype_ok
                && scale_rows == rows
                && groups > 0
                && cols.is_multiple_of(groups)
                && st.len == rows * groups * scale_type.size(),
            Format,
            "{scale_name} is {} {:?}; the scales of a {rows}x{cols} {kind:?} weight must be \
             {scale_type:?} {want} with a group size that divides {cols}",
            st.dtype,
            st.shape
        );
        let group = cols / groups;
        kt_ensure!(
            group.is_multiple_of(2) || kind.bits() == 8,
            Format,
            "{scale_name}: group size {group} splits a byte of 4-bit codes"
        );
        let coded = CodedMatrix {
            kind,
            codes: self.maps[t.file][t.offset..].as_ptr(),
            layout,
            scales: self.maps[st.file][st.offset..].as_ptr(),
            scale_type,
            scale_layout,
            group,
            global,
            rows,
            cols,
            row0: 0,
            col0: 0,
        };
        Ok(MatrixView {
            ptr: coded.codes,
            dtype: FloatType::F8E4M3,
            rows,
            cols,
            row_stride: cols,
            block_scale: None,
            coded: Some(coded),
        })
    }

    /// Kimi-K2 compressed-tensors int4: `weight_packed` I32 `[N, K/8]` or U8 `[N, K/2]`
    /// (nibble = q + 8, even input low), `weight_scale` BF16 `[N, K/group]`, optional
    /// `weight_shape` `[N, K]`.
    fn rawint4_view(&self, prefix: &str) -> Result<MatrixView> {
        let name = format!("{prefix}.weight_packed");
        let t = self.tensor(&name, "")?;
        let (rows, cols) = match (t.dtype.as_str(), t.shape.as_slice()) {
            ("I32", [n, w]) => (*n, w * 8),
            ("U8" | "I8", [n, b]) => (*n, b * 2),
            _ => kt_bail!(
                Format,
                "{name} is {} {:?}; RAWINT4 packs 4-bit codes as I32 [N, K/8] or U8 [N, K/2]",
                t.dtype,
                t.shape
            ),
        };
        let shape_name = format!("{prefix}.weight_shape");
        if let Some(st) = self.tensors.get(&shape_name) {
            let bytes = &self.maps[st.file][st.offset..st.offset + st.len];
            let dims: Vec<i64> = match st.dtype.as_str() {
                "I32" => bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                    .collect(),
                "I64" => bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                _ => vec![],
            };
            kt_ensure!(
                dims == [rows as i64, cols as i64],
                Format,
                "{shape_name} says {dims:?} but {name} holds a {rows}x{cols} matrix"
            );
        }
        self.coded_view(
            &name,
            CodeKind::Int4,
            (rows, cols),
            CodeLayout::RowMajor,
            &format!("{prefix}.weight_scale"),
            ScaleType::Bf16,
            ScaleLayout::RowMajor,
            1.0,
        )
    }

    /// GPTQ (symmetric, `desc_act` false, 4 bits): `qweight` I32 `[K/8, N]`, `scales` F16
    /// `[K/group, N]`; `config.json`'s quantization_config is checked when present.
    fn gptq_view(&self, prefix: &str) -> Result<MatrixView> {
        self.check_gptq_config()?;
        let name = format!("{prefix}.qweight");
        let t = self.tensor(&name, "")?;
        let (rows, cols) = match (t.dtype.as_str(), t.shape.as_slice()) {
            ("I32", [w, n]) => (*n, w * 8),
            _ => kt_bail!(
                Format,
                "{name} is {} {:?}; GPTQ qweight must be I32 [K/8, N]",
                t.dtype,
                t.shape
            ),
        };
        let view = self.coded_view(
            &name,
            CodeKind::Int4,
            (rows, cols),
            CodeLayout::GptqColumns,
            &format!("{prefix}.scales"),
            ScaleType::F16,
            ScaleLayout::Transposed,
            1.0,
        )?;
        let group = view.coded.as_ref().map_or(cols, |c| c.group);
        self.check_gptq_tensors(prefix, cols, group)?;
        Ok(view)
    }

    /// Refuse the GPTQ tensors we would read wrongly whatever the config says (or without
    /// one): zero points other than the symmetric 8 (stored as 7 by AutoGPTQ's format, 8 by
    /// its v2) and a `g_idx` other than `i / group` (activation order).
    fn check_gptq_tensors(&self, prefix: &str, k: usize, group: usize) -> Result<()> {
        let bytes = |t: &TensorLoc| &self.maps[t.file][t.offset..t.offset + t.len];
        let zeros = format!("{prefix}.qzeros");
        if let Some(t) = self.tensors.get(&zeros) {
            let z = bytes(t);
            kt_ensure!(
                t.dtype == "I32" && (z.iter().all(|&b| b == 0x77) || z.iter().all(|&b| b == 0x88)),
                Unsupported,
                "{zeros}: zero points other than the symmetric 8 (asymmetric GPTQ) are not \
                 supported; GPTQ_INT4 reads symmetric 4-bit weights"
            );
        }
        let order = format!("{prefix}.g_idx");
        if let Some(t) = self.tensors.get(&order) {
            kt_ensure!(
                t.dtype == "I32" && t.len == 4 * k,
                Format,
                "{order} is {} {:?}; a GPTQ g_idx is I32 [{k}]",
                t.dtype,
                t.shape
            );
            let in_order = bytes(t).chunks_exact(4).enumerate().all(|(i, w)| {
                i32::from_le_bytes([w[0], w[1], w[2], w[3]]) as i64 == (i / group) as i64
            });
            kt_ensure!(
                in_order,
                Unsupported,
                "{order} is not i / {group}: activation-order groups (desc_act) are not \
                 supported; re-quantize with desc_act=false"
            );
        }
        Ok(())
    }

    /// Refuse GPTQ checkpoints we would read wrongly: `desc_act` (activation-order groups with
    /// `g_idx`), asymmetric (`sym` false: zero points) or other than 4 bits.
    fn check_gptq_config(&self) -> Result<()> {
        let dir = if self.dir.is_dir() {
            self.dir.clone()
        } else {
            self.dir.parent().map(Path::to_path_buf).unwrap_or_default()
        };
        for file in ["config.json", "quantize_config.json"] {
            let path = dir.join(file);
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
            let q = json.get("quantization_config").unwrap_or(&json);
            // Bools and numbers, also as strings ("true", "4"): some tools write them so.
            let flag = |k: &str| {
                q.get(k)
                    .and_then(|v| v.as_bool().or_else(|| v.as_str()?.trim().parse().ok()))
            };
            kt_ensure!(
                flag("desc_act") != Some(true),
                Unsupported,
                "{}: GPTQ with desc_act=true (activation-order groups, g_idx) is not supported; \
                 re-quantize with desc_act=false",
                path.display()
            );
            kt_ensure!(
                flag("sym") != Some(false),
                Unsupported,
                "{}: asymmetric GPTQ (sym=false, zero points) is not supported; GPTQ_INT4 reads \
                 symmetric 4-bit weights",
                path.display()
            );
            let bits = q
                .get("bits")
                .and_then(|v| v.as_u64().or_else(|| v.as_str()?.trim().parse().ok()));
            kt_ensure!(
                bits.is_none_or(|b| b == 4),
                Unsupported,
                "{}: GPTQ with {} bits; GPTQ_INT4 reads 4-bit weights",
                path.display(),
                bits.unwrap_or(0)
            );
        }
        Ok(())
    }

    /// FP4 (E2M1 nibbles, U8/I8 `[N, K/2]`): MXFP4 with E8M0 scales `scale` or `weight_scale`
    /// (U8/F8_E8M0 `[N, K/32]`), or NVFP4 with `weight_scale` F8_E4M3 `[N, K/16]` and the
    /// per-tensor f32 `weight_scale_2`.
    fn fp4_view(&self, prefix: &str) -> Result<MatrixView> {
        let name = format!("{prefix}.weight");
        let t = self.tensor(&name, "")?;
        let (rows, cols) = match t.shape.as_slice() {
            [n, b] => (*n, b * 2),
            _ => (0, 0),
        };
        let nv = format!("{prefix}.weight_scale");
        let nv_scale = self.tensors.get(&nv);
        // NVFP4's mark is its per-tensor scale: with it, E4M3 group scales stored as bytes
        // would read as MXFP4's power-of-two exponents, every weight wrong.
        if self.has(&format!("{prefix}.weight_scale_2")) {
            kt_ensure!(
                nv_scale.is_some_and(|s| s.dtype == "F8_E4M3"),
                Format,
                "{nv} is {}; beside weight_scale_2 (NVFP4) the group scales must be stored as \
                 F8_E4M3",
                nv_scale.map_or("missing", |s| s.dtype.as_str())
            );
        }
        if nv_scale.is_some_and(|s| s.dtype == "F8_E4M3") {
            let g2 = format!("{prefix}.weight_scale_2");
            let gt = self.tensor(&g2, "the NVFP4 per-tensor scale")?;
            kt_ensure!(
                gt.dtype == "F32" && gt.len == 4,
                Format,
                "{g2} is {} {:?}; NVFP4 needs one F32 value",
                gt.dtype,
                gt.shape
            );
            let bytes = &self.maps[gt.file][gt.offset..gt.offset + 4];
            let global = f32::from_le_bytes(bytes.try_into().unwrap());
            kt_ensure!(
                global.is_finite(),
                Invalid,
                "{g2} is {global}; NVFP4 needs a finite per-tensor scale"
            );
            return self.coded_view(
                &name,
                CodeKind::E2M1,
                (rows, cols),
                CodeLayout::RowMajor,
                &nv,
                ScaleType::E4M3,
                ScaleLayout::RowMajor,
                global,
            );
        }
        let mx = [format!("{prefix}.scale"), nv];
        let Some(scale) = mx.iter().find(|n| self.has(n)) else {
            kt_bail!(
                Format,
                "{name} holds 4-bit codes ({} {:?}) but neither {} (MXFP4 E8M0 scales) nor a \
                 weight_scale (F8_E4M3 for NVFP4) is present",
                t.dtype,
                t.shape,
                mx[0]
            );
        };
        self.coded_view(
            &name,
            CodeKind::E2M1,
            (rows, cols),
            CodeLayout::RowMajor,
            scale,
            ScaleType::E8M0,
            ScaleLayout::RowMajor,
            1.0,
        )
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

/// The tensors that hold an expert matrix's codes, by format: plain and FP8/FP4 `weight`,
/// compressed-tensors int4 `weight_packed` (RAWINT4), GPTQ `qweight`.
const WEIGHT_SUFFIXES: [&str; 3] = ["weight", "weight_packed", "qweight"];

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
    /// `{base}.ffn.experts.{e}.{w1,w3,w2}.weight` (DeepSeek-V4-Flash MXFP4).
    Ffn {
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
            ExpertNaming::PerExpert { base }
            | ExpertNaming::Mixtral { base }
            | ExpertNaming::Ffn { base } => {
                let (group, names) = match naming {
                    ExpertNaming::Mixtral { .. } => ("block_sparse_moe", ["w1", "w3", "w2"]),
                    ExpertNaming::Ffn { .. } => ("ffn", ["w1", "w3", "w2"]),
                    _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
                };
                for e in 0..experts {
                    let get = |n: &str| -> Result<MatrixView> {
                        let prefix = format!("{base}.{group}.experts.{e}.{n}");
                        if !WEIGHT_SUFFIXES
                            .iter()
                            .any(|w| ckpt.has(&format!("{prefix}.{w}")))
                        {
                            kt_bail!(
                                Format,
                                "layer {layer}: expert {e} is missing ({prefix}.weight not found); \
                                 the layer expects {experts} experts"
                            );
                        }
                        ckpt.expert_matrix(&prefix)
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
            let per = format!("{base}.mlp.experts.0.gate_proj");
            let mix = format!("{base}.block_sparse_moe.experts.0.w1");
            let ffn = format!("{base}.ffn.experts.0.w1");
            let packed = format!("{base}.mlp.experts.gate_up_proj");
            let has_weight = |p: &str| {
                WEIGHT_SUFFIXES
                    .iter()
                    .any(|w| ckpt.has(&format!("{p}.{w}")))
            };
            if has_weight(&per) {
                return Ok(ExpertNaming::PerExpert { base });
            }
            if has_weight(&mix) {
                return Ok(ExpertNaming::Mixtral { base });
            }
            if has_weight(&ffn) {
                return Ok(ExpertNaming::Ffn { base });
            }
            if ckpt.has(&packed) {
                return Ok(ExpertNaming::Packed { base });
            }
            tried.extend([
                format!("{per}.weight"),
                format!("{mix}.weight"),
                format!("{ffn}.weight"),
                packed,
            ]);
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
            ExpertNaming::Ffn { base } => format!("{base}.ffn.experts."),
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
