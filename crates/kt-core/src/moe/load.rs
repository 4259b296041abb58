//! Loading a layer: checks first, then every part packs its slice on its own threads (so the
//! pages live on its NUMA node), one task per (physical expert, projection).
use super::{ExpertSource, MoeLayer, Proj};
use crate::converted::{ConvertedLayer, LayerShape};
use crate::error::FirstError;
use crate::formats::LayerFiles;
use crate::gguf::GgufModel;
use crate::pool::{Pool, Team};
use crate::weights::{Checkpoint, HfLayerSource};
use crate::{kt_ensure, Result};
use std::path::Path;

impl MoeLayer {
    /// Pack weights from `source`. Physical slot `p` receives logical expert `map[p]` (identity
    /// when `map` is None). Each part packs its own slice on its own threads.
    pub fn load(
        &mut self,
        pool: &Pool,
        source: &dyn ExpertSource,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = &self.config;
        let l = c.layer_idx;
        kt_ensure!(
            self.experts.packs_from_source(),
            Invalid,
            "layer {l} stores GGUF blocks; load it from a GGUF file (load_gguf)"
        );
        self.check_pool(pool)?;
        let logical = c.logical_experts(map, source.num_experts())?;
        // Check every matrix's shape before touching memory.
        for &e in &logical {
            for (proj, rows, cols) in [
                (Proj::Gate, c.intermediate, c.hidden),
                (Proj::Up, c.intermediate, c.hidden),
                (Proj::Down, c.hidden, c.intermediate),
            ] {
                let m = source.matrix(e, proj)?;
                kt_ensure!(
                    m.rows == rows && m.cols == cols,
                    Invalid,
                    "layer {l}: expert {e} {proj:?} weight is {}x{}, expected {rows}x{cols}",
                    m.rows,
                    m.cols
                );
            }
        }
        if let Some(&first) = logical.first() {
            let (gate, down) = (
                source.matrix(first, Proj::Gate)?,
                source.matrix(first, Proj::Down)?,
            );
            self.experts.adapt_to_source(&self.config, &gate, &down)?;
        }
        let c = &self.config;
        let ranges = self.part_ranges();
        let experts = &*self.experts;
        let h = c.hidden;
        let first_error = FirstError::new();
        pool.run_parts(&|part, team: &Team| {
            let inter = ranges[part].clone();
            // One task per (physical expert, projection): big enough to amortise, many enough
            // to balance.
            team.parallel_for(c.num_experts * 3, &|task| {
                let (slot, proj) = (task / 3, [Proj::Gate, Proj::Up, Proj::Down][task % 3]);
                first_error.record((|| -> Result<()> {
                    let m = source.matrix(logical[slot], proj)?;
                    let view = match proj {
                        Proj::Gate | Proj::Up => m.sub(inter.start, inter.len(), 0, h)?,
                        Proj::Down => m.sub(0, h, inter.start, inter.len())?,
                    };
                    // SAFETY: this task is the only writer of (part, slot, proj), and the
                    // layer is borrowed mutably, so no forward runs meanwhile.
                    unsafe { experts.pack(part, slot, proj, &view) }
                })());
            });
        })?;
        first_error.into_result()?;
        self.loaded = true;
        Ok(())
    }

    /// Read the experts from files the format understands (converted AMX files, GGUF); slot
    /// `p` gets the file's expert `map[p]` (identity when None).
    pub fn load_files(
        &mut self,
        pool: &Pool,
        files: &LayerFiles,
        map: Option<&[i64]>,
    ) -> Result<()> {
        self.check_pool(pool)?;
        self.experts.load_files(pool, &self.config, files, map)?;
        self.loaded = true;
        Ok(())
    }

    /// Read layer `layer_idx`'s experts from a Hugging Face safetensors checkpoint (only the
    /// shards holding the layer, by the index when there is one). The files are unmapped before
    /// returning, so peak memory is about one copy of the layer.
    pub fn load_checkpoint(
        &mut self,
        pool: &Pool,
        path: &Path,
        layer_idx: usize,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = &self.config;
        let tag = format!("layers.{layer_idx}.");
        let ckpt = Checkpoint::open_subset(path, &|n| n.contains(&tag))?;
        // With a map, the checkpoint may hold a different number of logical experts.
        let experts = match map {
            Some(m) => m
                .iter()
                .copied()
                .max()
                .map_or(0, |v| v.max(0) as usize + 1)
                .max(1),
            None => c.num_experts,
        };
        let source = HfLayerSource::new(ckpt, layer_idx, experts, c.hidden, c.intermediate)?;
        self.load(pool, &source, map)
    }

    /// Read layer `layer_idx`'s experts from files the original's converter wrote (merged
    /// safetensors or `_layer_L/_numa_N/*.kt`), converted for this layer's part count.
    pub fn load_converted_path(
        &mut self,
        pool: &Pool,
        path: &Path,
        layer_idx: usize,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let files = ConvertedLayer::open(path, self.converted_shape(layer_idx, map))?;
        self.load_converted(pool, &files, map)
    }

    /// Read this AMXINT8/AMXINT4 layer's converted experts from tensors in memory
    /// (`[proj][part][expert]`, as [`ConvertedLayer::from_addresses`] takes them).
    ///
    /// # Safety
    /// As [`ConvertedLayer::from_addresses`], for the duration of the call.
    pub unsafe fn load_converted_addresses(
        &mut self,
        pool: &Pool,
        addrs: &crate::converted::ConvertedAddresses,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let shape = self.converted_shape(self.config.layer_idx, map);
        // SAFETY: forwarded.
        let files = unsafe { ConvertedLayer::from_addresses(shape, addrs)? };
        self.load_converted(pool, &files, map)
    }

    /// What converted files of layer `layer_idx` must hold for this layer and `map`.
    fn converted_shape(&self, layer_idx: usize, map: Option<&[i64]>) -> LayerShape {
        let c = &self.config;
        LayerShape {
            layer: layer_idx,
            // With a map, the files must hold every expert it names.
            experts: match map {
                Some(m) => m.iter().copied().max().map_or(1, |v| v.max(0) as usize + 1),
                None => c.num_experts,
            },
            hidden: c.hidden,
            intermediate: c.intermediate,
            parts: self.experts.part_ranges().len(),
            method: self.method(),
        }
    }

    /// Read layer `layer_idx`'s experts from a GGUF file or a folder of GGUF shards.
    pub fn load_gguf_path(
        &mut self,
        pool: &Pool,
        path: &Path,
        layer_idx: usize,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let model = GgufModel::open(path)?;
        self.load_gguf(pool, &model, layer_idx, map)
    }

    /// The pool must have one sub-pool per part.
    pub(super) fn check_pool(&self, pool: &Pool) -> Result<()> {
        let parts = self.experts.part_ranges().len();
        kt_ensure!(
            pool.parts() == parts,
            Invalid,
            "layer {} was built for {parts} NUMA parts but the pool has {}",
            self.config.layer_idx,
            pool.parts()
        );
        Ok(())
    }
}
