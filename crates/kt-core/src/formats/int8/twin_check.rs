//! The twin check every integer group kernel passes (AMXINT8 and AMXINT4 alike): a variant
//! equals its format's scalar twin exactly, and the twin equals plain row-major arithmetic, on
//! random data over the quantizers' whole range and at its extremes.
use crate::kernels::group_dot::{activation_row, GroupDotFn};
use crate::rng::Rng;

/// One integer format under test: how to draw, pack and sum its weights, and its twin.
pub(crate) struct Format {
    pub ks: &'static [usize],
    /// Drawn values (INT8: q in [-127, 127]; INT4: v in [-7, 7]).
    pub draw: fn(&mut Rng) -> i8,
    /// The largest drawn magnitude (127 or 7).
    pub max_draw: i8,
    /// Multiplier from a drawn value to the weight the dot product uses.
    pub weight: i64,
    pub pack: fn(&[i8], usize, usize) -> crate::Result<Vec<u8>>,
    pub sums: fn(&[u8], usize) -> [i32; 32],
    pub twin: GroupDotFn,
}

/// One case's weights and biased activations: `None` draws at random; `Some(±1)` is the
/// format's largest weight of that sign everywhere, `Some(x)` an activation of `x`
/// everywhere (the largest products, where an i16 partial sum could overflow).
const CASES: [(Option<i8>, Option<u8>); 5] = [
    (None, None),
    (Some(1), Some(255)),
    (Some(1), Some(1)),
    (Some(-1), Some(255)),
    (Some(-1), Some(1)),
];

/// `f` equals the format's scalar twin exactly, and the twin equals plain row-major
/// arithmetic, on random data over the quantizers' whole range and at its extremes.
pub(crate) fn check(fmt: &Format, f: GroupDotFn, rows_max: usize, name: &str) {
    // With software prefetching on (it must not change a result).
    crate::kernels::prefetch::set(crate::kernels::prefetch::CANDIDATE);
    let mut rng = Rng::new(99);
    for &k in fmt.ks {
        for case in CASES {
            check_case(fmt, f, rows_max, name, k, case, &mut rng);
        }
    }
}

fn check_case(
    fmt: &Format,
    f: GroupDotFn,
    rows_max: usize,
    name: &str,
    k: usize,
    (weight_sign, act): (Option<i8>, Option<u8>),
    rng: &mut Rng,
) {
    let w: Vec<i8> = (0..32 * k)
        .map(|_| weight_sign.map_or_else(|| (fmt.draw)(rng), |sign| sign * fmt.max_draw))
        .collect();
    let group = (fmt.pack)(&w, 32, k).unwrap();
    let sums = (fmt.sums)(&group, k);
    for rows in 1..=rows_max {
        let a: Vec<Vec<u8>> = (0..rows)
            .map(|_| {
                let biased: Vec<u8> = (0..k)
                    .map(|_| act.unwrap_or_else(|| 1 + rng.below(255) as u8))
                    .collect();
                activation_row(&biased)
            })
            .collect();
        let ptrs: Vec<*const u8> = a.iter().map(|r| r.as_ptr()).collect();
        let mut got = vec![0i32; rows * 32];
        let mut want = vec![0i32; rows * 32];
        // SAFETY: activation rows of the right size, a whole tiled group and its sums,
        // rows·32 outputs; each kernel runs only where its ISA was detected.
        unsafe {
            f(&ptrs, k, group.as_ptr(), sums.as_ptr(), got.as_mut_ptr());
            (fmt.twin)(&ptrs, k, group.as_ptr(), sums.as_ptr(), want.as_mut_ptr());
        }
        assert_eq!(
            got, want,
            "{name} rows={rows} k={k} case {weight_sign:?}/{act:?}"
        );
        // With a side stream set (the warm-group loops of many-row kernels), a real one over
        // the group and an empty one: the same numbers.
        for side_bytes in [group.len(), 0] {
            crate::kernels::prefetch::set_side_stream(group.as_ptr(), side_bytes);
            got.fill(0);
            // SAFETY: as above.
            unsafe { f(&ptrs, k, group.as_ptr(), sums.as_ptr(), got.as_mut_ptr()) };
            crate::kernels::prefetch::take_side_stream();
            assert_eq!(
                got, want,
                "{name} rows={rows} k={k} case {weight_sign:?}/{act:?} side {side_bytes}"
            );
        }
        for r in 0..rows {
            for j in 0..32 {
                let exact: i64 = (0..k)
                    .map(|kk| (a[r][kk] as i64 - 128) * fmt.weight * w[j * k + kk] as i64)
                    .sum();
                assert_eq!(want[r * 32 + j] as i64, exact);
            }
        }
    }
}
