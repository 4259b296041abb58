//! NUMA topology of the machine (nodes and their physical cores) and the plan that maps the
//! worker threads of each sub-pool onto CPUs.
//!
//! Detection tries, in order: the system hwloc (feature `hwloc`), Linux sysfs
//! (`/sys/devices/system/node` and `/sys/devices/system/cpu/cpu*/topology`), and finally one node
//! holding every allowed CPU as its own core. Only CPUs in the process's affinity mask
//! ([`crate::affinity::allowed_cpus`]) are kept, so `taskset`/cgroup limits are respected.
//! Applying a plan (pinning, memory policy) is done with [`crate::affinity`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

/// One NUMA node: its OS index and its physical cores (each core = the OS PU indices of its
/// hyperthreads, first = preferred CPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// The node number the OS uses (`/sys/devices/system/node/node<N>`, `numactl -N <N>`).
    pub os_index: u32,
    /// Physical cores in hwloc/sysfs order; each holds its logical CPUs (OS indices) ascending.
    pub cores: Vec<Vec<u32>>,
}

/// The machine as seen by this process: NUMA nodes that have at least one allowed core, ordered
/// by OS index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The nodes, ascending by [`NumaNode::os_index`].
    pub nodes: Vec<NumaNode>,
    /// Where the information came from.
    pub source: TopologySource,
}

/// Where a [`Topology`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologySource {
    /// The system hwloc library, probing this machine.
    Hwloc,
    /// An hwloc synthetic description (not this machine; for tests and planning).
    Synthetic,
    /// Linux sysfs (`/sys/devices/system/node` and per-CPU `topology/core_id`).
    Sysfs,
    /// One node with every allowed CPU counted as its own core (no topology information).
    Fallback,
}

impl fmt::Display for TopologySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopologySource::Hwloc => "hwloc",
            TopologySource::Synthetic => "synthetic",
            TopologySource::Sysfs => "sysfs",
            TopologySource::Fallback => "fallback",
        })
    }
}

impl Topology {
    /// Detect the machine: hwloc (if the `hwloc` feature is on and hwloc loads this system),
    /// else `/sys/devices/system/node` + `/sys/devices/system/cpu/cpu*/topology/core_id`, else
    /// one node with all online CPUs (`sched_getaffinity`, or `available_parallelism`). Only
    /// CPUs in the process's allowed affinity mask count. Never panics.
    ///
    /// Memory-only nodes (no allowed CPU, e.g. CXL or HBM expanders) are left out; a CPU whose
    /// locality spans several nodes is given to the lowest-numbered one, as Linux does.
    pub fn detect() -> Topology {
        let allowed: BTreeSet<u32> = crate::affinity::allowed_cpus().into_iter().collect();
        // An empty mask means the query failed, not that no CPU is allowed; then filter nothing.
        let filter = (!allowed.is_empty()).then_some(&allowed);

        #[cfg(feature = "hwloc")]
        if let Some(topo) = hw::detect(filter) {
            return topo;
        }
        if let Some(topo) = detect_sysfs(Path::new("/sys/devices/system"), filter) {
            return topo;
        }
        fallback(&allowed)
    }

    /// Build a topology from an hwloc synthetic description, e.g. `"numa:2 core:2 pu:2"`
    /// (see hwloc's documentation of synthetic topologies). PUs are numbered in order.
    ///
    /// Returns an error message if the description is invalid or the `hwloc` feature is off.
    pub fn synthetic(description: &str) -> Result<Topology, String> {
        #[cfg(feature = "hwloc")]
        {
            hw::synthetic(description)
        }
        #[cfg(not(feature = "hwloc"))]
        {
            Err(format!(
                "Cannot build the synthetic topology {description:?}: kt-core was built without the `hwloc` feature."
            ))
        }
    }

    /// The process-wide detected topology, computed once on first use.
    pub fn global() -> &'static Topology {
        static GLOBAL: OnceLock<Topology> = OnceLock::new();
        GLOBAL.get_or_init(Topology::detect)
    }

    /// The node with OS index `os_index`, if the topology has it.
    pub fn node(&self, os_index: u32) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.os_index == os_index)
    }

    /// Physical cores over all nodes.
    pub fn total_physical_cores(&self) -> usize {
        self.nodes.iter().map(|n| n.cores.len()).sum()
    }

    /// A short human description, e.g. `"1 NUMA node(s): node0=2 cores (hwloc)"`.
    pub fn describe(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("node{}={} cores", n.os_index, n.cores.len()))
            .collect();
        format!(
            "{} NUMA node(s): {} ({})",
            self.nodes.len(),
            nodes.join(", "),
            self.source
        )
    }
}

