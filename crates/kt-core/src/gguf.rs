//! GGUF files: memory-mapped, validated once at open, tensors returned as slices of the map.
//!
//! Layout (versions 2 and 3; everything little-endian; strings are a u64 byte length then
//! UTF-8 bytes without a terminator):
//!
//! ```text
//! "GGUF"  u32 version  u64 tensor_count  u64 metadata_count
//! metadata_count × (string key, u32 value type, value)
//! tensor_count × (string name, u32 n_dims ≤ 4, n_dims × u64 ne (ne0 = row length, fastest),
//!                 u32 ggml type id, u64 offset from the start of the data section)
//! padding to `general.alignment` (u32, default 32), then the data section
//! ```
//!
//! Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (one byte, 0 or 1),
//! 8 string, 9 array (u32 element type, u64 count, elements; arrays of arrays allowed),
//! 10 u64, 11 i64, 12 f64. Version 1 (32-bit counts) and big-endian files (version 3 allows
//! them; their version field reads byte-swapped here) are rejected with an explanation.
//!
//! Every count and length is checked against the bytes that remain before anything is
//! allocated or read, so a corrupt file yields an [`Error`] (never a panic or a huge
//! allocation). Tensor offsets must be aligned, rows must be whole blocks of the tensor's type,
//! byte sizes are computed with overflow checks, and every tensor must lie inside the file.
//! Tensor names must be unique (within a file, and across the shards of a [`GgufModel`]).
use crate::file_stamp::{fingerprint, stamp, FileStamp};
use crate::ggml::GgmlType;
use crate::{kt_bail, kt_ensure, Error, Result};
use memmap2::Mmap;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Most dimensions a tensor may have (ggml's limit).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays accepted (bounds the parser's recursion).
pub const MAX_ARRAY_NESTING: usize = 8;

/// The type of a metadata value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// u8.
    U8,
    /// i8.
    I8,
    /// u16.
    U16,
    /// i16.
    I16,
    /// u32.
    U32,
    /// i32.
    I32,
    /// f32.
    F32,
    /// bool (one byte).
    Bool,
    /// UTF-8 string.
    String,
    /// Array of one element type.
    Array,
    /// u64.
    U64,
    /// i64.
    I64,
    /// f64.
    F64,
}

impl ValueType {
    /// The type with GGUF id `id`.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Lower-case name (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Fewest bytes one value of this type takes in a file (a string: its length; an array:
    /// element type and count).
    fn min_encoded_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// string.
    String(String),
    /// array.
    Array(Array),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

/// A metadata array: one vector per element type, so large arrays stay compact and an empty
/// array keeps its element type.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// u8 elements.
    U8(Vec<u8>),
    /// i8 elements.
    I8(Vec<i8>),
    /// u16 elements.
    U16(Vec<u16>),
    /// i16 elements.
    I16(Vec<i16>),
    /// u32 elements.
    U32(Vec<u32>),
    /// i32 elements.
    I32(Vec<i32>),
    /// f32 elements.
    F32(Vec<f32>),
    /// bool elements.
    Bool(Vec<bool>),
    /// string elements.
    String(Vec<String>),
    /// array elements (nested arrays).
    Array(Vec<Array>),
    /// u64 elements.
    U64(Vec<u64>),
    /// i64 elements.
    I64(Vec<i64>),
    /// f64 elements.
    F64(Vec<f64>),
}

impl Array {
    /// The element type.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value that fits a u64 (negative values give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A floating-point value (f32 widened exactly).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor of a GGUF file, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// ggml dimensions, `dims[0]` (ne0) the row length and fastest-varying; at most 4.
    pub dims: Vec<usize>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section, as stored (a multiple of the alignment).
    pub offset: usize,
    /// Absolute byte offset of the data in the file.
    pub data_start: usize,
    /// Bytes of data.
    pub size: usize,
}

