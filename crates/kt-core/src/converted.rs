//! Expert weights converted by the original kt-kernel's `convert_cpu_weights.py` (AMXINT8 and
//! AMXINT4), read and written byte for byte.
//!
//! Two layouts exist. Merged (default): safetensors shards with 1-D tensors
//! `blk.{L}.ffn_{gate,up,down}_exps.{e}.numa.{N}.weight` (I8, also for INT4's packed nibbles)
//! and `....scale` (F32, one per output row). Folders (`--no-merge-safetensor`):
//! `_layer_{L}/_numa_{N}/{INT8|INT4}_{gate|up|down}_{e}_{B}Byte_{quant|scale}_.kt`, raw bytes,
//! `B` = the file size. Part `N` of `threadpool_count` holds rows `[N·I/tp, (N+1)·I/tp)` of
//! gate/up and the same columns of down (re-quantized per part), so files only fit a layer with
//! the same `threadpool_count`. The matrix bytes are the tiled layout of [`crate::quant`] (the
//! in-memory layout up to 3584 inputs; wider matrices are re-blocked, see
//! [`crate::quant::file_runs`]).
//!
//! Loading reads each matrix with positioned reads straight into the layer's memory (one copy
//! out of the page cache, on every loading thread at once, nothing mapped), after the file
//! sizes and safetensors headers have been checked against the layer's shape.
use crate::expert::Proj;
use crate::method::Method;
use crate::safetensors_file::{read_header, TensorPlace};
use crate::shard_index::ShardIndex;
use crate::{kt_bail, kt_ensure, Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes read per `read` call when loading a matrix stored in one run: small enough that a
/// piece is still in L2 when its row sums are taken, large enough that calls are few.
pub const READ_PIECE_BYTES: usize = 128 << 10;

/// The projections in file-name spelling.
pub const PROJS: [(Proj, &str); 3] = [(Proj::Gate, "gate"), (Proj::Up, "up"), (Proj::Down, "down")];

/// Name prefix of the `.kt` files of a format ("INT8" / "INT4").
pub fn kt_prefix(method: Method) -> Result<&'static str> {
    match method {
        Method::AmxInt8 => Ok("INT8"),
        Method::AmxInt4 => Ok("INT4"),
        _ => kt_bail!(Invalid, "converted files hold AMXINT8 or AMXINT4 weights"),
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
    pub method: Method,
}

impl LayerShape {
    /// Refuse a method without converted files and a split that does not divide `I`.
    fn check(&self) -> Result<()> {
        kt_prefix(self.method)?;
        kt_ensure!(
            self.parts > 0 && self.intermediate.is_multiple_of(self.parts),
            Invalid,
            "intermediate size {} does not split into {} parts",
            self.intermediate,
            self.parts
        );
        Ok(())
    }

    /// (rows, columns) of one part of a projection.
    pub fn part_dims(&self, proj: Proj) -> (usize, usize) {
        let ip = self.intermediate / self.parts;
        match proj {
            Proj::Down => (self.hidden, ip),
            _ => (ip, self.hidden),
        }
    }

    /// Bytes of one part's quantized matrix and of its scales.
    pub fn part_bytes(&self, proj: Proj) -> (usize, usize) {
        let (n, k) = self.part_dims(proj);
        let q = match self.method {
            Method::AmxInt4 => n * k / 2,
            _ => n * k,
        };
        (q, n * 4)
    }
}

/// Where one tensor's bytes are: a file, an offset and a length.
#[derive(Debug, Clone)]
struct Located {
    file: usize,
    offset: u64,
    len: usize,
    /// The tensor's name or the file's path, for messages.
    name: String,
}

/// Where a located tensor's bytes come from.
enum Source {
    /// An opened file.
    File(File),
    /// Memory at this address (a caller's tensor, see [`ConvertedLayer::from_addresses`]).
    Memory(usize),
}

/// Files of one layer, opened, and each (part, expert, projection index, is_scale) located.
struct Store {
    files: Vec<Source>,
    /// `files[i]`'s path, for error messages.
    paths: Vec<PathBuf>,
    at: HashMap<(usize, usize, usize, bool), Located>,
}

impl Store {
    fn empty() -> Store {
        Store {
            files: Vec::new(),
            paths: Vec::new(),
            at: HashMap::new(),
        }
    }

    fn push(&mut self, file: File, path: &Path) {
        self.files.push(Source::File(file));
        self.paths.push(path.to_path_buf());
    }

    /// Fill `buf` from `files[i]` at `offset`; errors name the file.
    fn read_at(&self, i: usize, buf: &mut [u8], offset: u64) -> Result<()> {
        match self.files[i] {
            Source::File(ref f) => f
                .read_exact_at(buf, offset)
                .map_err(|e| crate::error::io_error_at(&self.paths[i], "read", e)),
            Source::Memory(at) => {
                // SAFETY: `from_addresses`' contract: the tensor at `at` holds the located
                // length, and reads stay inside it (`locate` checked the length).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (at + offset as usize) as *const u8,
                        buf.as_mut_ptr(),
                        buf.len(),
                    )
                };
                Ok(())
            }
        }
    }
}

