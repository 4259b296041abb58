//! Thread placement through Linux system calls: CPU pinning and the NUMA memory policy of the
//! calling thread, plus the set of CPUs the process may use.
//!
//! This is the only module of the topology layer that contains `unsafe`. It calls the raw
//! system calls rather than the glibc wrappers so that masks of any size work (glibc's
//! `cpu_set_t` stops at 1024 CPUs) and no libnuma is needed. On other operating systems every
//! call reports that it is unsupported.

/// Bits in one word of a kernel CPU or node mask (the kernel uses arrays of `unsigned long`).
#[cfg(target_os = "linux")]
const WORD_BITS: usize = libc::c_ulong::BITS as usize;

/// Largest CPU or node index accepted. The kernel supports at most a few thousand; the cap only
/// keeps a bogus index from turning into a huge mask allocation.
#[cfg(target_os = "linux")]
const MAX_INDEX: u32 = 1 << 20;

/// `MPOL_PREFERRED` from `<linux/mempolicy.h>`: allocate on the given node first, fall back to
/// others when it is full (unlike `MPOL_BIND`, which would fail or swap instead).
#[cfg(target_os = "linux")]
const MPOL_PREFERRED: libc::c_int = 1;

/// Pin the calling thread to one CPU (`sched_setaffinity`).
///
/// `cpu` is the OS index of a logical CPU, as in [`crate::topology::NumaNode::cores`].
/// Returns `Err` with the OS error text when the CPU does not exist, is offline or is outside
/// the process's cgroup/affinity limits.
pub fn pin_current_thread(cpu: u32) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        if cpu >= MAX_INDEX {
            return Err(format!(
                "Cannot pin the thread to CPU {cpu}: the index is beyond the largest supported CPU index {}.",
                MAX_INDEX - 1
            ));
        }
        let mask = single_bit_mask(cpu as usize);
        // SAFETY: SYS_sched_setaffinity(pid, len, mask) only reads `len` bytes from `mask`, and
        // `mask` is a live, initialised buffer of exactly `size_of_val(&mask[..])` bytes. Pid 0
        // means the calling thread, so no other thread is affected.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_setaffinity,
                0 as libc::pid_t,
                std::mem::size_of_val(&mask[..]),
                mask.as_ptr(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!(
                "Cannot pin the thread to CPU {cpu}: {}.",
                std::io::Error::last_os_error()
            ))
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(format!(
            "Cannot pin the thread to CPU {cpu}: CPU pinning is only implemented on Linux."
        ))
    }
}

/// Prefer allocating the calling thread's future pages on NUMA node `node`
/// (`set_mempolicy(MPOL_PREFERRED)`).
///
/// Pages already touched keep their placement; other nodes are still used when `node` is full.
/// Returns `Err` with the OS error text when the node does not exist or has no memory, when the
/// kernel lacks NUMA support (`ENOSYS`) or when a sandbox forbids the call (`EPERM`, e.g. Docker
/// without `CAP_SYS_NICE`). Callers may ignore the error: only locality is lost.
pub fn prefer_node_for_current_thread(node: u32) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        if node >= MAX_INDEX {
            return Err(format!(
                "Cannot prefer NUMA node {node} for memory: the index is beyond the largest supported node index {}.",
                MAX_INDEX - 1
            ));
        }
        let mask = single_bit_mask(node as usize);
        // The kernel reads `maxnode - 1` bits (a long-standing off-by-one that libnuma also
        // compensates for), so pass one more than the number of bits in the mask.
        let maxnode = (mask.len() * WORD_BITS + 1) as libc::c_ulong;
        // SAFETY: SYS_set_mempolicy(mode, nodemask, maxnode) only reads `maxnode - 1` bits from
        // `nodemask`, which is a live, initialised buffer of exactly that many bits. It changes
        // the policy of the calling thread only.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_set_mempolicy,
                MPOL_PREFERRED,
                mask.as_ptr(),
                maxnode,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!(
                "Cannot prefer NUMA node {node} for memory: {}.",
                std::io::Error::last_os_error()
            ))
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(format!(
            "Cannot prefer NUMA node {node} for memory: NUMA memory policy is only implemented on Linux."
        ))
    }
}

/// The CPUs the process may run on (`sched_getaffinity`), sorted ascending.
///
/// Linux keeps one mask per thread; this reads the main thread's mask (pid = process id), which
/// every thread inherits at creation. That way a worker that has already been pinned to one CPU
/// still sees the whole process's CPUs. Falls back to the calling thread's mask if the main
/// thread cannot be queried, and returns an empty list if neither works (or off Linux).
pub fn allowed_cpus() -> Vec<u32> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpid has no preconditions and cannot fail.
        let pid = unsafe { libc::getpid() };
        affinity_of(pid)
            .or_else(|_| affinity_of(0))
            .unwrap_or_default()
    }
    #[cfg(not(target_os = "linux"))]
    {
        Vec::new()
    }
}

/// The CPUs the calling thread may run on (its own `sched_getaffinity` mask), sorted ascending;
/// after [`pin_current_thread`] this is just the pinned CPU. Empty if the query fails.
pub fn current_thread_cpus() -> Vec<u32> {
    #[cfg(target_os = "linux")]
    {
        affinity_of(0).unwrap_or_default()
    }
    #[cfg(not(target_os = "linux"))]
    {
        Vec::new()
    }
}