impl TensorInfo {
    /// Number of values (1 for a tensor with no dimensions).
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Values per row (ne0; 1 for a tensor with no dimensions).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (the product of ne1, ne2, ne3).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product()
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        // Validated at open: ne0 is a whole number of blocks and the size did not overflow.
        self.row_len() / self.ggml_type.block_size() * self.ggml_type.type_size()
    }
}

/// Projection of an MoE expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertProj {
    /// Gate projection ([n = intermediate, k = hidden]).
    Gate,
    /// Up projection ([n = intermediate, k = hidden]).
    Up,
    /// Down projection ([n = hidden, k = intermediate]).
    Down,
}

impl ExpertProj {
    /// `"gate"`, `"up"` or `"down"`.
    pub fn name(self) -> &'static str {
        match self {
            ExpertProj::Gate => "gate",
            ExpertProj::Up => "up",
            ExpertProj::Down => "down",
        }
    }
}

/// The GGUF name of a layer's stacked expert tensor: `blk.{layer}.ffn_{gate|up|down}_exps.weight`.
pub fn expert_tensor_name(layer: usize, proj: ExpertProj) -> String {
    format!("blk.{layer}.ffn_{}_exps.weight", proj.name())
}

/// A stacked 3-D expert tensor `[ne0 = k inputs, ne1 = n outputs, ne2 = experts]`: expert `e`
/// is `n` contiguous rows of `row_bytes` bytes each.
#[derive(Debug, Clone, Copy)]
pub struct ExpertTensor<'a> {
    info: &'a TensorInfo,
    data: &'a [u8],
    row_bytes: usize,
}

impl<'a> ExpertTensor<'a> {
    /// View `info` (with its `data`) as stacked experts; fails unless it has 3 dimensions (a
    /// 4th equal to 1 is allowed) and none is zero.
    pub fn new(info: &'a TensorInfo, data: &'a [u8]) -> Result<ExpertTensor<'a>> {
        let d = &info.dims;
        kt_ensure!(
            d.len() == 3 || (d.len() == 4 && d[3] == 1),
            Format,
            "tensor {} has dimensions {d:?}; stacked experts need 3: [k inputs, n outputs, experts]",
            info.name
        );
        kt_ensure!(
            d[..3].iter().all(|&x| x > 0),
            Format,
            "tensor {} has an empty dimension: {d:?}",
            info.name
        );
        kt_ensure!(
            data.len() == info.size,
            Invalid,
            "tensor {}: {} data bytes given, {} expected",
            info.name,
            data.len(),
            info.size
        );
        Ok(ExpertTensor {
            info,
            data,
            row_bytes: info.row_bytes(),
        })
    }

    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// The tensor info.
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    /// Element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.info.ggml_type
    }

    /// Inputs per expert row (ne0).
    pub fn k(&self) -> usize {
        self.info.dims[0]
    }

    /// Output rows per expert (ne1).
    pub fn n(&self) -> usize {
        self.info.dims[1]
    }

    /// Number of experts (ne2).
    pub fn experts(&self) -> usize {
        self.info.dims[2]
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes per expert (`n · row_bytes`).
    pub fn expert_bytes(&self) -> usize {
        self.n() * self.row_bytes
    }

    /// All experts' bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Expert `e`'s bytes: `n` rows of `row_bytes`.
    pub fn expert(&self, e: usize) -> Result<&'a [u8]> {
        kt_ensure!(
            e < self.experts(),
            Invalid,
            "expert {e} requested from {}, which holds {} experts",
            self.info.name,
            self.experts()
        );
        let size = self.expert_bytes();
        Ok(&self.data[e * size..(e + 1) * size])
    }

    /// Row `r` of expert `e`.
    pub fn row(&self, e: usize, r: usize) -> Result<&'a [u8]> {
        kt_ensure!(
            r < self.n(),
            Invalid,
            "row {r} requested from {}, whose experts have {} rows",
            self.info.name,
            self.n()
        );
        Ok(&self.expert(e)?[r * self.row_bytes..(r + 1) * self.row_bytes])
    }
}

