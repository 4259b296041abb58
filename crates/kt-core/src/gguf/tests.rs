use super::*;
use crate::ggml::{dequantize, quantize};
use crate::rng::Rng;

/// Where the hand-built writer put each kind of field (absolute byte offsets), so tests can
/// corrupt exactly one field at a time.
#[derive(Default, Debug)]
struct Fields {
    n_tensors: usize,
    n_kv: usize,
    string_lengths: Vec<usize>,
    value_types: Vec<usize>,
    array_counts: Vec<usize>,
    bools: Vec<usize>,
    n_dims: Vec<usize>,
    dims: Vec<usize>,
    tensor_types: Vec<usize>,
    offsets: Vec<usize>,
}

/// A GGUF image written by hand from the format description (not by the code under test).
struct Builder {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str, f: &mut Fields) {
    f.string_lengths.push(out.len());
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value, f: &mut Fields) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => {
            f.bools.push(out.len());
            out.push(*x as u8);
        }
        Value::String(s) => put_str(out, s, f),
        Value::Array(a) => put_array(out, a, f),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array, f: &mut Fields) {
    f.value_types.push(out.len());
    put_u32(out, a.element_type().id());
    f.array_counts.push(out.len());
    put_u64(out, a.len() as u64);
    let mut each = |v: Value| put_value(out, &v, f);
    match a.clone() {
        Array::U8(v) => v.into_iter().for_each(|x| each(Value::U8(x))),
        Array::I8(v) => v.into_iter().for_each(|x| each(Value::I8(x))),
        Array::U16(v) => v.into_iter().for_each(|x| each(Value::U16(x))),
        Array::I16(v) => v.into_iter().for_each(|x| each(Value::I16(x))),
        Array::U32(v) => v.into_iter().for_each(|x| each(Value::U32(x))),
        Array::I32(v) => v.into_iter().for_each(|x| each(Value::I32(x))),
        Array::F32(v) => v.into_iter().for_each(|x| each(Value::F32(x))),
        Array::Bool(v) => v.into_iter().for_each(|x| each(Value::Bool(x))),
        Array::String(v) => v.into_iter().for_each(|x| each(Value::String(x))),
        Array::Array(v) => v.into_iter().for_each(|x| each(Value::Array(x))),
        Array::U64(v) => v.into_iter().for_each(|x| each(Value::U64(x))),
        Array::I64(v) => v.into_iter().for_each(|x| each(Value::I64(x))),
        Array::F64(v) => v.into_iter().for_each(|x| each(Value::F64(x))),
    }
}

impl Builder {
    fn new() -> Builder {
        Builder {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn kv(mut self, key: &str, v: Value) -> Builder {
        if key == ALIGNMENT_KEY {
            // Invalid values are written as given but laid out with the default.
            if let Value::U32(a) = v {
                if a.is_power_of_two() {
                    self.alignment = a as usize;
                }
            }
        }
        self.metadata.push((key.to_string(), v));
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Builder {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty.id(), data));
        self
    }

    fn build(&self) -> (Vec<u8>, Fields) {
        let mut f = Fields::default();
        let mut out = b"GGUF".to_vec();
        put_u32(&mut out, self.version);
        f.n_tensors = out.len();
        put_u64(&mut out, self.tensors.len() as u64);
        f.n_kv = out.len();
        put_u64(&mut out, self.metadata.len() as u64);
        for (k, v) in &self.metadata {
            put_str(&mut out, k, &mut f);
            if let Value::Array(_) = v {
                put_u32(&mut out, ValueType::Array.id());
                put_array(&mut out, v.as_array().unwrap(), &mut f);
            } else {
                f.value_types.push(out.len());
                put_u32(&mut out, v.value_type().id());
                put_value(&mut out, v, &mut f);
            }
        }
        let mut data = Vec::new();
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name, &mut f);
            f.n_dims.push(out.len());
            put_u32(&mut out, dims.len() as u32);
            for &d in dims {
                f.dims.push(out.len());
                put_u64(&mut out, d);
            }
            f.tensor_types.push(out.len());
            put_u32(&mut out, *ty);
            let offset = data.len().next_multiple_of(self.alignment);
            data.resize(offset, 0);
            data.extend_from_slice(bytes);
            f.offsets.push(out.len());
            put_u64(&mut out, offset as u64);
        }
        if !self.tensors.is_empty() {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
        }
        out.extend_from_slice(&data);
        (out, f)
    }
}