/// A layer's converted tensors by address: `[proj][part][expert]` (gate, up, down) for the
/// quantized matrices (the file layout) and for their f32 row scales.
#[derive(Debug, Clone, Default)]
pub struct ConvertedAddresses {
    /// Matrix bytes.
    pub weights: [Vec<Vec<usize>>; 3],
    /// Row scales.
    pub scales: [Vec<Vec<usize>>; 3],
}

/// One layer's converted files, opened and checked against the layer's shape.
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

/// Whether the folder `path` holds converted files for `layer` (either layout). A shard that
/// may hold them but whose header cannot be read is an error naming it, not a "no": else a
/// corrupt converted folder would be taken for a Hugging Face checkpoint.
pub fn has_converted_layer(path: &Path, layer: usize) -> Result<bool> {
    if path.join(format!("_layer_{layer}")).is_dir() {
        return Ok(true);
    }
    let first = merged_key(layer, 0, Proj::Gate, 0, false);
    // An index that names the shard is enough: `ConvertedLayer::open` reads and checks its
    // header (naming it when it is corrupt), so it is not parsed twice per layer.
    if let Some(file) = ShardIndex::of(path).and_then(|ix| ix.file_of(&first).map(str::to_owned)) {
        if path.join(&file).is_file() && !is_partial_name(&file) {
            return Ok(true);
        }
    }
    for f in merged_shards(path, &first)? {
        let file = crate::error::open_regular_file(&f, "safetensors file")?;
        if read_header(&file, &f)?.contains_key(&first) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The safetensors files of `dir` that may hold tensors whose names start with `prefix`: by
/// the index when there is one, else all of them.
fn merged_shards(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| crate::error::io_error_at(dir, "list", e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| !is_partial_name(&n.to_string_lossy()))
        })
        .collect();
    files.sort();
    if let Some(index) = ShardIndex::of(dir) {
        let keep = index.shards_with_prefix(prefix);
        files.retain(|p| {
            p.file_name()
                .is_some_and(|n| keep.contains(&*n.to_string_lossy()))
        });
    }
    Ok(files)
}