/// Everything a GGUF header says, validated against the file length.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    parsed: Arc<Parsed>,
}

/// A file's validated header and its lookups. Loading each layer of a model opens its files
/// again, and a real model's header is large (a 150k-token vocabulary with its merges takes
/// about 17 ms to parse), so headers are kept per file version ([`PARSED`]).
#[derive(Debug)]
struct Parsed {
    header: Header,
    metadata_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

/// Files whose parsed header is kept, least recently used dropped first. Opening a model opens
/// every file of its folder, so this must exceed a model's shard count (a BF16 DeepSeek-V3 or
/// Kimi-K2 GGUF has 30 to 50); only the first shard holds the large vocabulary.
const PARSED_FILES: usize = 128;

/// A kept header: the file's path and version, a fingerprint of its header bytes.
type Kept = (PathBuf, FileStamp, u64, Arc<Parsed>);

/// Parsed headers, least recently used first.
static PARSED: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

impl Parsed {
    fn new(header: Header) -> Parsed {
        let metadata_index = header
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Parsed {
            header,
            metadata_index,
            tensor_index,
        }
    }

    /// The header of `map` (the file at `path`, version `stamp`): the kept one when this
    /// version was parsed before, else parsed and validated now.
    fn of(path: &Path, stamp: FileStamp, map: &[u8]) -> Result<Arc<Parsed>> {
        let cache = || PARSED.lock().unwrap_or_else(|e| e.into_inner());
        let found = {
            let mut kept = cache();
            let at = kept
                .iter()
                .position(|(q, s, _, _)| q == path && *s == stamp);
            // Most recently used last.
            at.map(|at| {
                let entry = kept.remove(at);
                let found = (entry.2, entry.3.clone());
                kept.push(entry);
                found
            })
        };
        if let Some((print, parsed)) = found {
            // The stamp's size equals the map's, and the header was validated against it.
            if fingerprint(&map[..parsed.header.data_offset.min(map.len())]) == print {
                return Ok(parsed);
            }
        }
        let parsed = Arc::new(Parsed::new(parse(map).map_err(|e| with_path(e, path))?));
        let print = fingerprint(&map[..parsed.header.data_offset.min(map.len())]);
        let mut kept = cache();
        kept.retain(|(q, _, _, _)| q != path);
        if kept.len() >= PARSED_FILES {
            kept.remove(0);
        }
        kept.push((path.to_path_buf(), stamp, print, parsed.clone()));
        Ok(parsed)
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GgufFile({}, v{}, {} metadata keys, {} tensors)",
            self.path.display(),
            self.parsed.header.version,
            self.parsed.header.metadata.len(),
            self.parsed.header.tensors.len()
        )
    }
}

impl GgufFile {
    /// Map and validate a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = crate::error::open_regular_file(path, "GGUF file")?;
        // SAFETY: the file is opened read-only; if another process truncates it while mapped,
        // reads could fault — the contract every memory-mapped model reader has.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::Runtime(format!("cannot map {}: {e}", path.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| crate::error::io_error_at(path, "inspect", e))?;
        let stamp = stamp(&meta);
        kt_ensure!(
            meta.len() == map.len() as u64,
            Runtime,
            "{} changed while it was being opened",
            path.display()
        );
        let parsed = Parsed::of(path, stamp, &map)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            parsed,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.parsed.header.version
    }

    /// Data-section alignment.
    pub fn alignment(&self) -> usize {
        self.parsed.header.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.parsed.header.data_offset
    }

    /// File size in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the file is empty (never true for a file that opened).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The value of a metadata key.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.parsed
            .metadata_index
            .get(key)
            .map(|&i| &self.parsed.header.metadata[i].1)
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> &[(String, Value)] {
        &self.parsed.header.metadata
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata("general.architecture")
            .and_then(Value::as_str)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.parsed.header.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.parsed
            .tensor_index
            .get(name)
            .map(|&i| &self.parsed.header.tensors[i])
    }

    /// A tensor's bytes, borrowed from the map.
    ///
    /// # Panics
    /// If `info` does not describe a tensor of this file.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let ours = self.tensor(&info.name);
        assert!(
            ours == Some(info),
            "tensor {} does not belong to {}",
            info.name,
            self.path.display()
        );
        // Validated at open: the range lies inside the file.
        &self.map[info.data_start..info.data_start + info.size]
    }

    /// A tensor's bytes by name.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    /// A stacked expert tensor by name.
    pub fn expert_tensor(&self, name: &str) -> Result<ExpertTensor<'_>> {
        let info = self.tensor(name).ok_or_else(|| {
            Error::Format(format!(
                "tensor {name} is missing from {}",
                self.path.display()
            ))
        })?;
        ExpertTensor::new(info, self.tensor_data(info)).map_err(|e| with_path(e, &self.path))
    }

    /// Expert `e`'s bytes of the stacked expert tensor `info` (see [`ExpertTensor::expert`]).
    pub fn expert_data<'a>(&'a self, info: &'a TensorInfo, e: usize) -> Result<&'a [u8]> {
        ExpertTensor::new(info, self.tensor_data(info))?.expert(e)
    }
}