/// Which CPU each worker thread of each sub-pool should be pinned to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinPlan {
    /// Per sub-pool, per worker: the CPU (OS index) to pin to, or `None` when the sub-pool's
    /// node is not in the topology (or has no cores); the caller then leaves the thread unpinned.
    pub cpus: Vec<Vec<Option<u32>>>,
    /// True when some node got more workers than it has physical cores, so workers share a
    /// core (as hyperthread siblings) or even a CPU.
    pub oversubscribed: bool,
    /// Human-readable notes on oversubscription, missing nodes and mismatched inputs.
    pub warnings: Vec<String>,
}

/// Plan which CPU each worker thread of each sub-pool is pinned to, like the original kt-kernel.
///
/// Sub-pool `i` lives on NUMA node `numa_map[i]` (an OS index) and has `threads[i]` workers.
/// Workers take distinct physical cores of that node in order (the first CPU of each core);
/// sub-pools sharing a node take consecutive, non-overlapping core ranges. When a node has
/// fewer physical cores than requested, further workers go onto the hyperthread siblings (second
/// CPUs of the cores, in core order, then third ...), and after that reuse CPUs from the start.
/// This never fails: oversubscription is reported in [`PinPlan::oversubscribed`] and
/// [`PinPlan::warnings`]. A node missing from `topo` gives `None` for its workers.
///
/// If the two slices differ in length, the plan has one entry per sub-pool of the longer one: a
/// sub-pool without a node gets `None`s, one without a thread count gets no workers.
pub fn plan_pinning(topo: &Topology, numa_map: &[u32], threads: &[usize]) -> PinPlan {
    let pools = numa_map.len().max(threads.len());
    let mut plan = PinPlan {
        cpus: Vec::with_capacity(pools),
        oversubscribed: false,
        warnings: Vec::new(),
    };
    if numa_map.len() != threads.len() {
        plan.warnings.push(format!(
            "numa_map has {} entries but threads has {}; sub-pools missing a node are left unpinned and sub-pools missing a thread count get no workers.",
            numa_map.len(),
            threads.len()
        ));
    }
    // Next free slot on each node, so sub-pools sharing a node get consecutive ranges.
    let mut next_slot: HashMap<u32, usize> = HashMap::new();
    for pool in 0..pools {
        let workers = threads.get(pool).copied().unwrap_or(0);
        let Some(&node_id) = numa_map.get(pool) else {
            plan.cpus.push(vec![None; workers]);
            continue;
        };
        let slots = match topo.node(node_id) {
            Some(node) => node_slots(node),
            None => Vec::new(),
        };
        if slots.is_empty() {
            if workers > 0 {
                plan.warnings.push(format!(
                    "Sub-pool {pool}: NUMA node {node_id} is not in the topology ({}) or has no allowed cores; its {workers} worker(s) stay unpinned.",
                    topo.describe()
                ));
            }
            plan.cpus.push(vec![None; workers]);
            continue;
        }
        let cores = topo.node(node_id).map_or(0, |n| n.cores.len());
        let start = *next_slot.get(&node_id).unwrap_or(&0);
        let end = start + workers;
        next_slot.insert(node_id, end);
        plan.cpus
            .push((start..end).map(|s| Some(slots[s % slots.len()])).collect());

        // Slots [cores, slots.len()) are hyperthread siblings; beyond that CPUs repeat.
        let on_siblings = overlap(start..end, cores..slots.len());
        let on_reused = overlap(start..end, slots.len()..usize::MAX);
        if on_siblings + on_reused > 0 {
            plan.oversubscribed = true;
            let mut msg = format!(
                "Sub-pool {pool}: workers {start}..{end} on NUMA node {node_id} exceed its {cores} physical cores"
            );
            if on_siblings > 0 {
                msg.push_str(&format!(
                    "; {on_siblings} worker(s) run on hyperthread siblings of busy cores"
                ));
            }
            if on_reused > 0 {
                msg.push_str(&format!(
                    "; {on_reused} worker(s) share a CPU with another worker (the node has {} CPUs)",
                    slots.len()
                ));
            }
            msg.push('.');
            plan.warnings.push(msg);
        }
    }
    plan
}

