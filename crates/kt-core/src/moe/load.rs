//! Loading a layer: checks first, then every part packs its slice on its own threads (so the
//! pages live on its NUMA node), one task per (physical expert, projection).
use super::{ExpertSource, MoeLayer, Proj};
use crate::formats::LayerFiles;
use crate::pool::{Pool, Team};
use crate::{kt_ensure, Error, Result};
use std::sync::Mutex;

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
        let ranges = self.part_ranges();
        let experts = &*self.experts;
        let h = c.hidden;
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        pool.run_parts(&|part, team: &Team| {
            let inter = ranges[part].clone();
            // One task per (physical expert, projection): big enough to amortise, many enough
            // to balance.
            team.parallel_for(c.num_experts * 3, &|task| {
                let (slot, proj) = (task / 3, [Proj::Gate, Proj::Up, Proj::Down][task % 3]);
                let result = (|| -> Result<()> {
                    let m = source.matrix(logical[slot], proj)?;
                    let view = match proj {
                        Proj::Gate | Proj::Up => m.sub(inter.start, inter.len(), 0, h)?,
                        Proj::Down => m.sub(0, h, inter.start, inter.len())?,
                    };
                    // SAFETY: this task is the only writer of (part, slot, proj), and the
                    // layer is borrowed mutably, so no forward runs meanwhile.
                    unsafe { experts.pack(part, slot, proj, &view) }
                })();
                if let Err(err) = result {
                    first_error.lock().unwrap().get_or_insert(err);
                }
            });
        })?;
        if let Some(err) = first_error.into_inner().unwrap() {
            return Err(err);
        }
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