/// The affinity mask of thread `tid` (0 = the calling thread) as sorted CPU indices.
#[cfg(target_os = "linux")]
fn affinity_of(tid: libc::pid_t) -> Result<Vec<u32>, String> {
    // Start with room for 1024 CPUs (what glibc's cpu_set_t holds) and grow: the kernel answers
    // EINVAL while the buffer is smaller than its own CPU mask.
    let mut words = 1024 / WORD_BITS;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        // SAFETY: SYS_sched_getaffinity(pid, len, mask) writes at most `len` bytes into `mask`,
        // which is a live, writable buffer of exactly `size_of_val(&mask[..])` bytes (a whole
        // number of longs, as the kernel requires). It does not retain the pointer.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getaffinity,
                tid,
                std::mem::size_of_val(&mask[..]),
                mask.as_mut_ptr(),
            )
        };
        if rc >= 0 {
            return Ok(mask_to_indices(&mask));
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) && words * WORD_BITS < MAX_INDEX as usize {
            words *= 2;
            continue;
        }
        return Err(format!(
            "Cannot read the CPU affinity of thread {tid}: {err}."
        ));
    }
}

/// A kernel bit mask (array of longs) just long enough to hold bit `bit`, with only that bit set.
#[cfg(target_os = "linux")]
fn single_bit_mask(bit: usize) -> Vec<libc::c_ulong> {
    let mut mask: Vec<libc::c_ulong> = vec![0; bit / WORD_BITS + 1];
    mask[bit / WORD_BITS] |= 1 << (bit % WORD_BITS);
    mask
}

/// The indices of the set bits of a kernel bit mask, ascending.
#[cfg(target_os = "linux")]
fn mask_to_indices(mask: &[libc::c_ulong]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, &word) in mask.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            let b = rest.trailing_zeros() as usize;
            out.push((w * WORD_BITS + b) as u32);
            rest &= rest - 1;
        }
    }
    out
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's CPU (sched_getcpu).
    fn current_cpu() -> i32 {
        // SAFETY: sched_getcpu has no preconditions.
        unsafe { libc::sched_getcpu() }
    }

    /// The calling thread's memory policy mode and the first word of its node mask.
    fn current_mempolicy() -> (libc::c_int, libc::c_ulong) {
        let mut mode: libc::c_int = -1;
        let mut mask: Vec<libc::c_ulong> = vec![0; 1024 / WORD_BITS];
        // SAFETY: SYS_get_mempolicy(mode*, nodemask*, maxnode, addr, flags) writes one int to
        // `mode` and at most `maxnode - 1` bits into `mask`, which holds that many bits; addr 0
        // and flags 0 ask for the calling thread's policy.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut mode as *mut libc::c_int,
                mask.as_mut_ptr(),
                (mask.len() * WORD_BITS + 1) as libc::c_ulong,
                0usize,
                0usize,
            )
        };
        assert_eq!(rc, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
        (mode, mask[0])
    }

    #[test]
    fn affinity_masks_round_trip() {
        assert_eq!(mask_to_indices(&single_bit_mask(0)), vec![0]);
        assert_eq!(mask_to_indices(&single_bit_mask(63)), vec![63]);
        let m = single_bit_mask(130);
        assert_eq!(m.len(), 130 / WORD_BITS + 1);
        assert_eq!(mask_to_indices(&m), vec![130]);
        assert_eq!(mask_to_indices(&[0b1011, 0]), vec![0, 1, 3]);
        assert_eq!(mask_to_indices(&[0, 1]), vec![WORD_BITS as u32]);
    }

    #[test]
    fn affinity_allowed_cpus_is_sorted_and_contains_current_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        assert!(cpus.windows(2).all(|w| w[0] < w[1]), "{cpus:?}");
        let here = current_cpu();
        assert!(here >= 0);
        assert!(cpus.contains(&(here as u32)), "cpu {here} not in {cpus:?}");
    }

    #[test]
    fn affinity_pin_to_allowed_cpu_in_spawned_thread() {
        let process_cpus = allowed_cpus();
        // The last allowed CPU: on a multi-CPU machine this is a real change of mask.
        let target = *process_cpus.last().unwrap();
        let (thread_mask, cpu_after, seen_by_allowed) = std::thread::spawn(move || {
            pin_current_thread(target).expect("pinning to an allowed CPU");
            (current_thread_cpus(), current_cpu(), allowed_cpus())
        })
        .join()
        .unwrap();
        assert_eq!(thread_mask, vec![target]);
        assert_eq!(cpu_after, target as i32);
        // allowed_cpus reports the process's mask, not the pinned thread's.
        assert_eq!(seen_by_allowed, process_cpus);
        // The test thread itself was not affected.
        assert_eq!(current_thread_cpus(), process_cpus);
    }

    #[test]
    fn affinity_pin_to_missing_cpu_fails() {
        std::thread::spawn(|| {
            let before = current_thread_cpus();
            let err = pin_current_thread(100_000).unwrap_err();
            assert!(err.contains("100000"), "{err}");
            assert!(err.contains("os error"), "{err}");
            let err = pin_current_thread(u32::MAX).unwrap_err();
            assert!(err.contains("beyond"), "{err}");
            // A failed pin leaves the mask alone.
            assert_eq!(current_thread_cpus(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn affinity_prefer_node() {
        std::thread::spawn(|| {
            match prefer_node_for_current_thread(0) {
                Ok(()) => {
                    let (mode, word0) = current_mempolicy();
                    assert_eq!(mode, MPOL_PREFERRED);
                    assert_eq!(word0, 1, "node mask should be exactly node 0");
                }
                // Kernels without NUMA (ENOSYS) or sandboxes (EPERM) refuse; that must be an
                // error with the OS text, not a panic.
                Err(e) => {
                    assert!(e.contains("os error"), "{e}");
                    eprintln!("set_mempolicy unavailable here: {e}");
                }
            }
            let err = prefer_node_for_current_thread(100_000).unwrap_err();
            assert!(err.contains("100000"), "{err}");
            assert!(prefer_node_for_current_thread(u32::MAX).is_err());
        })
        .join()
        .unwrap();
    }
}