fn every_metadata_type() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("qwen3moe".into())),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(1.5)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ✓".into())),
        ("t.u64", Value::U64(u64::MAX - 1)),
        ("t.i64", Value::I64(i64::MIN + 1)),
        ("t.f64", Value::F64(0.1)),
        ("t.a_u8", Value::Array(Array::U8(vec![1, 2, 255]))),
        ("t.a_i8", Value::Array(Array::I8(vec![-1, 2]))),
        ("t.a_u16", Value::Array(Array::U16(vec![65535]))),
        ("t.a_i16", Value::Array(Array::I16(vec![-2, 3]))),
        ("t.a_u32", Value::Array(Array::U32(vec![7, 8, 9]))),
        ("t.a_i32", Value::Array(Array::I32(vec![-7]))),
        ("t.a_f32", Value::Array(Array::F32(vec![0.25, -1.0]))),
        ("t.a_bool", Value::Array(Array::Bool(vec![true, false]))),
        (
            "t.a_string",
            Value::Array(Array::String(vec!["a".into(), "".into(), "ü".into()])),
        ),
        ("t.a_u64", Value::Array(Array::U64(vec![1 << 40]))),
        ("t.a_i64", Value::Array(Array::I64(vec![-(1 << 40)]))),
        ("t.a_f64", Value::Array(Array::F64(vec![2.5]))),
        ("t.a_empty", Value::Array(Array::String(vec![]))),
        (
            "t.a_nested",
            Value::Array(Array::Array(vec![
                Array::U32(vec![1, 2]),
                Array::U32(vec![]),
                Array::Array(vec![Array::String(vec!["deep".into()])]),
            ])),
        ),
    ]
}

/// A valid file with every metadata type, a 3-D Q8_0 expert tensor, a Q4_K matrix, an F32
/// matrix and an F32 scalar.
fn valid_builder(rng: &mut Rng) -> Builder {
    let mut b = Builder::new();
    for (k, v) in every_metadata_type() {
        b = b.kv(k, v);
    }
    let experts = quantize(GgmlType::Q8_0, &rng.normals(64 * 4 * 3, 0.1)).unwrap();
    let q4k = quantize(GgmlType::Q4_K, &rng.normals(256 * 2, 0.1)).unwrap();
    let f32s: Vec<u8> = rng
        .normals(16, 1.0)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    b.tensor(
        "blk.0.ffn_gate_exps.weight",
        &[64, 4, 3],
        GgmlType::Q8_0,
        experts,
    )
    .tensor("blk.0.attn_q.weight", &[256, 2], GgmlType::Q4_K, q4k)
    .tensor("scalar", &[], GgmlType::F32, 1.5f32.to_le_bytes().to_vec())
    .tensor("token_embd.weight", &[8, 2], GgmlType::F32, f32s)
}

#[test]
fn valid_file_parses_with_every_metadata_type() {
    let mut rng = Rng::new(1);
    let builder = valid_builder(&mut rng);
    let (bytes, _) = builder.build();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.data_offset % 32, 0);
    let want: Vec<(String, Value)> = every_metadata_type()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(h.metadata, want);
    assert_eq!(h.tensors.len(), 4);
    for (t, (name, dims, ty, data)) in h.tensors.iter().zip(&builder.tensors) {
        assert_eq!(&t.name, name);
        assert_eq!(t.dims, dims.iter().map(|&d| d as usize).collect::<Vec<_>>());
        assert_eq!(t.ggml_type.id(), *ty);
        assert_eq!(t.size, data.len());
        assert_eq!(t.offset % 32, 0);
        assert_eq!(&bytes[t.data_start..t.data_start + t.size], &data[..]);
    }
    let scalar = &h.tensors[2];
    assert_eq!(
        (scalar.n_elements(), scalar.row_len(), scalar.n_rows()),
        (1, 1, 1)
    );
    assert_eq!(h.tensors[1].row_bytes(), 144);
    // Version 2 has the same layout.
    let mut v2 = builder;
    v2.version = 2;
    assert_eq!(parse(&v2.build().0).unwrap().version, 2);
}

