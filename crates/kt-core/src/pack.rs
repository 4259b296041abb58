//! The packed weight layout the kernels read, and the buffers that hold it.
//!
//! A projection `W[n][k]` (n outputs, k inputs) is stored as panels of [`PANEL`] = 32 outputs.
//! Inside a panel, for each pair of inputs `(2q, 2q+1)` come 64 bf16 values:
//! `half h ∈ {0,1}`, `lane j ∈ 0..16`, `t ∈ {0,1}` at `h*32 + j*2 + t` = `W[32p + 16h + j][2q + t]`.
//! One 64-byte load therefore holds 16 outputs × 2 inputs: a shift gives the fp32 weights of input
//! `2q`, a mask those of `2q+1` (fp32 FMA path), and the pairs are exactly what `vdpbf16ps`
//! consumes (AVX512-BF16 path). Decode streams panels front to back; prefill reuses a panel from
//! cache across a block of token rows.
use crate::dtype::{f32_to_bf16_bits, FloatType};
use crate::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Outputs per panel.
pub const PANEL: usize = 32;
const _: () = assert!(
    PANEL == crate::lines::ROWS,
    "the line transposes assume 32-row panels"
);

/// Elements (bf16) of one packed panel with `k` inputs.
pub const fn panel_len(k: usize) -> usize {
    PANEL * k
}

/// Index of `W[n][kk]` inside the packed matrix with `k` inputs.
#[inline(always)]
pub fn packed_index(n: usize, kk: usize, k: usize) -> usize {
    let (p, r) = (n / PANEL, n % PANEL);
    let (h, j) = (r / 16, r % 16);
    p * panel_len(k) + (kk / 2) * 64 + h * 32 + j * 2 + (kk % 2)
}

/// A 64-byte aligned, zero-initialised buffer that never moves.
///
/// Large buffers are anonymous memory maps: the kernel hands out zero pages lazily, so the first
/// thread that writes a page decides its NUMA node (the allocator's `alloc_zeroed` would memset
/// everything on the allocating thread instead), and they are 2 MiB aligned and marked for
/// transparent huge pages so streaming kernels see few TLB misses.
pub struct AlignedBuf<T: Copy> {
    ptr: *mut T,
    len: usize,
    map: Option<(usize, usize)>,
}

// SAFETY: AlignedBuf owns its allocation like a Vec<T>.
unsafe impl<T: Copy + Send> Send for AlignedBuf<T> {}
// SAFETY: shared access only hands out &[T].
unsafe impl<T: Copy + Sync> Sync for AlignedBuf<T> {}

const HUGE: usize = 2 << 20;
const MAP_THRESHOLD: usize = 1 << 20;

impl<T: Copy> AlignedBuf<T> {
    const ALIGN: usize = 64;

