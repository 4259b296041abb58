//! The one safetensors header reader: Hugging Face checkpoints ([`crate::weights`]) and the
//! original's converted shards ([`crate::converted`]) both locate their tensors with it.
//!
//! The header is read with two positioned reads (its length, then its JSON), so a caller can
//! check a file's tensors before it maps or reads any data; every tensor is checked to lie
//! inside the file.
use crate::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Largest header accepted (the format allows 100 MB; real checkpoints use a few MB).
const MAX_HEADER: u64 = 1 << 30;

/// Where one tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    /// The dtype as the header spells it ("BF16", "F32", "I8", "F8_E4M3", ...).
    pub dtype: String,
    /// The shape as written.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub len: usize,
}

/// Every tensor of the safetensors file `file` (`path` names it in messages). Malformed
/// headers and tensors outside the file are [`Error::Format`]; read failures name the path.
pub fn read_header(file: &File, path: &Path) -> Result<HashMap<String, TensorPlace>> {
    let bad = |m: String| Error::Format(format!("{}: {m}", path.display()));
    let io = |e: std::io::Error| crate::error::io_error_at(path, "read", e);
    let size = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    if size < 8 {
        return Err(bad(format!("not a safetensors file ({size} bytes)")));
    }
    file.read_exact_at(&mut len, 0).map_err(io)?;
    let n = u64::from_le_bytes(len);
    if n > size - 8 || n > MAX_HEADER {
        return Err(bad(format!("not a safetensors file (header length {n})")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).map_err(io)?;
    parse_header(&header, 8 + n, size).map_err(bad)
}

/// The tensors of a header's JSON whose data starts at `data_start` in a file of `size` bytes.
fn parse_header(
    header: &[u8],
    data_start: u64,
    size: u64,
) -> std::result::Result<HashMap<String, TensorPlace>, String> {
    let meta: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("bad safetensors header: {e}"))?;
    let mut out = HashMap::new();
    for (name, info) in meta {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let numbers = |key: &str| -> Option<Vec<u64>> {
            info.get(key)?
                .as_array()?
                .iter()
                .map(|v| v.as_u64())
                .collect()
        };
        let Some(&[b, e]) = numbers("data_offsets").as_deref() else {
            return Err(format!("tensor {name} has no data offsets"));
        };
        let shape = numbers("shape").ok_or_else(|| format!("tensor {name} has no shape"))?;
        if b > e || data_start.checked_add(e).is_none_or(|end| end > size) {
            return Err(format!(
                "tensor {name} points outside the file (truncated?)"
            ));
        }
        let place = TensorPlace {
            dtype: dtype.to_string(),
            shape: shape.into_iter().map(|d| d as usize).collect(),
            offset: data_start + b,
            len: (e - b) as usize,
        };
        out.insert(name, place);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tensors_and_refuses_bad_headers() {
        let dir = std::env::temp_dir().join(format!("kt-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, header: &str, data: usize| {
            let p = dir.join(name);
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend(std::iter::repeat_n(7u8, data));
            std::fs::write(&p, bytes).unwrap();
            p
        };
        let read = |p: &Path| read_header(&File::open(p).unwrap(), p);
        let good = write(
            "good.safetensors",
            r#"{"__metadata__":{"a":"b"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}}"#,
            12,
        );
        let t = read(&good).unwrap();
        assert_eq!(t.len(), 1);
        let w = &t["w"];
        assert_eq!(
            (w.dtype.as_str(), w.shape.as_slice(), w.len),
            ("BF16", &[2, 3][..], 12)
        );
        assert_eq!(
            w.offset,
            8 + std::fs::metadata(&good).unwrap().len() - 8 - 12
        );
        let short = write(
            "short.safetensors",
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            8,
        );
        assert!(read(&short)
            .unwrap_err()
            .to_string()
            .contains("outside the file"));
        let json = write("json.safetensors", "{nope", 0);
        assert!(read(&json)
            .unwrap_err()
            .to_string()
            .contains("bad safetensors header"));
        let offs = write(
            "offs.safetensors",
            r#"{"w":{"dtype":"F32","shape":[1]}}"#,
            4,
        );
        assert!(read(&offs)
            .unwrap_err()
            .to_string()
            .contains("no data offsets"));
        let tiny = dir.join("tiny.safetensors");
        std::fs::write(&tiny, [1u8, 2]).unwrap();
        assert!(read(&tiny)
            .unwrap_err()
            .to_string()
            .contains("not a safetensors file"));
        let huge = dir.join("huge.safetensors");
        std::fs::write(&huge, u64::MAX.to_le_bytes()).unwrap();
        assert!(read(&huge)
            .unwrap_err()
            .to_string()
            .contains("header length"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn header_offsets_that_wrap_around_are_refused() {
        // b <= e, but 8 + header + e overflows u64: must not wrap into "inside the file".
        let dir = std::env::temp_dir().join(format!("kt-wrap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("wrap.safetensors");
        let (b, e) = (u64::MAX - 20, u64::MAX - 10);
        let mut json = format!(r#"{{"x":{{"dtype":"I8","shape":[10],"data_offsets":[{b},{e}]}}}}"#)
            .into_bytes();
        json.resize(json.len().next_multiple_of(8) + 64, b' ');
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        bytes.extend_from_slice(&[0u8; 64]);
        std::fs::write(&path, &bytes).unwrap();
        let err = read_header(&File::open(&path).unwrap(), &path).unwrap_err();
        assert!(err.to_string().contains("outside the file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