#[test]
fn value_accessors() {
    assert_eq!(Value::U8(3).as_u64(), Some(3));
    assert_eq!(Value::I32(-3).as_u64(), None);
    assert_eq!(Value::I32(-3).as_i64(), Some(-3));
    assert_eq!(Value::U64(u64::MAX).as_i64(), None);
    assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
    assert_eq!(Value::String("x".into()).as_str(), Some("x"));
    assert_eq!(Value::Bool(true).as_bool(), Some(true));
    assert_eq!(Value::U8(1).as_bool(), None);
    let a = Value::Array(Array::F32(vec![1.0]));
    assert_eq!(a.as_array().map(Array::len), Some(1));
    assert_eq!(a.value_type(), ValueType::Array);
    assert!(Array::U32(vec![]).is_empty());
    for id in 0..13 {
        assert_eq!(ValueType::from_id(id).unwrap().id(), id);
    }
    assert!(ValueType::from_id(13).is_none());
}

/// Parse without panicking (a panic fails the test with the case named).
fn parse_quietly(bytes: &[u8], case: &str) -> Result<Header> {
    std::panic::catch_unwind(|| parse(bytes)).unwrap_or_else(|_| panic!("parse panicked on {case}"))
}

#[test]
fn every_truncation_is_an_error() {
    let (bytes, _) = valid_builder(&mut Rng::new(2)).build();
    for cut in 0..bytes.len() {
        assert!(
            parse_quietly(&bytes[..cut], &format!("cut at {cut}")).is_err(),
            "a file cut at {cut} of {} parsed",
            bytes.len()
        );
    }
}

fn patched(bytes: &[u8], at: usize, value: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[at..at + value.len()].copy_from_slice(value);
    b
}

#[test]
fn corrupt_counts_lengths_types_and_offsets_are_errors() {
    let (bytes, f) = valid_builder(&mut Rng::new(3)).build();
    let must_fail = |b: Vec<u8>, case: String| {
        assert!(parse_quietly(&b, &case).is_err(), "{case} parsed");
    };
    let huge = [u64::MAX, 1 << 63, 1 << 40, bytes.len() as u64];
    for v in huge {
        must_fail(
            patched(&bytes, f.n_tensors, &v.to_le_bytes()),
            format!("n_tensors {v}"),
        );
        must_fail(
            patched(&bytes, f.n_kv, &v.to_le_bytes()),
            format!("n_kv {v}"),
        );
        for &at in &f.string_lengths {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("string len {v} @{at}"),
            );
        }
        for &at in &f.array_counts {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("array count {v} @{at}"),
            );
        }
        for &at in &f.dims {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("dim {v} @{at}"),
            );
        }
        for &at in &f.offsets {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("offset {v} @{at}"),
            );
        }
    }
    for &at in &f.value_types {
        for v in [13u32, 99, u32::MAX] {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("value type {v} @{at}"),
            );
        }
    }
    for &at in &f.bools {
        must_fail(patched(&bytes, at, &[2]), format!("bool 2 @{at}"));
    }
    for &at in &f.n_dims {
        for v in [5u32, u32::MAX] {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("n_dims {v} @{at}"),
            );
        }
    }
    for &at in &f.tensor_types {
        for v in [4u32, 31, 99, u32::MAX] {
            let r = parse_quietly(&patched(&bytes, at, &v.to_le_bytes()), "type");
            assert!(
                matches!(r, Err(Error::Unsupported(_))),
                "type id {v} @{at}: {r:?}"
            );
        }
    }
    for &at in &f.offsets {
        let offset = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        for v in [offset + 1, offset + 16, offset + (1 << 20)] {
            must_fail(
                patched(&bytes, at, &v.to_le_bytes()),
                format!("offset {v} @{at}"),
            );
        }
    }
    // Other plausible-looking values may or may not parse, but must not panic.
    let mut rng = Rng::new(4);
    let all: Vec<usize> = [f.n_tensors, f.n_kv]
        .into_iter()
        .chain(f.string_lengths.iter().copied())
        .chain(f.array_counts.iter().copied())
        .chain(f.dims.iter().copied())
        .chain(f.offsets.iter().copied())
        .collect();
    for &at in &all {
        let old = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        for v in [
            0,
            1,
            old.wrapping_sub(1),
            old + 1,
            old * 2,
            rng.next_u64() % 4096,
        ] {
            let _ = parse_quietly(&patched(&bytes, at, &v.to_le_bytes()), "small change");
        }
    }
}

