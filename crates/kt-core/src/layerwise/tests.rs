//! The transport's protocol with every rank in this process and host "GPU" buffers.
use super::*;

/// A 64-byte aligned control block.
#[repr(C, align(64))]
struct Block([u8; CONTROL_BYTES]);

fn block() -> Box<Block> {
    let b = Box::new(Block([0xAB; CONTROL_BYTES]));
    let at = b.0.as_ptr() as usize;
    // SAFETY: the box's bytes, used only through the module's atomics afterwards.
    unsafe { initialize_control(at, CONTROL_BYTES, 2).unwrap() };
    b
}

fn at(b: &Block) -> usize {
    b.0.as_ptr() as usize
}

/// One rank's buffers: two host slots and the "GPU" expert array, per kind.
struct RankBuffers {
    slots: [[Vec<u8>; KINDS]; SLOTS],
    gpu: [Vec<u8>; KINDS],
}

const NBYTES: [usize; KINDS] = [96, 8, 64, 4];

fn buffers(experts: usize) -> RankBuffers {
    RankBuffers {
        slots: std::array::from_fn(|_| std::array::from_fn(|k| vec![0u8; NBYTES[k]])),
        gpu: std::array::from_fn(|k| vec![0u8; NBYTES[k] * experts]),
    }
}

fn addr(v: &[u8]) -> usize {
    v.as_ptr() as usize
}

fn config(rank: usize, all: &[RankBuffers], experts: usize, timeout_ms: u64) -> TransportConfig {
    let mine = &all[rank];
    let slot_addrs = |b: &RankBuffers, s: usize| std::array::from_fn(|k| addr(&b.slots[s][k]));
    TransportConfig {
        rank,
        tp_size: all.len(),
        cuda_device: -1,
        local_host: std::array::from_fn(|s| slot_addrs(mine, s)),
        local_gpu: std::array::from_fn(|k| addr(&mine.gpu[k])),
        all_rank_host: if rank == 0 {
            (0..SLOTS)
                .map(|s| all.iter().map(|b| slot_addrs(b, s)).collect())
                .collect()
        } else {
            vec![]
        },
        expert_nbytes: NBYTES,
        num_experts: experts,
        timeout: Duration::from_millis(timeout_ms),
    }
}

/// The byte the writer puts at `i` of kind `k` of expert `e` for rank `r` in layer `l`.
fn pattern(l: i64, e: usize, r: usize, k: usize, i: usize) -> u8 {
    (l as usize * 131 + e * 31 + r * 17 + k * 7 + i) as u8
}

/// Rank zero's writer: fills every rank's slot buffers with `pattern`.
fn writer(layer: i64) -> impl FnMut(usize, &[GpuRankDst]) -> Result<()> {
    move |e, dst| {
        for (r, d) in dst.iter().enumerate() {
            for (k, p) in [d.w13, d.w13_scale, d.w2, d.w2_scale]
                .into_iter()
                .enumerate()
            {
                for i in 0..NBYTES[k] {
                    // SAFETY: the slot buffers of this test hold NBYTES[k] bytes.
                    unsafe { *p.add(i) = pattern(layer, e, r, k, i) };
                }
            }
        }
        Ok(())
    }
}

fn check_gpu(b: &RankBuffers, layer: i64, r: usize, experts: usize) {
    for e in 0..experts {
        for (k, gpu) in b.gpu.iter().enumerate() {
            for i in 0..NBYTES[k] {
                assert_eq!(
                    gpu[e * NBYTES[k] + i],
                    pattern(layer, e, r, k, i),
                    "e{e} r{r} k{k}"
                );
            }
        }
    }
}

#[test]
fn every_rank_receives_every_expert_of_each_layer_in_order() {
    let experts = 7;
    let control = block();
    let bufs = [buffers(experts), buffers(experts)];
    // SAFETY: the block and buffers outlive the transports (dropped at the end of the test).
    let t0 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(0, &bufs, experts, 5000)) }
            .unwrap();
    // SAFETY: as above.
    let t1 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(1, &bufs, experts, 5000)) }
            .unwrap();
    for (epoch, layer, count) in [
        (1u64, 3i64, experts as u64),
        (2, 4, 5),
        (9, 5, experts as u64),
    ] {
        std::thread::scope(|s| {
            let other = s.spawn(|| {
                t1.join(epoch, layer, count).unwrap();
                t1.wait(epoch).unwrap()
            });
            let stats = t0
                .run_batch(epoch, layer, count, &mut writer(layer))
                .unwrap();
            assert_eq!(
                (stats.epoch, stats.layer_id, stats.expert_count),
                (epoch, layer, count)
            );
            assert!(stats.writer_ms > 0.0 && stats.total_ms >= stats.h2d_ms);
            let theirs = other.join().unwrap();
            assert_eq!((theirs.epoch, theirs.layer_id), (epoch, layer));
            assert_eq!(theirs.writer_ms, 0.0, "only rank zero writes");
        });
        for (r, b) in bufs.iter().enumerate() {
            check_gpu(b, layer, r, count as usize);
        }
        assert_eq!(t0.wait(epoch).unwrap().epoch, epoch, "wait may be repeated");
    }
    // Epochs only grow; waiting for an epoch not joined is refused.
    let err = t0
        .run_batch(9, 6, 1, &mut writer(6))
        .unwrap_err()
        .to_string();
    assert!(err.contains("reuse or decrease"), "{err}");
    assert!(t1
        .wait(10)
        .unwrap_err()
        .to_string()
        .contains("before this rank joined"));
    t1.close();
    assert!(
        t1.closed()
            && t1
                .join(10, 1, 1)
                .unwrap_err()
                .to_string()
                .contains("closed")
    );
}

