//! `model.safetensors.index.json`: which shard file holds which tensor.
//!
//! A large MoE model's index names every tensor of every layer (about 6 MB for a 48-layer
//! Qwen3-MoE, more for DeepSeek-V3), and loading each layer consults it, twice for converted
//! weights. Parsing it takes tens of milliseconds, reading and fingerprinting it about one; so
//! each load reads it and parses it only when its bytes differ from the kept parse's.
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The index's file name inside a checkpoint folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Folders whose parsed index is kept (a process loads one model, maybe a draft model too).
const CACHED_FOLDERS: usize = 4;

/// The weight map of one index: tensor name → shard file name.
#[derive(Debug)]
pub struct ShardIndex {
    files: Vec<String>,
    /// Sorted by name: a layer's tensors (one name prefix) are one range.
    tensors: Vec<(String, u32)>,
}

struct Cached {
    folder: PathBuf,
    /// Length and fingerprint of the parsed bytes.
    version: (usize, u64),
    index: Arc<ShardIndex>,
}

static CACHE: Mutex<Vec<Cached>> = Mutex::new(Vec::new());

impl ShardIndex {
    /// The index of `folder`, or `None` when it has none or it is unreadable or not an index
    /// (callers then consider every shard, as without an index).
    pub fn of(folder: &Path) -> Option<Arc<ShardIndex>> {
        let path = folder.join(INDEX_FILE);
        std::fs::metadata(&path).ok().filter(|m| m.is_file())?;
        let text = std::fs::read(&path).ok()?;
        let version = (text.len(), crate::file_stamp::fingerprint(&text));
        {
            let cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = cache
                .iter()
                .find(|c| c.folder == folder && c.version == version)
            {
                return Some(c.index.clone());
            }
        }
        let index = Arc::new(Self::parse(&text)?);
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        cache.retain(|c| c.folder != folder);
        if cache.len() >= CACHED_FOLDERS {
            cache.remove(0);
        }
        cache.push(Cached {
            folder: folder.to_path_buf(),
            version,
            index: index.clone(),
        });
        Some(index)
    }

    /// Parse an index's JSON text; `None` unless it has a `weight_map` object.
    pub fn parse(text: &[u8]) -> Option<ShardIndex> {
        let value: serde_json::Value = serde_json::from_slice(text).ok()?;
        let map = value.get("weight_map")?.as_object()?;
        let mut files: Vec<String> = Vec::new();
        let mut ids: HashMap<&str, u32> = HashMap::new();
        let mut tensors = Vec::with_capacity(map.len());
        for (name, file) in map {
            let Some(file) = file.as_str() else { continue };
            let id = *ids.entry(file).or_insert_with(|| {
                files.push(file.to_owned());
                (files.len() - 1) as u32
            });
            tensors.push((name.clone(), id));
        }
        tensors.sort_unstable();
        Some(ShardIndex { files, tensors })
    }

    /// The shard file names that hold a tensor whose name passes `wanted`.
    pub fn shards(&self, wanted: &dyn Fn(&str) -> bool) -> HashSet<&str> {
        self.files_of(self.tensors.iter().filter(|(name, _)| wanted(name)))
    }

    /// The shard file names that hold a tensor whose name starts with `prefix` (a binary search,
    /// not a pass over every tensor of the model).
    pub fn shards_with_prefix(&self, prefix: &str) -> HashSet<&str> {
        let start = self.tensors.partition_point(|(n, _)| n.as_str() < prefix);
        let len = self.tensors[start..].partition_point(|(n, _)| n.starts_with(prefix));
        self.files_of(self.tensors[start..start + len].iter())
    }

    fn files_of<'a>(&self, tensors: impl Iterator<Item = &'a (String, u32)>) -> HashSet<&str> {
        let mut seen = vec![false; self.files.len()];
        for &(_, id) in tensors {
            seen[id as usize] = true;
        }
        self.files
            .iter()
            .zip(seen)
            .filter(|(_, s)| *s)
            .map(|(f, _)| f.as_str())
            .collect()
    }

    /// The shard file name that holds `tensor`, if the index lists it.
    pub fn file_of(&self, tensor: &str) -> Option<&str> {
        let at = self
            .tensors
            .binary_search_by(|(n, _)| n.as_str().cmp(tensor))
            .ok()?;
        Some(self.files[self.tensors[at].1 as usize].as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"{"metadata": {"total_size": 0}, "weight_map": {
        "a.0": "one.safetensors", "a.1": "two.safetensors", "b.0": "one.safetensors",
        "c.0": "three.safetensors"}}"#;

    #[test]
    fn maps_tensors_to_shards() {
        let ix = ShardIndex::parse(TEXT.as_bytes()).unwrap();
        assert_eq!(ix.file_of("a.1"), Some("two.safetensors"));
        assert_eq!(ix.file_of("d.0"), None);
        let want_a = ix.shards(&|n| n.starts_with("a."));
        assert_eq!(
            want_a,
            HashSet::from(["one.safetensors", "two.safetensors"])
        );
        assert!(ix.shards(&|n| n.starts_with("z")).is_empty());
        assert_eq!(ix.shards_with_prefix("a."), want_a);
        assert_eq!(
            ix.shards_with_prefix("b"),
            HashSet::from(["one.safetensors"])
        );
        assert!(ix.shards_with_prefix("a.2").is_empty());
        assert!(ix.shards_with_prefix("zz").is_empty());
    }

    #[test]
    fn not_an_index_is_none() {
        assert!(ShardIndex::parse(b"{\"weight_map\": 3}").is_none());
        assert!(ShardIndex::parse(b"not json").is_none());
        assert!(ShardIndex::parse(b"{}").is_none());
    }

    #[test]
    fn reread_when_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("kt-shard-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(INDEX_FILE), TEXT).unwrap();
        let first = ShardIndex::of(&dir).unwrap();
        assert!(Arc::ptr_eq(&first, &ShardIndex::of(&dir).unwrap()));
        // Rewritten at the same size with the old modification time: still a new version.
        let mtime = std::fs::metadata(dir.join(INDEX_FILE))
            .unwrap()
            .modified()
            .unwrap();
        std::fs::write(dir.join(INDEX_FILE), TEXT.replace("two.", "six.")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(dir.join(INDEX_FILE))
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let second = ShardIndex::of(&dir).unwrap();
        assert_eq!(second.file_of("a.1"), Some("six.safetensors"));
        assert_eq!(second.file_of("a.0"), Some("one.safetensors"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(ShardIndex::of(&dir).is_none());
    }
}