#[test]
fn random_byte_flips_never_panic() {
    let (bytes, _) = valid_builder(&mut Rng::new(5)).build();
    let mut rng = Rng::new(6);
    // Most flips hit the header (where parsing decisions are made) rather than tensor data.
    let header_len = parse(&bytes).unwrap().data_offset;
    for round in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = if rng.below(4) == 0 {
                rng.below(b.len())
            } else {
                rng.below(header_len)
            };
            b[at] ^= 1 << rng.below(8);
        }
        let _ = parse_quietly(&b, &format!("flip round {round}"));
    }
}

#[test]
fn versions_endianness_and_magic() {
    let (bytes, _) = valid_builder(&mut Rng::new(7)).build();
    let with_version = |v: u32| patched(&bytes, 4, &v.to_le_bytes());
    let err = parse(&with_version(1)).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported(m) if m.contains("version 1")),
        "{err}"
    );
    let err = parse(&with_version(3u32.swap_bytes())).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported(m) if m.contains("big-endian")),
        "{err}"
    );
    let err = parse(&with_version(2u32.swap_bytes())).unwrap_err();
    assert!(err.to_string().contains("big-endian"), "{err}");
    assert!(matches!(
        parse(&with_version(4)),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        parse(&with_version(0)),
        Err(Error::Unsupported(_))
    ));
    let err = parse(&patched(&bytes, 0, b"GGML")).unwrap_err();
    assert!(
        matches!(&err, Error::Format(m) if m.contains("not a GGUF file")),
        "{err}"
    );
}