/// The order in which a node's CPUs are handed out: the first CPU of every core, then the second
/// CPU of every core that has one, and so on.
fn node_slots(node: &NumaNode) -> Vec<u32> {
    let width = node.cores.iter().map(Vec::len).max().unwrap_or(0);
    (0..width)
        .flat_map(|k| {
            node.cores
                .iter()
                .filter_map(move |core| core.get(k).copied())
        })
        .collect()
}

/// Number of integers in both half-open ranges.
fn overlap(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> usize {
    a.end.min(b.end).saturating_sub(a.start.max(b.start))
}

/// Keep the cores' CPUs that pass `allowed`, drop emptied cores and nodes, sort nodes.
fn finish(
    mut nodes: Vec<NumaNode>,
    allowed: Option<&BTreeSet<u32>>,
    source: TopologySource,
) -> Option<Topology> {
    for node in &mut nodes {
        for core in &mut node.cores {
            if let Some(allowed) = allowed {
                core.retain(|cpu| allowed.contains(cpu));
            }
            core.sort_unstable();
            core.dedup();
        }
        node.cores.retain(|core| !core.is_empty());
    }
    nodes.retain(|n| !n.cores.is_empty());
    nodes.sort_by_key(|n| n.os_index);
    (!nodes.is_empty()).then_some(Topology { nodes, source })
}

/// Read the topology from a sysfs tree rooted at `root` (normally `/sys/devices/system`).
/// Returns `None` if there is no node directory or no allowed CPU in it.
fn detect_sysfs(root: &Path, allowed: Option<&BTreeSet<u32>>) -> Option<Topology> {
    let mut node_ids: Vec<u32> = std::fs::read_dir(root.join("node"))
        .ok()?
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("node")?
                .parse()
                .ok()
        })
        .collect();
    node_ids.sort_unstable();

    let mut assigned = BTreeSet::new();
    let mut nodes = Vec::new();
    for id in node_ids {
        let Ok(list) = std::fs::read_to_string(root.join(format!("node/node{id}/cpulist"))) else {
            continue;
        };
        // Cores keyed by (package, die, core_id): core_id alone repeats across packages.
        let mut cores: BTreeMap<(i64, i64, i64), Vec<u32>> = BTreeMap::new();
        let mut order = Vec::new();
        for cpu in parse_cpu_list(&list) {
            if allowed.is_some_and(|a| !a.contains(&cpu)) || !assigned.insert(cpu) {
                continue;
            }
            let read = |name: &str| -> Option<i64> {
                let p = root.join(format!("cpu/cpu{cpu}/topology/{name}"));
                std::fs::read_to_string(p).ok()?.trim().parse().ok()
            };
            // Without a core_id the CPU is its own core (negative keys cannot clash with real ids).
            let key = match read("core_id") {
                Some(core) => (
                    read("physical_package_id").unwrap_or(0),
                    read("die_id").unwrap_or(0),
                    core,
                ),
                None => (-1, -1, -1 - i64::from(cpu)),
            };
            let entry = cores.entry(key).or_default();
            if entry.is_empty() {
                order.push(key);
            }
            entry.push(cpu);
        }
        // Cores in the order of their lowest CPU, as the cpulist is ascending.
        let cores = order
            .iter()
            .filter_map(|k| cores.remove(k))
            .collect::<Vec<_>>();
        nodes.push(NumaNode {
            os_index: id,
            cores,
        });
    }
    finish(nodes, None, TopologySource::Sysfs)
}

/// One node 0 with every allowed CPU as its own core; if the mask is unknown, CPUs
/// `0..available_parallelism`.
fn fallback(allowed: &BTreeSet<u32>) -> Topology {
    let cpus: Vec<u32> = if allowed.is_empty() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..n as u32).collect()
    } else {
        allowed.iter().copied().collect()
    };
    Topology {
        nodes: vec![NumaNode {
            os_index: 0,
            cores: cpus.into_iter().map(|c| vec![c]).collect(),
        }],
        source: TopologySource::Fallback,
    }
}