    /// Allocate `len` zeroed elements (T must be valid when all bits are zero: plain numbers).
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(AlignedBuf {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
                map: None,
            });
        }
        let layout = Self::layout(len)?;
        if layout.size() >= MAP_THRESHOLD {
            return Self::mapped(len, layout.size(), true);
        }
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) } as *mut T;
        if ptr.is_null() {
            return Err(Error::Runtime(format!(
                "out of memory allocating {} bytes",
                layout.size()
            )));
        }
        Ok(AlignedBuf {
            ptr,
            len,
            map: None,
        })
    }

    /// [`AlignedBuf::zeroed`] as a memory map without the huge-page advice: the pages the
    /// system gives a plain allocation (4 KiB unless transparent huge pages are "always").
    /// For measuring what code without the advice sees (the reference yardstick).
    pub fn zeroed_default_pages(len: usize) -> Result<Self> {
        let layout = Self::layout(len.max(1))?;
        Self::mapped(len.max(1), layout.size(), false)
    }

    fn mapped(len: usize, bytes: usize, huge_pages: bool) -> Result<Self> {
        let map_len = bytes + HUGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Runtime(format!(
                "out of memory mapping {bytes} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let aligned = (base as usize).div_ceil(HUGE) * HUGE;
        if huge_pages {
            // SAFETY: [aligned, aligned+bytes) lies inside the mapping; the advice is a hint.
            unsafe { libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
        }
        Ok(AlignedBuf {
            ptr: aligned as *mut T,
            len,
            map: Some((base as usize, map_len)),
        })
    }

    fn layout(len: usize) -> Result<Layout> {
        len.checked_mul(std::mem::size_of::<T>())
            .and_then(|bytes| Layout::from_size_align(bytes, Self::ALIGN).ok())
            .ok_or_else(|| Error::Invalid(format!("buffer of {len} elements is too large")))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Read-only view.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised (zeroed) elements.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Mutable view.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Raw pointer for parallel writers that each own a disjoint range.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// Raw pointer for reading.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }
}

impl<T: Copy> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        match self.map {
            // SAFETY: exactly the mapping created in `mapped`.
            Some((base, len)) => unsafe {
                libc::munmap(base as *mut libc::c_void, len);
            },
            None => {
                let layout = Self::layout(self.len).expect("layout was valid at allocation");
                // SAFETY: allocated with the same layout in `zeroed`.
                unsafe { dealloc(self.ptr as *mut u8, layout) };
            }
        }
    }
}

/// A read-only 2-D view of a row-major matrix of floats somewhere in memory (a tensor, an mmap).
#[derive(Clone, Copy, Debug)]
pub struct MatrixView {
    /// Address of element [0][0].
    pub ptr: *const u8,
    /// Element type.
    pub dtype: FloatType,
    /// Rows (outputs).
    pub rows: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// Distance between rows, in elements.
    pub row_stride: usize,
    /// Per-block scales that multiply the stored values (block-quantized FP8 checkpoints).
    pub block_scale: Option<BlockScale>,
    /// Group-scaled codes (MXFP8, MXFP4, NVFP4, RAWINT4, GPTQ checkpoints): when present the
    /// values are read through it, and `ptr`/`dtype`/`row_stride` describe nothing.
    pub coded: Option<crate::codes::CodedMatrix>,
}

/// Block scales of a block-quantized matrix: the value at absolute `[r][c]` is the stored value
/// times `scales[(r / block_rows) * cols + c / block_cols]` (DeepSeek-V3 FP8 `weight_scale_inv`:
/// 128 × 128 blocks; per-channel FP8 `weight_scale`: 1 × K, one column).
#[derive(Clone, Copy, Debug)]
pub struct BlockScale {
    /// Row-major `[ceil(rows/block_rows)][cols]` f32 scales (unaligned reads).
    pub scales: *const u8,
    /// Scale columns.
    pub cols: usize,
    /// Rows of one block.
    pub block_rows: usize,
    /// Columns of one block.
    pub block_cols: usize,
    /// Absolute position of this view's `[0][0]` in the scaled matrix (sub-views move it).
    pub row0: usize,
    /// See `row0`.
    pub col0: usize,
}

impl BlockScale {
    /// The scale of absolute element `[r][c]` of the view.
    ///
    /// # Safety
    /// The scale memory is alive and covers the block.
    #[inline(always)]
    unsafe fn at(&self, r: usize, c: usize) -> f32 {
        let i = ((self.row0 + r) / self.block_rows) * self.cols + (self.col0 + c) / self.block_cols;
        // SAFETY: the contract above.
        unsafe { (self.scales as *const f32).add(i).read_unaligned() }
    }
}

// SAFETY: a view is plain data; whoever builds one promises the memory outlives its use.
unsafe impl Send for MatrixView {}
// SAFETY: as above, read-only.
unsafe impl Sync for MatrixView {}

impl MatrixView {
    /// A 0 × 0 view of nothing (a placeholder to overwrite).
    pub fn empty() -> Self {
        MatrixView {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            dtype: FloatType::F32,
            rows: 0,
            cols: 0,
            row_stride: 0,
            block_scale: None,
            coded: None,
        }
    }

    /// A contiguous view from a byte slice, checked for size.
    pub fn from_bytes(bytes: &[u8], dtype: FloatType, rows: usize, cols: usize) -> Result<Self> {
        let need = rows * cols * dtype.size();
        if bytes.len() != need {
            return Err(Error::Invalid(format!(
                "matrix of {rows}x{cols} {} needs {need} bytes, got {}",
                dtype.name(),
                bytes.len()
            )));
        }
        Ok(MatrixView {
            ptr: bytes.as_ptr(),
            dtype,
            rows,
            cols,
            row_stride: cols,
            block_scale: None,
            coded: None,
        })
    }

    /// Rows `[r0, r0+nr)` and columns `[c0, c0+nc)`.
    pub fn sub(&self, r0: usize, nr: usize, c0: usize, nc: usize) -> Result<Self> {
        if r0 + nr > self.rows || c0 + nc > self.cols {
            return Err(Error::Invalid(format!(
                "sub-matrix rows {r0}..{} cols {c0}..{} outside {}x{}",
                r0 + nr,
                c0 + nc,
                self.rows,
                self.cols
            )));
        }
        Ok(MatrixView {
            // Coded views keep their position in `coded`; `ptr` only moves along (unused).
            ptr: self
                .ptr
                .wrapping_add((r0 * self.row_stride + c0) * self.dtype.size()),
            rows: nr,
            cols: nc,
            block_scale: self.block_scale.map(|b| BlockScale {
                row0: b.row0 + r0,
                col0: b.col0 + c0,
                ..b
            }),
            coded: self.coded.map(|m| crate::codes::CodedMatrix {
                row0: m.row0 + r0,
                col0: m.col0 + c0,
                ..m
            }),
            ..*self
        })
    }

    /// The block scale of element `[r][c]` of a block-scaled view (None without scales).
    ///
    /// # Safety
    /// The view's scale memory must still be alive; r < rows, c < cols.
    pub unsafe fn block_scale_at(&self, r: usize, c: usize) -> Option<f32> {
        // SAFETY: forwarded; the scales cover every element of the view.
        self.block_scale.map(|b| unsafe { b.at(r, c) })
    }

    /// Element [r][c] as f32.
    ///
    /// # Safety
    /// The view's memory must still be alive; r < rows, c < cols.
    #[inline(always)]
    pub unsafe fn get(&self, r: usize, c: usize) -> f32 {
        if let Some(m) = &self.coded {
            // SAFETY: forwarded.
            return unsafe { m.value(r, c) };
        }
        // SAFETY: forwarded.
        unsafe {
            let v = crate::dtype::load_f32(self.ptr, self.dtype, r * self.row_stride + c);
            match &self.block_scale {
                Some(b) => v * b.at(r, c),
                None => v,
            }
        }
    }

    /// Row `r` as f32 (block scales applied) into `dst` (`cols` values).
    ///
    /// # Safety
    /// The view's memory must still be alive; r < rows; `dst.len() == cols`.
    #[inline(always)]
    pub unsafe fn row_f32(&self, r: usize, dst: &mut [f32]) {
        if let Some(m) = &self.coded {
            for (c, d) in dst.iter_mut().enumerate() {
                // SAFETY: forwarded (c < cols).
                *d = unsafe { m.value(r, c) };
            }
            return;
        }
        // SAFETY: forwarded.
        unsafe {
            crate::dtype::row_to_f32(
                self.ptr.add(r * self.row_stride * self.dtype.size()),
                self.dtype,
                dst,
            );
            if let Some(b) = &self.block_scale {
                for (c, d) in dst.iter_mut().enumerate() {
                    *d *= b.at(r, c);
                }
            }
        }
    }
}

/// Pack panel `p` of `src` (rows = outputs, cols = inputs) into `dst` (`panel_len(cols)` elements).
///
/// # Safety
/// `src`'s memory must be alive; `src.rows % PANEL == 0`, `src.cols % 2 == 0`, `p < rows/PANEL`.
pub unsafe fn pack_panel(src: &MatrixView, p: usize, dst: &mut [u16]) {
    let k = src.cols;
    debug_assert_eq!(dst.len(), panel_len(k));
    if src.dtype == FloatType::BF16 && src.block_scale.is_none() && src.coded.is_none() {
        // bf16 rows are the panel's values already: each line holds an input pair (4 bytes)
        // of every row, so the panel is the rows transposed a pair at a time, bit for bit.
        let row_bytes = src.row_stride * 2;
        // SAFETY: rows p·32.. of the live view, k values each (the contract); dst holds the
        // panel's k/2 lines.
        unsafe {
            crate::lines::rows_to_lines(
                src.ptr.add(p * PANEL * row_bytes),
                row_bytes,
                k / 2,
                4,
                dst.as_mut_ptr() as *mut u8,
            )
        };
        return;
    }
    for r in 0..PANEL {
        let (h, j) = (r / 16, r % 16);
        let n = p * PANEL + r;
        for kk in 0..k {
            // SAFETY: n < rows and kk < cols by the contract.
            let v = unsafe { src.get(n, kk) };
            dst[(kk / 2) * 64 + h * 32 + j * 2 + (kk % 2)] = f32_to_bf16_bits(v);
        }
    }
}

/// Pack a whole matrix (test and tool helper; layers pack panel by panel in parallel).
pub fn pack_matrix(src: &MatrixView) -> Result<Vec<u16>> {
    if !src.rows.is_multiple_of(PANEL) || !src.cols.is_multiple_of(2) {
        return Err(Error::Invalid(format!(
            "cannot pack a {}x{} matrix: rows must be a multiple of {PANEL} and columns even",
            src.rows, src.cols
        )));
    }
    let pl = panel_len(src.cols);
    let mut out = vec![0u16; src.rows * src.cols];
    for (p, chunk) in out.chunks_mut(pl).enumerate() {
        // SAFETY: shape checked above; the view is alive for this call.
        unsafe { pack_panel(src, p, chunk) };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_index_matches_pack_panel() {
        let (n, k) = (64usize, 6usize);
        let data: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = MatrixView::from_bytes(&bytes, FloatType::F32, n, k).unwrap();
        let packed = pack_matrix(&view).unwrap();
        for r in 0..n {
            for c in 0..k {
                let got = crate::dtype::bf16_bits_to_f32(packed[packed_index(r, c, k)]);
                assert_eq!(
                    got,
                    crate::dtype::bf16_bits_to_f32(f32_to_bf16_bits(data[r * k + c]))
                );
            }
        }
        // Every slot written exactly once: the index map is a bijection.
        let mut seen = vec![false; n * k];
        for r in 0..n {
            for c in 0..k {
                let i = packed_index(r, c, k);
                assert!(!seen[i]);
                seen[i] = true;
            }
        }
    }

    #[test]
    fn sub_views_and_bad_shapes() {
        let bytes = vec![0u8; 32 * 4 * 2];
        let v = MatrixView::from_bytes(&bytes, FloatType::BF16, 32, 4).unwrap();
        assert!(v.sub(0, 32, 2, 2).is_ok());
        assert!(v.sub(0, 33, 0, 4).is_err());
        assert!(MatrixView::from_bytes(&bytes, FloatType::F32, 32, 4).is_err());
        let odd = MatrixView::from_bytes(&bytes[..32 * 3 * 2], FloatType::BF16, 32, 3).unwrap();
        assert!(pack_matrix(&odd).is_err());
        for n in [1000usize, 3 << 20] {
            let mut buf = AlignedBuf::<u16>::zeroed(n).unwrap();
            assert_eq!(buf.as_ptr() as usize % 64, 0);
            assert!(buf.as_slice().iter().all(|&x| x == 0));
            buf.as_mut_slice()[n - 1] = 7;
            assert_eq!(buf.as_slice()[n - 1], 7);
        }
    }
}