impl ConvertedLayer {
    /// Open layer `shape.layer` under `path` (a converter output directory) and check that
    /// every expert the layer needs is there with the sizes `shape` implies.
    pub fn open(path: &Path, shape: LayerShape) -> Result<ConvertedLayer> {
        shape.check()?;
        if !path.exists() {
            kt_bail!(NotFound, "weight path {} does not exist", path.display());
        }
        let folder = path.join(format!("_layer_{}", shape.layer));
        let store = if folder.is_dir() {
            open_folders(&folder, &shape)?
        } else {
            open_merged(path, &shape)?
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
                    layer.locate(e, proj, part)?;
                }
            }
        }
        Ok(layer)
    }

    /// A layer whose converted tensors are in memory, one per (projection, part, expert) as
    /// the original's `SafeTensorLoader.load_experts("blk.L")` hands them over (its
    /// `MOEConfig.gate_projs[numa][expert]` for AMXINT8/AMXINT4).
    ///
    /// # Safety
    /// Every address points to a live tensor of [`LayerShape::part_bytes`] bytes (matrix or
    /// scales of that projection's part) that stays unchanged while the layer is read.
    pub unsafe fn from_addresses(
        shape: LayerShape,
        addrs: &ConvertedAddresses,
    ) -> Result<ConvertedLayer> {
        shape.check()?;
        let mut store = Store::empty();
        for (pi, (proj, name)) in PROJS.iter().enumerate() {
            for (scale, lists) in [(false, &addrs.weights[pi]), (true, &addrs.scales[pi])] {
                let what = if scale { "scales" } else { "projs" };
                kt_ensure!(
                    lists.len() == shape.parts,
                    Invalid,
                    "{name}_{what} has {} NUMA entries; this layer runs with threadpool_count={} \
                     (converted parts cannot be regrouped)",
                    lists.len(),
                    shape.parts
                );
                for (part, experts) in lists.iter().enumerate() {
                    kt_ensure!(
                        experts.len() >= shape.experts,
                        Invalid,
                        "{name}_{what}[{part}] has {} experts; the layer needs {}",
                        experts.len(),
                        shape.experts
                    );
                    let (q, sc) = shape.part_bytes(*proj);
                    for (e, &at) in experts.iter().enumerate().take(shape.experts) {
                        kt_ensure!(
                            at != 0,
                            Invalid,
                            "{name}_{what}[{part}][{e}] is a null address"
                        );
                        store.at.insert(
                            (part, e, pi, scale),
                            Located {
                                file: store.files.len(),
                                offset: 0,
                                len: if scale { sc } else { q },
                                name: format!("{name}_{what}[{part}][{e}]"),
                            },
                        );
                        store.files.push(Source::Memory(at));
                        store.paths.push(PathBuf::from(format!("address 0x{at:x}")));
                    }
                }
            }
        }
        Ok(ConvertedLayer {
            shape,
            store,
            origin: PathBuf::from("tensors passed by address"),
        })
    }

    /// The layer's shape.
    pub fn shape(&self) -> &LayerShape {
        &self.shape
    }

    /// Where one part's matrix and scales are, checked against the sizes the shape implies.
    fn locate(&self, expert: usize, proj: Proj, part: usize) -> Result<(&Located, &Located)> {
        let (want_q, want_s) = self.shape.part_bytes(proj);
        let pi = PROJS.iter().position(|(p, _)| *p == proj).unwrap();
        let get = |scale: bool| -> Result<&Located> {
            match self.store.at.get(&(part, expert, pi, scale)) {
                Some(l) => Ok(l),
                None => kt_bail!(
                    NotFound,
                    "{}: expert {expert} {} {} of part {part} is missing",
                    self.origin.display(),
                    proj_name(proj),
                    if scale { "scale" } else { "quant" }
                ),
            }
        };
        let (q, s) = (get(false)?, get(true)?);
        for (l, want, what) in [(q, want_q, "weights"), (s, want_s, "scales")] {
            if l.len != want {
                let (n, k) = self.shape.part_dims(proj);
                let hint = if what == "weights" && (l.len * 2 == want || l.len == want * 2) {
                    " (the other of AMXINT8/AMXINT4?)"
                } else {
                    ""
                };
                kt_bail!(
                    Format,
                    "{}: {} bytes of {what}, expected {want} for a {n}x{k} part of a {} layer \
                     with threadpool_count={}{hint}",
                    l.name,
                    l.len,
                    kt_prefix(self.shape.method)?,
                    self.shape.parts
                );
            }
        }
        Ok((q, s))
    }

    /// One part of one expert's projection as stored: matrix bytes (the original's file
    /// layout) and little-endian fp32 scale bytes.
    pub fn part(&self, expert: usize, proj: Proj, part: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let (q, s) = self.locate(expert, proj, part)?;
        let read = |l: &Located| -> Result<Vec<u8>> {
            let mut v = vec![0u8; l.len];
            self.store.read_at(l.file, &mut v, l.offset)?;
            Ok(v)
        };
        Ok((read(q)?, read(s)?))
    }

    /// Read one part of one expert's projection into the in-memory layout: `mem` gets the
    /// matrix (re-blocked from the file layout where it differs), `scales` the row scales.
    /// `ready(mem, range)` is called, in order, for pieces of whole 32-row groups as soon as
    /// they hold their final bytes, so the caller can post-process each piece while it is
    /// still in cache (pieces of [`READ_PIECE_BYTES`], or one file row block where the layout
    /// is re-blocked).
    pub fn read_into(
        &self,
        expert: usize,
        proj: Proj,
        part: usize,
        mem: &mut [u8],
        scales: &mut [f32],
        ready: &mut dyn FnMut(&[u8], Range<usize>),
    ) -> Result<()> {
        let (q, s) = self.locate(expert, proj, part)?;
        let (n, k) = self.shape.part_dims(proj);
        let int4 = self.shape.method == Method::AmxInt4;
        kt_ensure!(
            mem.len() == q.len && scales.len() * 4 == s.len,
            Invalid,
            "read_into: buffers of {} and {} bytes for {} and {}",
            mem.len(),
            scales.len() * 4,
            q.len,
            s.len
        );
        let runs = crate::quant::file_runs(int4, n, k)?;
        if let [(0, 0, len)] = runs[..] {
            let group = crate::quant::matrix_bytes(int4, crate::quant::GROUP_ROWS, k);
            let piece = group * (READ_PIECE_BYTES / group).max(1);
            for start in (0..len).step_by(piece) {
                let end = (start + piece).min(len);
                self.store
                    .read_at(q.file, &mut mem[start..end], q.offset + start as u64)?;
                ready(mem, start..end);
            }
        } else {
            // Runs come row block by row block (see `file_runs`); a block is complete once
            // the next run starts in another one.
            let block = crate::quant::matrix_bytes(int4, crate::quant::file_n_block(int4), k);
            let mut current: Option<usize> = None;
            for (m, f, len) in runs {
                if let Some(b) = current.filter(|&b| b != m / block) {
                    ready(mem, b * block..((b + 1) * block).min(mem.len()));
                }
                current = Some(m / block);
                self.store
                    .read_at(q.file, &mut mem[m..m + len], q.offset + f as u64)?;
            }
            if let Some(b) = current {
                ready(mem, b * block..((b + 1) * block).min(mem.len()));
            }
        }
        // SAFETY: f32 has no padding and every bit pattern is valid; the slice covers `scales`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(scales.as_mut_ptr() as *mut u8, scales.len() * 4)
        };
        self.store.read_at(s.file, bytes, s.offset)?;
        for v in scales.iter_mut() {
            *v = f32::from_le_bytes(v.to_ne_bytes());
        }
        Ok(())
    }
}