/// Parse a Linux CPU list such as `"0-3,8,10-11"`; malformed pieces are skipped.
fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// Everything that touches hwloc (through `hwlocality`).
#[cfg(feature = "hwloc")]
mod hw {
    use super::{finish, NumaNode, Topology, TopologySource};
    use hwlocality::object::types::ObjectType;
    use hwlocality::object::TopologyObject;
    use hwlocality::Topology as HwTopology;
    use std::collections::BTreeSet;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// Load this machine's topology. `None` if hwloc fails, panics inside `hwlocality`, or was
    /// redirected elsewhere (`HWLOC_XMLFILE`/`HWLOC_SYNTHETIC`): a pin plan needs real CPUs.
    pub(super) fn detect(allowed: Option<&BTreeSet<u32>>) -> Option<Topology> {
        // hwlocality panics (expect/unreachable) on some unexpected hwloc errors; detect()
        // promises never to panic, so contain them and fall back to sysfs.
        catch_unwind(AssertUnwindSafe(|| {
            let topo = HwTopology::new().ok()?;
            if !topo.is_this_system() {
                return None;
            }
            finish(extract(&topo), allowed, TopologySource::Hwloc)
        }))
        .ok()
        .flatten()
    }

    /// Build a topology from an hwloc synthetic description.
    pub(super) fn synthetic(description: &str) -> Result<Topology, String> {
        let fail = |why: &dyn std::fmt::Display| {
            format!("Invalid hwloc synthetic topology {description:?}: {why}.")
        };
        let built = catch_unwind(AssertUnwindSafe(|| {
            HwTopology::builder()
                .from_synthetic(description)
                .map_err(|e| fail(&e))?
                .build()
                .map_err(|e| fail(&e))
        }))
        .map_err(|_| fail(&"hwloc failed unexpectedly"))??;
        finish(extract(&built), None, TopologySource::Synthetic)
            .ok_or_else(|| fail(&"it has no cores"))
    }

    /// Nodes with their cores, in hwloc's logical core order (cores of a node are consecutive
    /// there, which is also the order the original kt-kernel hands them out).
    fn extract(topo: &HwTopology) -> Vec<NumaNode> {
        // Node cpusets as plain sets, ascending by OS index so shared CPUs go to the lowest node.
        let mut numa: Vec<(u32, BTreeSet<u32>)> = topo
            .objects_with_type(ObjectType::NUMANode)
            .map(|n| {
                let id = n.os_index().unwrap_or(n.logical_index());
                (u32::try_from(id).unwrap_or(u32::MAX), cpus_of(n))
            })
            .collect();
        numa.sort_by_key(|(id, _)| *id);

        // Some platforms expose no Core objects; then each PU stands for a core.
        let core_type = if topo.objects_with_type(ObjectType::Core).len() > 0 {
            ObjectType::Core
        } else {
            ObjectType::PU
        };
        let mut nodes: Vec<NumaNode> = numa
            .iter()
            .map(|(id, _)| NumaNode {
                os_index: *id,
                cores: Vec::new(),
            })
            .collect();
        for core in topo.objects_with_type(core_type) {
            let pus: Vec<u32> = cpus_of(core).into_iter().collect();
            let Some(first) = pus.first() else { continue };
            if let Some(i) = numa.iter().position(|(_, set)| set.contains(first)) {
                nodes[i].cores.push(pus);
            }
        }
        nodes
    }