#[test]
fn duplicates_alignment_blocks_and_nesting() {
    let mut rng = Rng::new(8);
    let q = quantize(GgmlType::Q4_0, &rng.normals(64, 1.0)).unwrap();
    // Duplicate metadata key / tensor name.
    let dup_key = Builder::new()
        .kv("a", Value::U8(1))
        .kv("a", Value::U8(2))
        .build()
        .0;
    assert!(matches!(parse(&dup_key), Err(Error::Format(m)) if m.contains("twice")));
    let dup_tensor = Builder::new()
        .tensor("w", &[32], GgmlType::Q4_0, q[..18].to_vec())
        .tensor("w", &[32], GgmlType::Q4_0, q[18..].to_vec())
        .build()
        .0;
    assert!(matches!(parse(&dup_tensor), Err(Error::Format(m)) if m.contains("twice")));
    // A custom alignment moves the data section and every offset.
    let aligned = Builder::new()
        .kv(ALIGNMENT_KEY, Value::U32(256))
        .tensor("a", &[32], GgmlType::Q4_0, q[..18].to_vec())
        .tensor("b", &[32], GgmlType::Q4_0, q[18..].to_vec())
        .build()
        .0;
    let h = parse(&aligned).unwrap();
    assert_eq!(h.alignment, 256);
    assert_eq!(h.data_offset % 256, 0);
    assert_eq!(h.tensors[1].offset, 256);
    for bad in [
        Value::U32(0),
        Value::U32(48),
        Value::U64(32),
        Value::I32(32),
    ] {
        let b = Builder::new()
            .kv(ALIGNMENT_KEY, bad.clone())
            .tensor("a", &[32], GgmlType::Q4_0, q[..18].to_vec())
            .build()
            .0;
        assert!(matches!(parse(&b), Err(Error::Format(_))), "{bad:?}");
    }
    // Rows must be whole blocks.
    let partial = Builder::new()
        .tensor("w", &[128, 2], GgmlType::Q4_K, vec![0; 144])
        .build()
        .0;
    assert!(matches!(parse(&partial), Err(Error::Format(m)) if m.contains("block size 256")));
    // Size overflow, even with a zero dimension somewhere.
    let overflow = Builder::new()
        .tensor("w", &[0, 1 << 40, 1 << 40], GgmlType::F32, vec![])
        .build()
        .0;
    assert!(matches!(parse(&overflow), Err(Error::Format(m)) if m.contains("overflows")));
    // Arrays nested deeper than the limit, and very deep nesting without a stack overflow.
    for depth in [MAX_ARRAY_NESTING + 1, 100_000] {
        let mut bytes = Builder::new().build().0;
        bytes[16..24].copy_from_slice(&1u64.to_le_bytes()); // one metadata entry
        put_str(&mut bytes, "deep", &mut Fields::default());
        put_u32(&mut bytes, ValueType::Array.id());
        for _ in 0..depth {
            put_u32(&mut bytes, ValueType::Array.id());
            put_u64(&mut bytes, 1);
        }
        put_u32(&mut bytes, ValueType::U8.id());
        put_u64(&mut bytes, 0);
        assert!(matches!(parse(&bytes), Err(Error::Format(m)) if m.contains("deep")));
    }
    let mut ok = Builder::new().build().0;
    ok[16..24].copy_from_slice(&1u64.to_le_bytes());
    put_str(&mut ok, "nested", &mut Fields::default());
    put_u32(&mut ok, ValueType::Array.id());
    for _ in 0..MAX_ARRAY_NESTING - 1 {
        put_u32(&mut ok, ValueType::Array.id());
        put_u64(&mut ok, 1);
    }
    put_u32(&mut ok, ValueType::U8.id());
    put_u64(&mut ok, 0);
    assert!(parse(&ok).is_ok());
    // Invalid UTF-8 in a key.
    let mut bad_utf8 = Builder::new().kv("ab", Value::U8(1)).build().0;
    let at = bad_utf8.len() - 1 - 4 - 2;
    bad_utf8[at] = 0xFF;
    assert!(matches!(parse(&bad_utf8), Err(Error::Format(m)) if m.contains("UTF-8")));
    // No tensors and no metadata is a valid (empty) file.
    assert!(parse(&Builder::new().build().0).unwrap().tensors.is_empty());
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kt-gguf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn files_open_zero_copy_and_expose_experts() {
    let dir = TempDir::new("file");
    let mut rng = Rng::new(9);
    let builder = valid_builder(&mut rng);
    let (bytes, _) = builder.build();
    let path = dir.0.join("model.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.len(), bytes.len());
    assert_eq!(file.architecture(), Some("qwen3moe"));
    assert_eq!(file.metadata("t.i16"), Some(&Value::I16(-30000)));
    assert!(file.metadata("missing").is_none());
    assert_eq!(file.metadata_entries().len(), every_metadata_type().len());
    let info = file.tensor("blk.0.ffn_gate_exps.weight").unwrap();
    let data = file.tensor_data(info);
    assert_eq!(data, &builder.tensors[0].3[..]);
    // Zero copy: the slice points into the map.
    let map_range = file.map.as_ptr_range();
    assert!(map_range.contains(&data.as_ptr()));

    let experts = file.expert_tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!((experts.k(), experts.n(), experts.experts()), (64, 4, 3));
    assert_eq!(experts.ggml_type(), GgmlType::Q8_0);
    assert_eq!(experts.row_bytes(), 68);
    assert_eq!(experts.expert_bytes(), 4 * 68);
    for e in 0..3 {
        let bytes_e = experts.expert(e).unwrap();
        assert_eq!(bytes_e, &data[e * 272..(e + 1) * 272]);
        assert_eq!(file.expert_data(info, e).unwrap(), bytes_e);
        assert_eq!(experts.row(e, 3).unwrap(), &bytes_e[3 * 68..]);
    }
    assert!(experts.expert(3).is_err());
    assert!(experts.row(0, 4).is_err());
    assert!(file.expert_tensor("token_embd.weight").is_err()); // 2-D
    assert!(matches!(file.expert_tensor("nope"), Err(Error::Format(m)) if m.contains("missing")));

    // A truncated copy, a missing file and a directory are errors naming the path.
    let cut = dir.0.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1]).unwrap();
    let err = GgufFile::open(&cut).unwrap_err();
    assert!(err.to_string().contains("cut.gguf"), "{err}");
    assert!(matches!(
        GgufFile::open(dir.0.join("absent.gguf")),
        Err(Error::NotFound(_))
    ));
    assert!(GgufFile::open(&dir.0).is_err());
    let empty = dir.0.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(GgufFile::open(&empty), Err(Error::Format(_))));
}