/// Locate every expert tensor of `shape.layer` in the merged shards under `path`.
fn open_merged(path: &Path, shape: &LayerShape) -> Result<Store> {
    let prefix = format!("blk.{}.ffn_", shape.layer);
    let mut store = Store::empty();
    let mut names: HashMap<String, (usize, TensorPlace)> = HashMap::new();
    for p in merged_shards(path, &prefix)? {
        let f = crate::error::open_regular_file(&p, "converted shard")?;
        let header = read_header(&f, &p)?;
        let idx = store.files.len();
        names.extend(
            header
                .into_iter()
                .filter(|(n, _)| n.starts_with(&prefix))
                .map(|(n, h)| (n, (idx, h))),
        );
        store.push(f, &p);
    }
    let first = merged_key(shape.layer, 0, Proj::Gate, 0, false);
    kt_ensure!(
        names.contains_key(&first),
        NotFound,
        "{} holds no converted weights for layer {} (neither {first} nor a _layer_{} folder)",
        path.display(),
        shape.layer,
        shape.layer
    );
    let found = (0..)
        .take_while(|&n| names.contains_key(&merged_key(shape.layer, 0, Proj::Gate, n, false)))
        .count();
    check_parts(found, shape, path)?;
    for part in 0..shape.parts {
        for e in 0..shape.experts {
            for (pi, (proj, _)) in PROJS.iter().enumerate() {
                for scale in [false, true] {
                    let key = merged_key(shape.layer, e, *proj, part, scale);
                    let Some((
                        file,
                        TensorPlace {
                            dtype, offset, len, ..
                        },
                    )) = names.get(&key)
                    else {
                        continue; // reported as missing by `locate`
                    };
                    let want_dtype = if scale { "F32" } else { "I8" };
                    kt_ensure!(
                        dtype == want_dtype,
                        Format,
                        "{key} has dtype {dtype}, converted files store {want_dtype}"
                    );
                    store.at.insert(
                        (part, e, pi, scale),
                        Located {
                            file: *file,
                            offset: *offset,
                            len: *len,
                            name: key,
                        },
                    );
                }
            }
        }
    }
    Ok(store)
}

