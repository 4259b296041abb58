//! Token → expert grouping for one chunk of tokens.
use crate::dtype::IdType;

/// Rows of one forward chunk grouped by expert: rows of `experts[i]` are
/// `offsets[i]..offsets[i+1]`, in token order. Buffers are reused across calls.
#[derive(Debug, Default, Clone)]
pub struct Routing {
    /// Activated physical experts, ascending.
    pub experts: Vec<u32>,
    /// Row ranges per activated expert (`experts.len() + 1` entries).
    pub offsets: Vec<usize>,
    /// Token (relative to the chunk start) of each row.
    pub row_token: Vec<u32>,
    /// Router weight of each row.
    pub row_weight: Vec<f32>,
    counts: Vec<usize>,
}

/// Expert ids of a chunk, as handed over by the caller.
#[derive(Clone, Copy, Debug)]
pub enum Ids<'a> {
    /// int32 ids.
    I32(&'a [i32]),
    /// int64 ids.
    I64(&'a [i64]),
}

impl Ids<'_> {
    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            Ids::I32(v) => v.len(),
            Ids::I64(v) => v.len(),
        }
    }

    /// True when there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Id `i` widened to i64.
    #[inline(always)]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            Ids::I32(v) => v[i] as i64,
            Ids::I64(v) => v[i],
        }
    }

    /// Element type.
    pub fn id_type(&self) -> IdType {
        match self {
            Ids::I32(_) => IdType::I32,
            Ids::I64(_) => IdType::I64,
        }
    }
}

impl Routing {
    /// Total rows (token, expert) pairs kept.
    pub fn rows(&self) -> usize {
        self.row_token.len()
    }

    /// Group `tokens × top_k` ids. Skipped: ids < 0, ids ≥ `num_experts`, and experts whose
    /// `gpu_mask` byte is non-zero (the GPU computes those).
    pub fn build(
        &mut self,
        ids: Ids<'_>,
        weights: &[f32],
        tokens: usize,
        top_k: usize,
        num_experts: usize,
        gpu_mask: Option<&[u8]>,
    ) {
        assert!(ids.len() >= tokens * top_k && weights.len() >= tokens * top_k);
        let keep = |id: i64| -> Option<usize> {
            if id < 0 || id as u64 >= num_experts as u64 {
                return None;
            }
            let e = id as usize;
            match gpu_mask {
                Some(m) if m[e] != 0 => None,
                _ => Some(e),
            }
        };
        self.counts.clear();
        self.counts.resize(num_experts, 0);
        for i in 0..tokens * top_k {
            if let Some(e) = keep(ids.get(i)) {
                self.counts[e] += 1;
            }
        }
        self.experts.clear();
        self.offsets.clear();
        self.offsets.push(0);
        // Turn counts into write cursors (start offsets) of the activated experts.
        let mut total = 0;
        for e in 0..num_experts {
            let c = self.counts[e];
            if c > 0 {
                self.experts.push(e as u32);
                self.counts[e] = total;
                total += c;
                self.offsets.push(total);
            }
        }
        self.row_token.clear();
        self.row_token.resize(total, 0);
        self.row_weight.clear();
        self.row_weight.resize(total, 0.0);
        for t in 0..tokens {
            for s in 0..top_k {
                let i = t * top_k + s;
                if let Some(e) = keep(ids.get(i)) {
                    let row = self.counts[e];
                    self.counts[e] += 1;
                    self.row_token[row] = t as u32;
                    self.row_weight[row] = weights[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_skips() {
        let ids: Vec<i64> = vec![3, 1, -1, 3, 7, 1, 2, 9];
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mask = [0u8, 0, 1, 0, 0, 0, 0, 0];
        let mut r = Routing::default();
        // 4 tokens × top-2, 8 experts: -1 and 9 (≥ E) dropped, expert 2 on GPU.
        r.build(Ids::I64(&ids), &w, 4, 2, 8, Some(&mask));
        assert_eq!(r.experts, vec![1, 3, 7]);
        assert_eq!(r.offsets, vec![0, 2, 4, 5]);
        assert_eq!(r.row_token, vec![0, 2, 0, 1, 2]);
        assert_eq!(r.row_weight, vec![1.0, 5.0, 0.0, 3.0, 4.0]);
        let ids32: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let mut r2 = Routing::default();
        r2.build(Ids::I32(&ids32), &w, 4, 2, 8, Some(&mask));
        assert_eq!(r2.row_token, r.row_token);
        // Without the mask expert 2 comes back.
        r2.build(Ids::I32(&ids32), &w, 4, 2, 8, None);
        assert_eq!(r2.experts, vec![1, 2, 3, 7]);
    }
}