#[test]
fn reopening_reuses_the_parsed_header_until_the_file_changes() {
    let dir = TempDir::new("reopen");
    let (bytes, _) = valid_builder(&mut Rng::new(11)).build();
    let path = dir.0.join("model.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let a = GgufFile::open(&path).unwrap();
    let b = GgufFile::open(&path).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a.parsed, &b.parsed));
    // Same size, one header byte changed (an i16 metadata value): parsed again, whatever the
    // file system's timestamp resolution.
    let at = bytes
        .windows(2)
        .position(|w| w == (-30000i16).to_le_bytes())
        .unwrap();
    let mut changed = bytes.clone();
    changed[at..at + 2].copy_from_slice(&1234i16.to_le_bytes());
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    std::fs::write(&path, &changed).unwrap();
    // The same stamp (inode, size, time) as before: only the header's fingerprint differs.
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let c = GgufFile::open(&path).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a.parsed, &c.parsed));
    assert_eq!(c.metadata("t.i16"), Some(&Value::I16(1234)));
    assert_eq!(a.metadata("t.i16"), Some(&Value::I16(-30000)));
    // Truncated now: an error, not the kept header.
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    assert!(GgufFile::open(&path).is_err());
}

#[test]
#[should_panic(expected = "does not belong")]
fn tensor_data_rejects_foreign_infos() {
    let dir = TempDir::new("foreign");
    let (bytes, _) = valid_builder(&mut Rng::new(10)).build();
    std::fs::write(dir.0.join("a.gguf"), &bytes).unwrap();
    let file = GgufFile::open(dir.0.join("a.gguf")).unwrap();
    let mut info = file.tensors()[0].clone();
    info.size += 1 << 30;
    let _ = file.tensor_data(&info);
}

#[test]
fn folders_of_shards() {
    let dir = TempDir::new("shards");
    let mut rng = Rng::new(11);
    let gate = quantize(GgmlType::Q8_0, &rng.normals(64 * 4 * 2, 0.1)).unwrap();
    let up = quantize(GgmlType::Q8_0, &rng.normals(64 * 4 * 2, 0.1)).unwrap();
    let shard1 = Builder::new()
        .kv("general.architecture", Value::String("qwen3moe".into()))
        .tensor(
            &expert_tensor_name(1, ExpertProj::Gate),
            &[64, 4, 2],
            GgmlType::Q8_0,
            gate.clone(),
        )
        .build()
        .0;
    let shard2 = Builder::new()
        .kv("split.no", Value::U16(1))
        .tensor(
            &expert_tensor_name(1, ExpertProj::Up),
            &[64, 4, 2],
            GgmlType::Q8_0,
            up.clone(),
        )
        .build()
        .0;
    std::fs::write(dir.0.join("m-00001-of-00002.gguf"), &shard1).unwrap();
    std::fs::write(dir.0.join("m-00002-of-00002.GGUF"), &shard2).unwrap();
    std::fs::write(dir.0.join("README.md"), b"not a model").unwrap();
    // Sub-folders are not searched.
    std::fs::create_dir(dir.0.join("sub")).unwrap();
    std::fs::write(dir.0.join("sub/extra.gguf"), &shard1).unwrap();

    let model = GgufModel::open(&dir.0).unwrap();
    assert_eq!(model.files().len(), 2);
    assert_eq!(model.root(), dir.0.as_path());
    assert_eq!(model.metadata("split.no"), Some(&Value::U16(1)));
    assert_eq!(
        model
            .metadata("general.architecture")
            .and_then(Value::as_str),
        Some("qwen3moe")
    );
    let g = model.layer_experts(1, ExpertProj::Gate).unwrap();
    let u = model.layer_experts(1, ExpertProj::Up).unwrap();
    assert_eq!(g.data(), &gate[..]);
    assert_eq!(u.expert(1).unwrap(), &up[up.len() / 2..]);
    assert_eq!(
        model.tensor_bytes("blk.1.ffn_up_exps.weight"),
        Some(&up[..])
    );
    let mut names: Vec<_> = model.tensor_names().collect();
    names.sort();
    assert_eq!(
        names,
        ["blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"]
    );
    let err = model.layer_experts(1, ExpertProj::Down).unwrap_err();
    assert!(
        err.to_string().contains("blk.1.ffn_down_exps.weight"),
        "{err}"
    );
    // A single file works the same way.
    let one = GgufModel::open(dir.0.join("m-00001-of-00002.gguf")).unwrap();
    assert!(one.tensor("blk.1.ffn_gate_exps.weight").is_some());
    // The same tensor in two shards is an error naming both files.
    std::fs::write(dir.0.join("m-00003.gguf"), &shard1).unwrap();
    let err = GgufModel::open(&dir.0).unwrap_err();
    assert!(err.to_string().contains("m-00003.gguf"), "{err}");
    // An empty folder, and a missing path.
    let empty = TempDir::new("empty");
    assert!(matches!(GgufModel::open(&empty.0), Err(Error::NotFound(_))));
    assert!(matches!(
        GgufModel::open(empty.0.join("x")),
        Err(Error::NotFound(_))
    ));
}

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The file `tests/test_ggml_formats.py` writes with gguf-py's GGUFWriter (committed so the
/// Rust suite needs no Python): every metadata type, alignment 64, stacked Q8_0 and Q4_K expert
/// tensors, and F32 tensors holding gguf-py's own dequantization of them.
#[test]
fn reads_a_file_written_by_gguf_py() {
    let path = repo_path("tests/data/gguf-py-experts.gguf");
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.architecture(), Some("qwen3moe"));
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    let m = |k: &str| file.metadata(k).unwrap().clone();
    assert_eq!(m("test.u8"), Value::U8(200));
    assert_eq!(m("test.i8"), Value::I8(-100));
    assert_eq!(m("test.u16"), Value::U16(60000));
    assert_eq!(m("test.i16"), Value::I16(-30000));
    assert_eq!(m("test.u32"), Value::U32(4_000_000_000));
    assert_eq!(m("test.i32"), Value::I32(-2_000_000_000));
    assert_eq!(m("test.f32"), Value::F32(1.5));
    assert_eq!(m("test.bool"), Value::Bool(true));
    assert_eq!(m("test.string"), Value::String("héllo ✓".into()));
    assert_eq!(m("test.u64"), Value::U64((1 << 40) + 3));
    assert_eq!(m("test.i64"), Value::I64(-(1 << 40)));
    assert_eq!(m("test.f64"), Value::F64(0.1));
    assert_eq!(
        m("test.array_i32"),
        Value::Array(Array::I32(vec![1, -2, 3]))
    );
    assert_eq!(
        m("test.array_str"),
        Value::Array(Array::String(vec!["a".into(), "bc".into(), "".into()]))
    );
    assert_eq!(
        m("test.array_f32"),
        Value::Array(Array::F32(vec![0.5, -0.25]))
    );
    for (name, ty) in [("gate", GgmlType::Q8_0), ("up", GgmlType::Q4_K)] {
        let experts = file
            .expert_tensor(&format!("blk.0.ffn_{name}_exps.weight"))
            .unwrap();
        assert_eq!(experts.ggml_type(), ty);
        assert_eq!((experts.n(), experts.experts()), (4, 2));
        let reference = file
            .tensor(&format!("ref.blk.0.ffn_{name}_exps.weight"))
            .unwrap();
        assert_eq!(reference.ggml_type, GgmlType::F32);
        assert_eq!(reference.dims, experts.info().dims);
        let want: Vec<f32> = file
            .tensor_data(reference)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let per_expert = experts.k() * experts.n();
        for e in 0..experts.experts() {
            let got = dequantize(ty, experts.expert(e).unwrap(), per_expert).unwrap();
            assert_eq!(
                got,
                want[e * per_expert..(e + 1) * per_expert],
                "{name} expert {e}"
            );
        }
    }
}