fn check_parts(found: usize, shape: &LayerShape, path: &Path) -> Result<()> {
    kt_ensure!(
        found == shape.parts,
        Invalid,
        "{} was converted with --threadpool-count {found}, but this layer runs with \
         threadpool_count={}; the parts split the intermediate dimension and are quantized per \
         part, so they cannot be regrouped: use threadpool_count={found} or convert again",
        path.display(),
        shape.parts
    );
    Ok(())
}

/// Map every `.kt` file of a `_layer_L` folder, checking names, sizes and the part count.
fn open_folders(folder: &Path, shape: &LayerShape) -> Result<Store> {
    let prefix = kt_prefix(shape.method)?;
    let mut parts = Vec::new();
    let list =
        |dir: &Path| std::fs::read_dir(dir).map_err(|e| crate::error::io_error_at(dir, "list", e));
    for entry in list(folder)? {
        let entry = entry.map_err(|e| crate::error::io_error_at(folder, "list", e))?;
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
        !parts.is_empty(),
        Format,
        "{}: no _numa_N folders (an incomplete or foreign _layer_ folder)",
        folder.display()
    );
    kt_ensure!(
        parts.iter().enumerate().all(|(i, &n)| i == n),
        Format,
        "{}: _numa_ folders {parts:?} are not numbered 0..{}",
        folder.display(),
        parts.len()
    );
    check_parts(parts.len(), shape, folder)?;
    let mut store = Store::empty();
    for part in 0..shape.parts {
        let dir = folder.join(format!("_numa_{part}"));
        for entry in list(&dir)? {
            let path = entry
                .map_err(|e| crate::error::io_error_at(&dir, "list", e))?
                .path();
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
            let file = crate::error::open_regular_file(&path, ".kt file")?;
            let len = file
                .metadata()
                .map_err(|e| crate::error::io_error_at(&path, "inspect", e))?
                .len() as usize;
            kt_ensure!(
                len == bytes,
                Format,
                "{}: the name says {bytes} bytes but the file has {len} (truncated?)",
                path.display()
            );
            store.at.insert(
                (part, e, pi, kind == "scale"),
                Located {
                    file: store.files.len(),
                    offset: 0,
                    len,
                    name: path.display().to_string(),
                },
            );
            store.push(file, &path);
        }
    }
    Ok(store)
}

/// The temporary name a file or folder is written under before its rename.
pub fn partial_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".partial-{}", std::process::id()));
    path.with_file_name(name)
}

/// Whether `name` is a temporary name of [`partial_name`] (from any process).
pub fn is_partial_name(name: &str) -> bool {
    name.rsplit_once(".partial-")
        .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// One tensor of a safetensors file being written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: safetensors::Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// Bytes of the tensor's data.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// `(begin, end)` byte offsets of a tensor's data after a safetensors header.
pub type DataRange = (usize, usize);

/// The header of a safetensors file holding `entries` as the `safetensors` library writes it
/// (Python's `save_file` included): tensors ordered by dtype (widest first) then name, no
/// metadata, compact JSON padded with spaces to a multiple of 8, after its 8-byte length.
/// Returns the header bytes and each entry's `(begin, end)` data offsets, in `entries`' order.
pub fn safetensors_header(entries: &[TensorEntry]) -> Result<(Vec<u8>, Vec<DataRange>)> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&entries[a], &entries[b]);
        b.dtype.cmp(&a.dtype).then(a.name.cmp(&b.name))
    });
    let mut offsets = vec![(0, 0); entries.len()];
    let mut json = String::from("{");
    let mut at = 0;
    for (i, &e) in order.iter().enumerate() {
        let t = &entries[e];
        kt_ensure!(
            i == 0 || entries[order[i - 1]].name != t.name,
            Invalid,
            "tensor {} appears twice",
            t.name
        );
        offsets[e] = (at, at + t.bytes());
        let name = serde_json::to_string(&t.name).map_err(|e| Error::Format(e.to_string()))?;
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{}{name}:{{\"dtype\":\"{:?}\",\"shape\":[{}],\"data_offsets\":[{at},{}]}}",
            if i == 0 { "" } else { "," },
            t.dtype,
            shape.join(","),
            at + t.bytes()
        ));
        at += t.bytes();
    }
    json.push('}');
    let mut header = json.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    Ok((out, offsets))
}