/// One GGUF file, or every `*.gguf` file of a folder (not its sub-folders), as one set of
/// tensors.
#[derive(Debug)]
pub struct GgufModel {
    root: PathBuf,
    files: Vec<GgufFile>,
    index: HashMap<String, (usize, usize)>,
}

impl GgufModel {
    /// Open a `.gguf` file or a folder of them (in name order). Tensor names must be unique
    /// across the files.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel> {
        let root = path.as_ref();
        let meta = crate::error::metadata_of(root, "GGUF path")?;
        let paths = if meta.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(root)
                .map_err(|e| crate::error::io_error_at(root, "list", e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.is_file()
                        && p.extension()
                            .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
                })
                .collect();
            v.sort();
            if v.is_empty() {
                kt_bail!(NotFound, "no .gguf files in {}", root.display());
            }
            v
        } else {
            vec![root.to_path_buf()]
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut index: HashMap<String, (usize, usize)> = HashMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let file = GgufFile::open(p)?;
            for (ti, t) in file.tensors().iter().enumerate() {
                if let Some(&(other, _)) = index.get(&t.name) {
                    kt_bail!(
                        Format,
                        "tensor {} is in both {} and {}",
                        t.name,
                        paths[other].display(),
                        p.display()
                    );
                }
                index.insert(t.name.clone(), (fi, ti));
            }
            files.push(file);
        }
        Ok(GgufModel {
            root: root.to_path_buf(),
            files,
            index,
        })
    }

    /// The path given to [`GgufModel::open`].
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The files, in name order.
    pub fn files(&self) -> &[GgufFile] {
        &self.files
    }

    /// A metadata value from the first file that has the key.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.files.iter().find_map(|f| f.metadata(key))
    }

    /// A tensor and the file holding it.
    pub fn tensor(&self, name: &str) -> Option<(&GgufFile, &TensorInfo)> {
        self.index.get(name).map(|&(fi, ti)| {
            let f = &self.files[fi];
            (f, &f.tensors()[ti])
        })
    }

    /// A tensor's bytes by name.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|(f, t)| f.tensor_data(t))
    }

    /// Every tensor name (in no particular order).
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A stacked expert tensor by name, from whichever file holds it.
    pub fn expert_tensor(&self, name: &str) -> Result<ExpertTensor<'_>> {
        match self.tensor(name) {
            Some((f, _)) => f.expert_tensor(name),
            None => Err(Error::Format(format!(
                "tensor {name} is missing from {}",
                self.root.display()
            ))),
        }
    }

    /// Layer `layer`'s stacked expert tensor for `proj` (`blk.{layer}.ffn_{proj}_exps.weight`).
    pub fn layer_experts(&self, layer: usize, proj: ExpertProj) -> Result<ExpertTensor<'_>> {
        self.expert_tensor(&expert_tensor_name(layer, proj))
    }
}