#[test]
fn a_rank_that_never_joins_times_out_and_poisons_the_block() {
    let control = block();
    let bufs = [buffers(3), buffers(3)];
    // SAFETY: as in the test above.
    let t0 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(0, &bufs, 3, 150)) }.unwrap();
    // SAFETY: as above.
    let t1 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(1, &bufs, 3, 150)) }.unwrap();
    let start = Instant::now();
    let err = t0
        .run_batch(1, 0, 3, &mut writer(0))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("timed out after 150 ms") && err.contains("joining"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    // The other rank now fails at once with the poison, naming who and why.
    let err = t1.join(1, 0, 3).unwrap_err().to_string();
    assert!(
        err.contains("poisoned (code=1, rank=0)") && err.contains("joining"),
        "{err}"
    );
}

#[test]
fn inconsistent_joins_and_writer_errors_poison_the_layer() {
    let control = block();
    let bufs = [buffers(4), buffers(4)];
    // SAFETY: as in the first test.
    let t0 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(0, &bufs, 4, 2000)) }.unwrap();
    // SAFETY: as above.
    let t1 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(1, &bufs, 4, 2000)) }.unwrap();
    t1.join(1, 2, 3).unwrap();
    let err = t0
        .run_batch(1, 2, 4, &mut writer(2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("inconsistent layer_id or expert_count"),
        "{err}"
    );
    // Rank 1 reports the mismatch either through rank 0's poison or, when its consumer reads
    // the published epoch before rank 0 has compared the joins, in its own words (seen once
    // in a full `cargo test` on two busy cores): both name the inconsistency.
    let err = t1.wait(1).unwrap_err().to_string();
    assert!(
        err.contains("poisoned (code=4, rank=0)")
            || err.contains("invalid expert_count 4 (joined with 3)"),
        "{err}"
    );

    let control = block();
    // SAFETY: as above.
    let t0 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(0, &bufs, 4, 2000)) }.unwrap();
    // SAFETY: as above.
    let t1 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(1, &bufs, 4, 2000)) }.unwrap();
    t1.join(1, 2, 4).unwrap();
    let mut failing = |e: usize, _: &[GpuRankDst]| -> Result<()> {
        kt_ensure!(e < 2, Runtime, "disk on fire at expert {e}");
        Ok(())
    };
    let err = t0.run_batch(1, 2, 4, &mut failing).unwrap_err().to_string();
    assert!(err.contains("disk on fire at expert 2"), "{err}");
    let err = t1.wait(1).unwrap_err().to_string();
    assert!(
        err.contains("code=2") && err.contains("disk on fire"),
        "{err}"
    );
}

#[test]
fn bad_blocks_and_buffers_are_refused() {
    let control = block();
    let bufs = [buffers(2), buffers(2)];
    let open = |ptr: usize, size: usize, c: TransportConfig| {
        // SAFETY: refused before any memory is touched, or as in the tests above.
        unsafe { Transport::open(ptr, size, c) }
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(open(0, CONTROL_BYTES, config(0, &bufs, 2, 100)).contains("null"));
    assert!(open(at(&control) + 8, CONTROL_BYTES, config(0, &bufs, 2, 100)).contains("64-byte"));
    assert!(open(at(&control), 4096, config(0, &bufs, 2, 100)).contains("at least 8192"));
    let mut c = config(0, &bufs, 2, 100);
    c.tp_size = 3;
    assert!(open(at(&control), CONTROL_BYTES, c).contains("does not match"));
    let mut c = config(1, &bufs, 2, 100);
    c.all_rank_host = config(0, &bufs, 2, 100).all_rank_host;
    assert!(open(at(&control), CONTROL_BYTES, c).contains("empty on other ranks"));
    let mut c = config(0, &bufs, 2, 100);
    c.expert_nbytes[1] = 0;
    assert!(open(at(&control), CONTROL_BYTES, c).contains("non-zero"));
    let mut c = config(0, &bufs, 2, 100);
    c.local_gpu[0] = usize::MAX - 8;
    assert!(open(at(&control), CONTROL_BYTES, c).contains("overflows"));
    let fresh = Box::new(Block([0; CONTROL_BYTES]));
    assert!(open(at(&fresh), CONTROL_BYTES, config(0, &bufs, 2, 100)).contains("uninitialized"));
    // SAFETY: a valid block; refused for its TP size.
    let err = unsafe { initialize_control(at(&fresh), CONTROL_BYTES, 9) }.unwrap_err();
    assert!(err.to_string().contains("1 through 8"));
    // SAFETY: as in the tests above.
    let t1 =
        unsafe { Transport::open(at(&control), CONTROL_BYTES, config(1, &bufs, 2, 100)) }.unwrap();
    assert!(t1
        .run_batch(1, 0, 1, &mut writer(0))
        .unwrap_err()
        .to_string()
        .contains("rank-zero"));
    assert!(t1
        .join(0, 0, 1)
        .unwrap_err()
        .to_string()
        .contains("epoch zero"));
    assert!(t1
        .join(1, -1, 1)
        .unwrap_err()
        .to_string()
        .contains("non-negative"));
    assert!(t1
        .join(1, 0, 3)
        .unwrap_err()
        .to_string()
        .contains("expert range"));
}