/// A safetensors file written in place: the header first, then each tensor's bytes at its
/// offset, in any order and from any thread, under a temporary name that [`finish`] renames
/// once every tensor is there (dropping an unfinished writer deletes the temporary file).
///
/// [`finish`]: SafetensorsWriter::finish
pub struct SafetensorsWriter {
    path: PathBuf,
    tmp: PathBuf,
    file: File,
    data_start: u64,
    slots: HashMap<String, (usize, usize, usize)>,
    written: Vec<std::sync::atomic::AtomicBool>,
    finished: bool,
}

impl SafetensorsWriter {
    /// Create `path`'s temporary file with room for `entries`.
    pub fn create(path: &Path, entries: &[TensorEntry]) -> Result<Self> {
        let (header, offsets) = safetensors_header(entries)?;
        let tmp = partial_name(path);
        let file = File::create(&tmp).map_err(|e| crate::error::io_error_at(&tmp, "create", e))?;
        let end = offsets.iter().map(|o| o.1).max().unwrap_or(0);
        file.set_len((header.len() + end) as u64)?;
        std::os::unix::fs::FileExt::write_all_at(&file, &header, 0)?;
        let slots = entries
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (t, o))| (t.name.clone(), (i, o.0, o.1)))
            .collect();
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            tmp,
            file,
            data_start: header.len() as u64,
            slots,
            written: entries.iter().map(|_| Default::default()).collect(),
            finished: false,
        })
    }

    /// Write tensor `name`'s bytes (exactly its size).
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let Some(&(i, begin, end)) = self.slots.get(name) else {
            kt_bail!(
                Invalid,
                "{}: no tensor {name} in this file",
                self.path.display()
            );
        };
        kt_ensure!(
            bytes.len() == end - begin,
            Invalid,
            "{}: tensor {name} takes {} bytes, got {}",
            self.path.display(),
            end - begin,
            bytes.len()
        );
        std::os::unix::fs::FileExt::write_all_at(
            &self.file,
            bytes,
            self.data_start + begin as u64,
        )?;
        self.written[i].store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Flush to disk and rename into place; fails if a tensor was never written.
    pub fn finish(mut self) -> Result<()> {
        if let Some((name, _)) = self
            .slots
            .iter()
            .find(|(_, s)| !self.written[s.0].load(std::sync::atomic::Ordering::Acquire))
        {
            kt_bail!(
                Runtime,
                "{}: tensor {name} was never written",
                self.path.display()
            );
        }
        self.file.sync_data()?;
        std::fs::rename(&self.tmp, &self.path)?;
        self.finished = true;
        Ok(())
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Where one converted layer goes: a merged expert shard or a `_layer_{L}` folder of `.kt`
/// files. Parts of it may be written from several threads; nothing appears under a final name
/// before [`LayerWriter::finish`].
pub struct LayerWriter {
    shape: LayerShape,
    sink: Sink,
}

enum Sink {
    /// `None` once finished.
    Merged(Option<SafetensorsWriter>),
    Folders {
        tmp: PathBuf,
        dir: PathBuf,
        finished: bool,
    },
}

impl LayerWriter {
    /// The expert shard `file` (merged layout).
    pub fn merged(file: &Path, shape: LayerShape) -> Result<Self> {
        kt_prefix(shape.method)?;
        let mut entries = Vec::new();
        for (name, scale) in merged_index_order(&shape) {
            entries.push(TensorEntry {
                shape: vec![merged_tensor_len(&shape, &name, scale)],
                dtype: if scale {
                    safetensors::Dtype::F32
                } else {
                    safetensors::Dtype::I8
                },
                name,
            });
        }
        Ok(LayerWriter {
            shape,
            sink: Sink::Merged(Some(SafetensorsWriter::create(file, &entries)?)),
        })
    }

    /// The folder `out/_layer_{L}` (folder layout), built under a temporary name.
    pub fn folders(out: &Path, shape: LayerShape) -> Result<Self> {
        kt_prefix(shape.method)?;
        let dir = out.join(format!("_layer_{}", shape.layer));
        let tmp = partial_name(&dir);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        for n in 0..shape.parts {
            let dir = tmp.join(format!("_numa_{n}"));
            std::fs::create_dir_all(&dir)
                .map_err(|e| crate::error::io_error_at(&dir, "create", e))?;
        }
        Ok(LayerWriter {
            shape,
            sink: Sink::Folders {
                tmp,
                dir,
                finished: false,
            },
        })
    }

    /// Store part `part` of expert `expert`'s projection: matrix bytes in the file layout
    /// ([`crate::quant::to_file_layout`]) and one scale per row.
    pub fn put(
        &self,
        expert: usize,
        proj: Proj,
        part: usize,
        q: &[u8],
        scales: &[f32],
    ) -> Result<()> {
        let (want_q, want_s) = self.shape.part_bytes(proj);
        kt_ensure!(
            q.len() == want_q && scales.len() * 4 == want_s,
            Invalid,
            "layer {} expert {expert} {proj:?} part {part}: {} bytes and {} scales, expected {want_q} \
             and {}",
            self.shape.layer,
            q.len(),
            scales.len(),
            want_s / 4
        );
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        match &self.sink {
            Sink::Merged(None) => kt_bail!(Runtime, "layer writer used after finish"),
            Sink::Merged(Some(w)) => {
                w.write(&merged_key(self.shape.layer, expert, proj, part, false), q)?;
                w.write(
                    &merged_key(self.shape.layer, expert, proj, part, true),
                    &scale_bytes,
                )
            }
            Sink::Folders { tmp, .. } => {
                let sub = tmp.join(format!("_numa_{part}"));
                let prefix = kt_prefix(self.shape.method)?;
                for (bytes, scale) in [(q, false), (&scale_bytes[..], true)] {
                    let name = kt_file_name(prefix, expert, proj, scale, bytes.len());
                    std::fs::write(sub.join(name), bytes)?;
                }
                Ok(())
            }
        }
    }

    /// Make the layer visible under its final name (after flushing it to disk).
    pub fn finish(mut self) -> Result<()> {
        match &mut self.sink {
            Sink::Merged(w) => match w.take() {
                Some(w) => w.finish(),
                None => kt_bail!(Runtime, "layer writer finished twice"),
            },
            Sink::Folders { tmp, dir, finished } => {
                for n in 0..self.shape.parts {
                    let sub = tmp.join(format!("_numa_{n}"));
                    let count = std::fs::read_dir(&sub)?.count();
                    kt_ensure!(
                        count == 6 * self.shape.experts,
                        Runtime,
                        "{}: {count} files written, expected {}",
                        sub.display(),
                        6 * self.shape.experts
                    );
                    for entry in std::fs::read_dir(&sub)? {
                        File::open(entry?.path())?.sync_all()?;
                    }
                }
                if dir.exists() {
                    std::fs::remove_dir_all(&*dir)?;
                }
                std::fs::rename(&*tmp, &*dir)?;
                *finished = true;
                Ok(())
            }
        }
    }
}

impl Drop for LayerWriter {
    fn drop(&mut self) {
        if let Sink::Folders {
            tmp,
            finished: false,
            ..
        } = &self.sink
        {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

/// The merged shard's tensor names in the original index's order (part, expert, down/gate/up,
/// weight then scale), with whether each is a scale.
pub fn merged_index_order(shape: &LayerShape) -> Vec<(String, bool)> {
    let mut v = Vec::new();
    for n in 0..shape.parts {
        for e in 0..shape.experts {
            for (proj, _) in [PROJS[2], PROJS[0], PROJS[1]] {
                for scale in [false, true] {
                    v.push((merged_key(shape.layer, e, proj, n, scale), scale));
                }
            }
        }
    }
    v
}

/// Elements of a merged tensor (I8 bytes or F32 scales).
fn merged_tensor_len(shape: &LayerShape, name: &str, scale: bool) -> usize {
    let proj = if name.contains("ffn_down_exps") {
        Proj::Down
    } else if name.contains("ffn_gate_exps") {
        Proj::Gate
    } else {
        Proj::Up
    };
    let (q, s) = shape.part_bytes(proj);
    if scale {
        s / 4
    } else {
        q
    }
}

#[cfg(test)]
mod tests;