fn with_path(e: Error, path: &Path) -> Error {
    let p = path.display();
    match e {
        Error::Format(m) => Error::Format(format!("{p}: {m}")),
        Error::Unsupported(m) => Error::Unsupported(format!("{p}: {m}")),
        Error::Invalid(m) => Error::Invalid(format!("{p}: {m}")),
        other => other,
    }
}

/// A read position in the header bytes; every read checks the bytes that remain.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            kt_bail!(
                Format,
                "truncated GGUF header: {what} at byte {} needs {n} bytes, {} remain",
                self.pos,
                self.remaining()
            );
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length that must fit in the remaining bytes at `min_size` bytes per item.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_size.max(1)) as u64;
        if n > fits {
            kt_bail!(
                Format,
                "corrupt GGUF header: {what} at byte {at} is {n}, but only {} bytes remain \
                 (room for at most {fits})",
                self.remaining()
            );
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            Error::Format(format!(
                "corrupt GGUF header: {what} at byte {at} is not valid UTF-8"
            ))
        })
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| {
            Error::Format(format!(
                "corrupt GGUF header: {what} at byte {at} has unknown value type {id} (0–12)"
            ))
        })
    }

    fn value(&mut self, ty: ValueType, depth: usize, what: &str) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(depth, what)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    fn bool(&mut self, what: &str) -> Result<bool> {
        let at = self.pos;
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(Error::Format(format!(
                "corrupt GGUF header: {what} at byte {at} is a bool of value {b} (must be 0 or 1)"
            ))),
        }
    }

    /// `count` fixed-width little-endian values, read from one checked slice.
    fn fixed<T, const N: usize>(
        &mut self,
        count: usize,
        what: &str,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        // `count` was checked against the remaining bytes at ≥ N bytes per element.
        let bytes = self.take(count * N, what)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                decode(a)
            })
            .collect())
    }

    fn array_value(&mut self, depth: usize, what: &str) -> Result<Array> {
        kt_ensure!(
            depth < MAX_ARRAY_NESTING,
            Format,
            "corrupt GGUF header: {what} nests arrays more than {MAX_ARRAY_NESTING} deep"
        );
        let elem = self.value_type(what)?;
        let n = self.count(elem.min_encoded_size(), what)?;
        Ok(match elem {
            ValueType::U8 => Array::U8(self.fixed(n, what, u8::from_le_bytes)?),
            ValueType::I8 => Array::I8(self.fixed(n, what, i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(self.fixed(n, what, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, what, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, what, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, what, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, what, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, what, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, what, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, what, f64::from_le_bytes)?),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool(what)?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string(what)?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(depth + 1, what)?);
                }
                Array::Array(v)
            }
        })
    }
}

