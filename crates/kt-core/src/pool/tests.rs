use super::*;
use crate::topology::Topology;
use std::sync::atomic::{AtomicU64, Ordering};

fn unpinned(threads: usize, parts: usize) -> Pool {
    let mut cfg = PoolConfig::split(threads, parts, None).unwrap();
    cfg.pin = false;
    Pool::new(cfg).unwrap()
}

#[test]
fn split_matches_the_original() {
    let c = PoolConfig::split(7, 3, None).unwrap();
    assert_eq!(c.threads, vec![3, 2, 2]);
    assert_eq!(c.numa_nodes, vec![0, 1, 2]);
    assert!(PoolConfig::split(1, 2, None).is_err());
    assert!(PoolConfig::split(4, 2, Some(&[1])).is_err());
    assert_eq!(
        PoolConfig::split(4, 2, Some(&[1, 1])).unwrap().numa_nodes,
        vec![1, 1]
    );
}

#[test]
fn parallel_for_runs_every_task_once() {
    for (threads, parts) in [(1, 1), (2, 1), (3, 1), (4, 2), (3, 3)] {
        let pool = unpinned(threads, parts);
        for n in [0usize, 1, 2, 5, 1000] {
            let hits: Vec<AtomicU64> = (0..n * parts).map(|_| AtomicU64::new(0)).collect();
            pool.run_parts(&|part, team| {
                assert_eq!(team.index(), part);
                team.parallel_for(n, &|i| {
                    hits[part * n + i].fetch_add(1, Ordering::SeqCst);
                });
            })
            .unwrap();
            assert!(
                hits.iter().all(|h| h.load(Ordering::SeqCst) == 1),
                "threads={threads} parts={parts} n={n}"
            );
            let all: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.parallel_for_all(n, &|i| {
                all[i].fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            assert!(all.iter().all(|h| h.load(Ordering::SeqCst) == 1));
        }
    }
}

#[test]
fn many_back_to_back_jobs_do_not_lose_wakeups() {
    let pool = unpinned(3, 2);
    let total = AtomicU64::new(0);
    for round in 0..3000u64 {
        pool.run_parts(&|_, team| {
            team.parallel_for((round % 7) as usize + 1, &|i| {
                total.fetch_add(i as u64 + 1, Ordering::SeqCst);
            });
        })
        .unwrap();
    }
    let want: u64 = (0..3000u64)
        .map(|r| {
            let n = r % 7 + 1;
            n * (n + 1) / 2
        })
        .sum::<u64>()
        * 2;
    assert_eq!(total.load(Ordering::SeqCst), want);
}

#[test]
fn panics_come_back_to_the_caller_and_the_pool_survives() {
    let pool = unpinned(2, 2);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run_parts(&|part, team| {
            team.parallel_for(10, &|i| {
                if part == 1 && i == 7 {
                    panic!("task 7 failed");
                }
            })
        })
    }));
    assert!(r.is_err());
    let n = AtomicU64::new(0);
    pool.parallel_for_all(50, &|_| {
        n.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    assert_eq!(n.load(Ordering::SeqCst), 50);
}

fn process_cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage writes a full rusage struct.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

#[test]
fn idle_workers_park() {
    let pool = unpinned(2, 2);
    pool.parallel_for_all(100, &|_| std::hint::black_box(()))
        .unwrap();
    // Let the post-job spin run out, then measure: idle threads must not burn CPU. Other tests
    // run concurrently in this process, so only a gross spin (≥ 1 core busy) is detectable.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = process_cpu_seconds();
    let t0 = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let used = process_cpu_seconds() - before;
    let wall = t0.elapsed().as_secs_f64();
    assert!(
        used < 0.5 * wall,
        "idle pool used {used:.3}s CPU in {wall:.3}s"
    );
    drop(pool);
}

#[test]
fn pinning_plan_on_a_synthetic_two_node_machine() {
    let Ok(topo) = Topology::synthetic("numa:2 core:2 pu:1") else {
        eprintln!("hwloc synthetic topologies unavailable; skipped");
        return;
    };
    // 4 threads over 2 sub-pools on nodes 0 and 1: each sub-pool gets its node's two cores.
    let cfg = PoolConfig {
        pin: false,
        ..PoolConfig::split(4, 2, None).unwrap()
    };
    let pool = Pool::with_topology(cfg, &topo).unwrap();
    let node_cpus =
        |n: u32| -> Vec<u32> { topo.node(n).unwrap().cores.iter().map(|c| c[0]).collect() };
    let plan = pool.pinning();
    assert_eq!(
        plan[0].iter().map(|c| c.unwrap()).collect::<Vec<_>>(),
        node_cpus(0)
    );
    assert_eq!(
        plan[1].iter().map(|c| c.unwrap()).collect::<Vec<_>>(),
        node_cpus(1)
    );
    assert_eq!(
        pool.caller_cpu(),
        None,
        "pin=false must not plan a caller CPU"
    );
}
