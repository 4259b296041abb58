//! Scratch of forward calls: per NUMA part, the fp32 activations, the SwiGLU rows, the partial
//! output, and the format's prepared copies of x and of the SwiGLU rows with their scales.
use super::{MoeLayer, CHUNK_TOKENS, ROWWISE_DOWN_MAX};
use crate::pack::AlignedBuf;
use crate::routing::Routing;
use crate::sync_ptr::SyncPtr;
use crate::Result;

/// Scratch of forward calls, grown when a layer needs more, shared by the layers that one
/// caller (e.g. the engine thread) runs one after another.
#[derive(Default)]
pub struct Workspace {
    pub(super) routing: Routing,
    parts: Vec<PartScratch>,
    /// Addresses of `parts`' buffers, refreshed by `reserve` (so forward allocates nothing).
    pub(super) ptrs: Vec<PartPtrs>,
}

/// Buffer addresses of one part's scratch (null where a buffer is not needed).
#[derive(Clone, Copy)]
pub(super) struct PartPtrs {
    /// `[tokens][H]` fp32 activations.
    pub x: SyncPtr<f32>,
    /// `[rows][ip]` SwiGLU outputs.
    pub act: SyncPtr<f32>,
    /// `[tokens][H]` partial output of the part.
    pub partial: SyncPtr<f32>,
    /// `[rows][H]` weighted down outputs (row-wise down scheme).
    pub down_rows: SyncPtr<f32>,
    /// `[tokens][x_stride]` prepared x bytes and one scale per token.
    pub x_prep: SyncPtr<u8>,
    pub x_scale: SyncPtr<f32>,
    /// `[rows][act_stride]` prepared SwiGLU bytes and one scale per row.
    pub act_prep: SyncPtr<u8>,
    pub act_scale: SyncPtr<f32>,
}

#[derive(Default)]
struct PartScratch {
    x: Option<AlignedBuf<f32>>,
    act: Option<AlignedBuf<f32>>,
    partial: Option<AlignedBuf<f32>>,
    down_rows: Option<AlignedBuf<f32>>,
    x_prep: Option<AlignedBuf<u8>>,
    x_scale: Option<AlignedBuf<f32>>,
    act_prep: Option<AlignedBuf<u8>>,
    act_scale: Option<AlignedBuf<f32>>,
}

fn grow<T: Copy>(buf: &mut Option<AlignedBuf<T>>, len: usize) -> Result<()> {
    if len > 0 && buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = Some(AlignedBuf::zeroed(len)?);
    }
    Ok(())
}

fn addr<T: Copy>(b: &mut Option<AlignedBuf<T>>) -> SyncPtr<T> {
    SyncPtr::new(b.as_mut().map_or(std::ptr::null_mut(), |b| b.as_mut_ptr()))
}

fn held<T: Copy>(b: &Option<AlignedBuf<T>>) -> usize {
    b.as_ref().map_or(0, |b| b.len() * std::mem::size_of::<T>())
}

impl Workspace {
    /// Empty workspace; [`Workspace::reserve`] sizes it for a layer.
    pub fn new() -> Workspace {
        Workspace::default()
    }

    /// Make room for `layer` (allocates only when the layer needs more than any before).
    pub fn reserve(&mut self, layer: &MoeLayer) -> Result<()> {
        let c = &layer.config;
        let experts = &*layer.experts;
        let ranges = experts.part_ranges();
        let tokens = c.max_tokens.min(CHUNK_TOKENS);
        let rows = tokens * c.top_k;
        if self.parts.len() < ranges.len() {
            self.parts.resize_with(ranges.len(), PartScratch::default);
        }
        for (part, (s, inter)) in self.parts.iter_mut().zip(ranges).enumerate() {
            grow(&mut s.x, tokens * c.hidden)?;
            grow(&mut s.act, rows * inter.len())?;
            grow(&mut s.partial, tokens * c.hidden)?;
            grow(&mut s.down_rows, (rows * c.hidden).min(ROWWISE_DOWN_MAX))?;
            grow(&mut s.x_prep, tokens * experts.x_stride(part))?;
            grow(&mut s.x_scale, tokens)?;
            grow(&mut s.act_prep, rows * experts.act_stride(part))?;
            grow(&mut s.act_scale, rows)?;
        }
        self.ptrs.clear();
        for s in &mut self.parts {
            self.ptrs.push(PartPtrs {
                x: addr(&mut s.x),
                act: addr(&mut s.act),
                partial: addr(&mut s.partial),
                down_rows: addr(&mut s.down_rows),
                x_prep: addr(&mut s.x_prep),
                x_scale: addr(&mut s.x_scale),
                act_prep: addr(&mut s.act_prep),
                act_scale: addr(&mut s.act_scale),
            });
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| {
                held(&p.x)
                    + held(&p.act)
                    + held(&p.partial)
                    + held(&p.down_rows)
                    + held(&p.x_prep)
                    + held(&p.x_scale)
                    + held(&p.act_prep)
                    + held(&p.act_scale)
            })
            .sum()
    }
}