/// Parse and validate a whole GGUF file image.
pub(crate) fn parse(bytes: &[u8]) -> Result<Header> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic: [u8; 4] = c.array("the magic")?;
    kt_ensure!(
        magic == GGUF_MAGIC,
        Format,
        "not a GGUF file: starts with {magic:02x?}, not \"GGUF\""
    );
    let version = c.u32("the version")?;
    if version == 1 {
        kt_bail!(
            Unsupported,
            "GGUF version 1 (32-bit counts, 2023) is not supported; convert the model again \
             with a current gguf writer (versions 2 and 3 are read)"
        );
    }
    if version & 0xFFFF == 0 && (1..=0xFFFF).contains(&version.swap_bytes()) {
        kt_bail!(
            Unsupported,
            "this is a big-endian GGUF file (version {} byte-swapped); only little-endian \
             files are supported",
            version.swap_bytes()
        );
    }
    kt_ensure!(
        version == 2 || version == 3,
        Unsupported,
        "GGUF version {version} is not supported (versions 2 and 3 are read)"
    );
    // Smallest tensor info: empty name (8), n_dims (4), type (4), offset (8).
    let n_tensors = c.count(24, "the tensor count")?;
    // Smallest metadata entry: empty key (8), type (4), a one-byte value.
    let n_kv = c.count(13, "the metadata count")?;

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv);
    let mut seen_keys: HashSet<String> = HashSet::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let what = format!("metadata value {key:?}");
        let ty = c.value_type(&what)?;
        let value = c.value(ty, 0, &what)?;
        kt_ensure!(
            seen_keys.insert(key.clone()),
            Format,
            "corrupt GGUF header: metadata key {key:?} appears twice"
        );
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a as usize,
        Some((_, v)) => kt_bail!(
            Format,
            "{ALIGNMENT_KEY} must be a u32 power of two, got {v:?}"
        ),
    };

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut seen_names: HashSet<String> = HashSet::with_capacity(n_tensors);
    let mut raw_infos = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name {i}"))?;
        let n_dims = c.u32(&format!("n_dims of tensor {name}"))? as usize;
        kt_ensure!(
            n_dims <= MAX_DIMS,
            Format,
            "corrupt GGUF header: tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})"
        );
        let mut dims = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            let ne = c.u64(&format!("dimension {d} of tensor {name}"))?;
            kt_ensure!(
                ne <= i64::MAX as u64,
                Format,
                "corrupt GGUF header: dimension {d} of tensor {name} is {ne}"
            );
            dims.push(usize::try_from(ne).map_err(|_| {
                Error::Format(format!(
                    "dimension {d} of tensor {name} ({ne}) does not fit in memory"
                ))
            })?);
        }
        let type_id = c.u32(&format!("type of tensor {name}"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {name} has ggml type id {type_id}, which this reader does not know \
                 (known: 0–3, 6–30, 34, 35, 39)"
            ))
        })?;
        let offset = c.u64(&format!("offset of tensor {name}"))?;
        kt_ensure!(
            seen_names.insert(name.clone()),
            Format,
            "corrupt GGUF header: tensor {name} appears twice"
        );
        raw_infos.push((name, dims, ggml_type, offset));
    }
    let data_offset = if n_tensors == 0 {
        c.pos
    } else {
        c.pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| Error::Format("corrupt GGUF header: data offset overflows".into()))?
    };

    for (name, dims, ggml_type, offset) in raw_infos {
        let size = tensor_size(&name, &dims, ggml_type)?;
        kt_ensure!(
            offset.is_multiple_of(alignment as u64),
            Format,
            "corrupt GGUF header: tensor {name} has offset {offset}, not a multiple of the \
             alignment {alignment}"
        );
        let start = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data_offset));
        let end = start.and_then(|s| s.checked_add(size));
        let (Some(start), Some(end)) = (start, end) else {
            kt_bail!(
                Format,
                "corrupt GGUF header: tensor {name} at offset {offset} overflows"
            );
        };
        kt_ensure!(
            end <= bytes.len(),
            Format,
            "tensor {name} ({} bytes at file offset {start}) extends past the end of the file \
             ({} bytes); truncated?",
            size,
            bytes.len()
        );
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset: offset as usize,
            data_start: start,
            size,
        });
    }
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

/// Bytes of a tensor: whole blocks per row, checked multiplication.
fn tensor_size(name: &str, dims: &[usize], ty: GgmlType) -> Result<usize> {
    let ne0 = dims.first().copied().unwrap_or(1);
    let bs = ty.block_size();
    kt_ensure!(
        ne0.is_multiple_of(bs),
        Format,
        "tensor {name}: row length {ne0} is not a multiple of the {} block size {bs}",
        ty.name()
    );
    let overflow = || Error::Format(format!("tensor {name}: size of {dims:?} overflows"));
    // Every partial product of the dimensions must fit too (callers multiply them out), even
    // when a zero dimension makes the total zero.
    dims.iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let row_bytes = (ne0 / bs)
        .checked_mul(ty.type_size())
        .ok_or_else(overflow)?;
    dims.iter()
        .skip(1)
        .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)
}

#[cfg(test)]
mod tests;
