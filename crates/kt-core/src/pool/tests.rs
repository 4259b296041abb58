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
fn sized_jobs_run_every_task_once_and_small_ones_on_the_leader() {
    let pool = unpinned(3, 1);
    for values in [0, INLINE_VALUES, INLINE_VALUES + 1] {
        for n in [0usize, 1, 7, 200] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            let others = AtomicU64::new(0);
            pool.run_parts(&|_, team| {
                let leader = std::thread::current().id();
                team.parallel_for_sized(n, values, &|i| {
                    hits[i].fetch_add(1, Ordering::SeqCst);
                    if std::thread::current().id() != leader {
                        others.fetch_add(1, Ordering::SeqCst);
                    }
                });
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1), "n={n}");
            if values <= INLINE_VALUES {
                assert_eq!(others.load(Ordering::SeqCst), 0, "n={n}: the leader alone");
            }
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

/// CPU seconds used so far by the given threads of this process (utime + stime).
fn threads_cpu_seconds(tids: &[i64]) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    tids.iter()
        .map(|tid| {
            let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
            // Fields after the ")" that closes the thread name: utime and stime are 12th/13th.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / hz
        })
        .sum()
}

#[test]
fn idle_workers_park() {
    let pool = unpinned(3, 2);
    let tids = pool.thread_ids();
    assert_eq!(
        tids.len(),
        2,
        "sub-pool 0 has one helper, sub-pool 1 a leader"
    );
    pool.parallel_for_all(100, &|_| std::hint::black_box(()))
        .unwrap();
    // Let the post-job spin run out, then measure only this pool's threads (other tests run
    // concurrently in this process): a spinning worker would use ~0.5 s of CPU here.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = threads_cpu_seconds(&tids);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let used = threads_cpu_seconds(&tids) - before;
    assert!(used < 0.05, "idle pool threads used {used:.3}s CPU in 0.5s");
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

/// Tasks go out in guided runs: neighbouring tasks mostly run on one thread (so a thread
/// streams consecutive panels in address order), yet a slow thread does not hold the rest.
#[test]
fn parallel_for_hands_out_runs_of_neighbouring_tasks() {
    let pool = unpinned(2, 1);
    let n = 1000;
    let owner: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(u64::MAX)).collect();
    pool.run_parts(&|_, team| {
        team.parallel_for(n, &|i| {
            // Which thread ran task i (a small per-thread id from the thread's address).
            let me = std::thread::current().id();
            let id = format!("{me:?}");
            let hash = id
                .bytes()
                .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            owner[i].store(hash, Ordering::SeqCst);
            // Every task takes a while (both threads stay busy); the early ones are slower, so
            // a fixed split would leave one thread idle.
            let micros = if i < 50 { 200 } else { 20 };
            std::thread::sleep(std::time::Duration::from_micros(micros));
        });
    })
    .unwrap();
    let owners: Vec<u64> = owner.iter().map(|o| o.load(Ordering::SeqCst)).collect();
    assert!(owners.iter().all(|&o| o != u64::MAX));
    let switches = owners.windows(2).filter(|w| w[0] != w[1]).count();
    // Guided runs halve each time: about 2·log2(n) runs in all; one at a time gives ~n/2.
    assert!(
        switches < 60,
        "{switches} switches between neighbouring tasks"
    );
}