/// The LLAMAFILE fixtures written for the original (shared/fixtures/gguf), when present.
#[test]
fn reads_the_shared_llamafile_fixtures() {
    let root = repo_path("../../../shared/fixtures/gguf");
    if !root.is_dir() {
        eprintln!("skipped: {} not present", root.display());
        return;
    }
    for (set, ty) in [("q8_0", GgmlType::Q8_0), ("q4_k", GgmlType::Q4_K)] {
        let model = GgufModel::open(root.join(set)).unwrap();
        let file = &model.files()[0];
        assert_eq!(file.version(), 3);
        assert_eq!(file.architecture(), Some("qwen3moe"));
        assert_eq!(file.tensors().len(), 3);
        let size = ty.row_bytes(256).unwrap() * 256 * 4;
        for (i, proj) in [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down]
            .into_iter()
            .enumerate()
        {
            let t = model.layer_experts(1, proj).unwrap();
            assert_eq!(t.info().dims, [256, 256, 4]);
            assert_eq!(t.ggml_type(), ty);
            assert_eq!(t.info().data_start, 320 + i * size);
            // Weights were drawn as randn · 0.02.
            let w = dequantize(ty, t.expert(3).unwrap(), 256 * 256).unwrap();
            let rms = (w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len() as f64).sqrt();
            assert!((0.015..0.025).contains(&rms), "{set} {proj:?}: rms {rms}");
        }
    }
}