    /// An object's cpuset as OS PU indices.
    fn cpus_of(obj: &TopologyObject) -> BTreeSet<u32> {
        obj.cpuset()
            .map(|set| {
                set.iter_set()
                    .filter_map(|i| u32::try_from(usize::from(i)).ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(os_index: u32, cores: &[&[u32]]) -> NumaNode {
        NumaNode {
            os_index,
            cores: cores.iter().map(|c| c.to_vec()).collect(),
        }
    }

    /// Two nodes, two cores each, Intel-style sibling numbering (cpu N and N+4 share a core).
    fn two_by_two() -> Topology {
        Topology {
            nodes: vec![node(0, &[&[0, 4], &[1, 5]]), node(1, &[&[2, 6], &[3, 7]])],
            source: TopologySource::Synthetic,
        }
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn topology_synthetic_numa2_core2_pu2() {
        let t = Topology::synthetic("numa:2 core:2 pu:2").unwrap();
        assert_eq!(t.source, TopologySource::Synthetic);
        assert_eq!(
            t.nodes,
            vec![node(0, &[&[0, 1], &[2, 3]]), node(1, &[&[4, 5], &[6, 7]]),]
        );
        assert_eq!(t.total_physical_cores(), 4);
        assert_eq!(t.node(1).unwrap().cores[0], vec![4, 5]);
        assert!(t.node(2).is_none());
        assert_eq!(
            t.describe(),
            "2 NUMA node(s): node0=2 cores, node1=2 cores (synthetic)"
        );
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn topology_synthetic_numa2_core4_pu1() {
        let t = Topology::synthetic("numa:2 core:4 pu:1").unwrap();
        assert_eq!(
            t.nodes,
            vec![
                node(0, &[&[0], &[1], &[2], &[3]]),
                node(1, &[&[4], &[5], &[6], &[7]]),
            ]
        );
        assert_eq!(t.total_physical_cores(), 8);
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn topology_synthetic_deeper_and_single_node() {
        // Packages above NUMA nodes, and a description without a NUMA level (hwloc adds one).
        let t = Topology::synthetic("pack:2 numa:2 core:3 pu:2").unwrap();
        assert_eq!(t.nodes.len(), 4);
        assert_eq!(
            t.nodes.iter().map(|n| n.os_index).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert!(t.nodes.iter().all(|n| n.cores.len() == 3));
        assert_eq!(t.nodes[3].cores[2], vec![22, 23]);
        let t = Topology::synthetic("core:3 pu:1").unwrap();
        assert_eq!(t.nodes, vec![node(0, &[&[0], &[1], &[2]])]);
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn topology_synthetic_invalid_is_error() {
        for bad in ["numa:two core:2", "bogus:3", "core:2\0pu:2"] {
            let err = Topology::synthetic(bad).unwrap_err();
            assert!(err.contains("synthetic"), "{bad:?}: {err}");
        }
    }

    #[cfg(not(feature = "hwloc"))]
    #[test]
    fn topology_synthetic_needs_hwloc_feature() {
        let err = Topology::synthetic("numa:2 core:2 pu:2").unwrap_err();
        assert!(err.contains("hwloc"), "{err}");
    }

    #[test]
    fn topology_plan_two_pools_on_two_nodes() {
        let plan = plan_pinning(&two_by_two(), &[0, 1], &[2, 2]);
        assert_eq!(
            plan.cpus,
            vec![vec![Some(0), Some(1)], vec![Some(2), Some(3)]]
        );
        assert!(!plan.oversubscribed);
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
    }

    #[test]
    fn topology_plan_two_pools_share_a_node() {
        let topo = Topology {
            nodes: vec![node(0, &[&[0, 4], &[1, 5], &[2, 6], &[3, 7]])],
            source: TopologySource::Synthetic,
        };
        let plan = plan_pinning(&topo, &[0, 0], &[1, 3]);
        assert_eq!(
            plan.cpus,
            vec![vec![Some(0)], vec![Some(1), Some(2), Some(3)]]
        );
        assert!(!plan.oversubscribed);
        assert!(plan.warnings.is_empty());
        // Sharing is tracked per node even when sub-pools of different nodes interleave.
        let plan = plan_pinning(&two_by_two(), &[0, 1, 0, 1], &[1, 1, 1, 1]);
        assert_eq!(
            plan.cpus,
            vec![vec![Some(0)], vec![Some(2)], vec![Some(1)], vec![Some(3)]]
        );
        assert!(!plan.oversubscribed);
    }

    #[test]
    fn topology_plan_oversubscribed_uses_siblings_then_reuses() {
        // Four workers on a two-core node: the two cores, then their hyperthread siblings.
        let plan = plan_pinning(&two_by_two(), &[1], &[4]);
        assert_eq!(plan.cpus, vec![vec![Some(2), Some(3), Some(6), Some(7)]]);
        assert!(plan.oversubscribed);
        assert_eq!(plan.warnings.len(), 1);
        assert!(
            plan.warnings[0].contains("hyperthread"),
            "{:?}",
            plan.warnings
        );
        assert!(!plan.warnings[0].contains("share a CPU"));

        // Six workers: siblings are used up too, so CPUs repeat from the first core.
        let plan = plan_pinning(&two_by_two(), &[0], &[6]);
        assert_eq!(
            plan.cpus,
            vec![vec![Some(0), Some(1), Some(4), Some(5), Some(0), Some(1)]]
        );
        assert!(plan.oversubscribed);
        assert!(
            plan.warnings[0].contains("2 worker(s) share a CPU"),
            "{:?}",
            plan.warnings
        );

        // Without SMT, extra workers reuse cores directly; the second sub-pool continues the
        // rotation where the first stopped.
        let topo = Topology {
            nodes: vec![node(0, &[&[0], &[1]])],
            source: TopologySource::Synthetic,
        };
        let plan = plan_pinning(&topo, &[0, 0], &[3, 2]);
        assert_eq!(
            plan.cpus,
            vec![vec![Some(0), Some(1), Some(0)], vec![Some(1), Some(0)]]
        );
        assert!(plan.oversubscribed);
        assert_eq!(plan.warnings.len(), 2);
    }

    #[test]
    fn topology_plan_missing_node_is_unpinned() {
        let plan = plan_pinning(&two_by_two(), &[0, 5], &[2, 3]);
        assert_eq!(plan.cpus, vec![vec![Some(0), Some(1)], vec![None; 3]]);
        assert!(!plan.oversubscribed);
        assert_eq!(plan.warnings.len(), 1);
        assert!(plan.warnings[0].contains("node 5"), "{:?}", plan.warnings);

        // A node without cores is treated the same way.
        let topo = Topology {
            nodes: vec![node(0, &[&[0]]), node(1, &[])],
            source: TopologySource::Synthetic,
        };
        let plan = plan_pinning(&topo, &[1], &[2]);
        assert_eq!(plan.cpus, vec![vec![None, None]]);
        assert_eq!(plan.warnings.len(), 1);
    }

    #[test]
    fn topology_plan_mismatched_lengths_do_not_panic() {
        let plan = plan_pinning(&two_by_two(), &[0, 1, 1], &[1]);
        assert_eq!(plan.cpus, vec![vec![Some(0)], vec![], vec![]]);
        assert_eq!(plan.warnings.len(), 1);
        let plan = plan_pinning(&two_by_two(), &[1], &[1, 2]);
        assert_eq!(plan.cpus, vec![vec![Some(2)], vec![None, None]]);
        let plan = plan_pinning(&two_by_two(), &[], &[]);
        assert!(plan.cpus.is_empty() && plan.warnings.is_empty() && !plan.oversubscribed);
    }

    #[test]
    fn topology_node_slots_handle_uneven_cores() {
        // Hybrid CPUs: SMT performance cores next to single-thread efficiency cores.
        let n = node(0, &[&[0, 1], &[2, 3], &[4], &[5]]);
        assert_eq!(node_slots(&n), vec![0, 2, 4, 5, 1, 3]);
    }

    #[test]
    fn topology_detect_this_machine() {
        let t = Topology::detect();
        assert!(!t.nodes.is_empty(), "{t:?}");
        assert!(t.total_physical_cores() >= 1, "{t:?}");
        let allowed: BTreeSet<u32> = crate::affinity::allowed_cpus().into_iter().collect();
        let mut seen = BTreeSet::new();
        for n in &t.nodes {
            assert!(!n.cores.is_empty());
            for core in &n.cores {
                assert!(!core.is_empty());
                for &cpu in core {
                    assert!(seen.insert(cpu), "cpu {cpu} listed twice in {t:?}");
                    if !allowed.is_empty() {
                        assert!(allowed.contains(&cpu), "cpu {cpu} not allowed: {t:?}");
                    }
                }
            }
        }
        assert!(t.nodes.windows(2).all(|w| w[0].os_index < w[1].os_index));
        #[cfg(feature = "hwloc")]
        assert_eq!(t.source, TopologySource::Hwloc, "{}", t.describe());
        // Every allowed CPU is placed somewhere (this machine has no CPU-less quirks).
        if !allowed.is_empty() {
            assert_eq!(seen, allowed, "{}", t.describe());
        }
        // The sysfs reader agrees with hwloc on this machine when both work.
        // Compared as sets: the two may enumerate cores in different orders.
        let as_sets = |t: &Topology| -> Vec<(u32, BTreeSet<Vec<u32>>)> {
            t.nodes
                .iter()
                .map(|n| (n.os_index, n.cores.iter().cloned().collect()))
                .collect()
        };
        if let Some(s) = detect_sysfs(Path::new("/sys/devices/system"), Some(&allowed)) {
            assert_eq!(as_sets(&s), as_sets(&t), "sysfs vs {}", t.describe());
        }
        assert!(t
            .describe()
            .starts_with(&format!("{} NUMA node(s): node", t.nodes.len())));
    }

    #[test]
    fn topology_detect_from_pinned_thread_sees_whole_process() {
        use crate::affinity::{allowed_cpus, current_thread_cpus, pin_current_thread};
        let expected = Topology::detect();
        let target = *allowed_cpus().last().unwrap();
        let (seen, mask_after) = std::thread::spawn(move || {
            pin_current_thread(target).unwrap();
            (Topology::detect(), current_thread_cpus())
        })
        .join()
        .unwrap();
        // The pinned thread's one-CPU mask neither shrinks the topology nor is lost by hwloc's
        // probing (which may rebind the calling thread temporarily).
        assert_eq!(seen, expected);
        assert_eq!(mask_after, vec![target]);
    }

    #[test]
    fn topology_global_is_cached() {
        let a = Topology::global();
        let b = Topology::global();
        assert!(std::ptr::eq(a, b));
        assert!(!a.nodes.is_empty());
    }

    #[test]
    fn topology_describe_format() {
        let t = Topology {
            nodes: vec![node(0, &[&[0, 2], &[1, 3]])],
            source: TopologySource::Hwloc,
        };
        assert_eq!(t.describe(), "1 NUMA node(s): node0=2 cores (hwloc)");
    }

    #[test]
    fn topology_parse_cpu_list() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("\n"), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("5"), vec![5]);
        assert_eq!(parse_cpu_list("x,2,3-y"), vec![2]);
    }

    #[test]
    fn topology_fallback_uses_allowed_cpus() {
        let t = fallback(&[1, 3].into_iter().collect());
        assert_eq!(t.nodes, vec![node(0, &[&[1], &[3]])]);
        assert_eq!(t.source, TopologySource::Fallback);
        let t = fallback(&BTreeSet::new());
        assert!(t.total_physical_cores() >= 1);
    }

    /// A throwaway sysfs tree under the temp directory, removed on drop.
    struct FakeSysfs(std::path::PathBuf);

    impl FakeSysfs {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("kt-core-topology-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            FakeSysfs(dir)
        }
        fn write(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        fn cpu(&self, cpu: u32, package: u32, core: u32) {
            self.write(
                &format!("cpu/cpu{cpu}/topology/physical_package_id"),
                &format!("{package}\n"),
            );
            self.write(
                &format!("cpu/cpu{cpu}/topology/core_id"),
                &format!("{core}\n"),
            );
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn topology_sysfs_groups_siblings_per_package() {
        let fs = FakeSysfs::new("sysfs");
        // Two sockets, one node each, 2 cores x 2 threads; core_ids repeat across sockets.
        fs.write("node/node0/cpulist", "0-1,4-5\n");
        fs.write("node/node1/cpulist", "2-3,6-7\n");
        fs.write("node/node2/cpulist", "\n"); // memory-only node
        fs.write("node/online", "0-2\n"); // not a node directory
        for (cpu, package, core) in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)] {
            fs.cpu(cpu, package, core);
            fs.cpu(cpu + 4, package, core);
        }
        let t = detect_sysfs(&fs.0, None).unwrap();
        assert_eq!(t.source, TopologySource::Sysfs);
        assert_eq!(
            t.nodes,
            vec![node(0, &[&[0, 4], &[1, 5]]), node(1, &[&[2, 6], &[3, 7]])]
        );

        // Only allowed CPUs count; a node left without any disappears.
        let allowed: BTreeSet<u32> = [0, 1, 5].into_iter().collect();
        let t = detect_sysfs(&fs.0, Some(&allowed)).unwrap();
        assert_eq!(t.nodes, vec![node(0, &[&[0], &[1, 5]])]);

        // Nothing allowed at all: no topology, so detect() moves on to the fallback.
        let none: BTreeSet<u32> = [99].into_iter().collect();
        assert!(detect_sysfs(&fs.0, Some(&none)).is_none());
        assert!(detect_sysfs(&fs.0.join("missing"), None).is_none());
    }

    #[test]
    fn topology_sysfs_without_core_ids() {
        let fs = FakeSysfs::new("nocore");
        fs.write("node/node3/cpulist", "0-2\n");
        let t = detect_sysfs(&fs.0, None).unwrap();
        assert_eq!(t.nodes, vec![node(3, &[&[0], &[1], &[2]])]);
    }
}
