//! Putting an arena's pages and pinpool's threads on one NUMA node: the node of the arena's
//! GPU, as [`crate::system::topology`] decided.
//!
//! How: the arena's own mapping gets a memory policy (`mbind`) before its first page is
//! faulted in (and so before CUDA registers it); where the driver allocates the memory itself
//! (`cuMemHostAlloc`), the calling thread's policy is set around that one call and restored
//! after it; the threads that fault the arena in and the pool's copy threads are pinned to the
//! node's CPUs (`sched_setaffinity`), so even pages the policy could not place land there
//! (first touch).
//!
//! Invariants:
//! - Only what pinpool owns changes: the policy of the arena's mapping, the calling thread's
//!   policy for the length of one allocation (restored before [`Placement::allocate`]
//!   returns), and the CPU affinity of threads pinpool started: never a caller's thread's.
//! - Placement never fails a pool: a refused call becomes a note in [`Placement::notes`], and
//!   [`Placement::summary`] says truthfully where the arena went.
//! - The policy is `MPOL_PREFERRED`, not `MPOL_BIND`: when the node runs out of memory, pages
//!   come from another node instead of the process being killed while the arena is faulted in.
//! - Threads are pinned only to CPUs this process may use (the node's CPUs that the calling
//!   thread's affinity allows), so a rank already bound by its launcher stays within its CPUs.

use std::ffi::{c_int, c_long, c_ulong};

use crate::error::{Error, Result};
use crate::system::topology::{self, format_cpulist, Decision};

/// `MPOL_DEFAULT` from `<linux/mempolicy.h>` (absent from `libc`).
const MPOL_DEFAULT: c_int = 0;
/// `MPOL_PREFERRED`: allocate on the node, else anywhere.
const MPOL_PREFERRED: c_int = 1;
/// `get_mempolicy` flags: return the node of the page at `addr`.
const MPOL_F_NODE: c_ulong = 1;
const MPOL_F_ADDR: c_ulong = 2;

const BITS: usize = c_ulong::BITS as usize;

/// A node mask with only `node` set, and the `maxnode` argument that goes with it (the
/// kernel reads `maxnode - 1` bits).
fn node_mask(node: usize) -> (Vec<c_ulong>, c_ulong) {
    let mut mask = vec![0 as c_ulong; node / BITS + 1];
    mask[node / BITS] |= 1 << (node % BITS);
    let maxnode = (mask.len() * BITS + 1) as c_ulong;
    (mask, maxnode)
}

// Every integer passed to `libc::syscall` below is widened to a `long` first: the kernel reads
// whole registers, and a variadic `int` leaves the upper half of one unspecified.

/// The errno of a failed raw syscall, as an error naming the call.
fn syscall_result(call: &'static str, rc: c_long) -> Result<c_long> {
    if rc < 0 {
        Err(Error::last_os(call))
    } else {
        Ok(rc)
    }
}

/// Asks the kernel to allocate the pages of `[addr, addr + len)` (page-aligned, mapped) on
/// `node`, or elsewhere when it is full (`MPOL_PREFERRED`). Pages already there stay where
/// they are: call it before the first touch. On a shared-memory mapping the policy belongs
/// to the file, so other mappings of it (a worker's) see the same pages. `addr` is an address,
/// never dereferenced here: the kernel looks it up in this process's mappings.
pub fn prefer_node(addr: usize, len: usize, node: usize) -> Result<()> {
    let (mask, maxnode) = node_mask(node);
    // SAFETY: mbind only changes the memory policy of the range (no flags: nothing is moved);
    // the kernel checks that the range is mapped and fails with an errno otherwise. `mask` is
    // readable for the `maxnode - 1` bits it is given with.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr,
            len,
            MPOL_PREFERRED as c_ulong,
            mask.as_ptr(),
            maxnode,
            0 as c_ulong,
        )
    };
    syscall_result("mbind", rc).map(drop)
}

/// The NUMA node of the page at address `addr`, faulted in (`get_mempolicy(MPOL_F_NODE |
/// MPOL_F_ADDR)`); an error if nothing is mapped there.
pub fn page_node(addr: usize) -> Result<usize> {
    let mut node: c_int = -1;
    // SAFETY: `node` is a valid out-pointer; no node mask is asked for (NULL, 0); the kernel
    // looks `addr` up in this process's mappings and fails with an errno if it is not mapped.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut c_int,
            std::ptr::null_mut::<c_ulong>(),
            0 as c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    syscall_result("get_mempolicy", rc)?;
    usize::try_from(node).map_err(|_| Error::Os { call: "get_mempolicy", errno: 0 })
}

/// The calling thread's memory policy while it is overridden; restored on drop.
struct ThreadPolicyGuard {
    mode: c_int,
    mask: Vec<c_ulong>,
}

/// Bits in the mask used to save a thread's policy (the kernel refuses fewer than the machine
/// has possible nodes; 4096 is more than any has).
const SAVED_MASK_BITS: usize = 4096;

impl ThreadPolicyGuard {
    /// Saves the calling thread's policy, then makes `node` its preferred node.
    fn prefer(node: usize) -> Result<Self> {
        let (mode, mask) = thread_policy()?;
        let saved = ThreadPolicyGuard { mode, mask };
        let (mask, maxnode) = node_mask(node);
        set_thread_policy(MPOL_PREFERRED, &mask, maxnode)?;
        Ok(saved)
    }
}

/// The calling thread's memory policy: its mode and node mask (`SAVED_MASK_BITS` bits).
fn thread_policy() -> Result<(c_int, Vec<c_ulong>)> {
    let mut mode: c_int = MPOL_DEFAULT;
    let mut mask = vec![0 as c_ulong; SAVED_MASK_BITS / BITS];
    // SAFETY: `mode` and `mask` are valid out-pointers, `mask` holding the `SAVED_MASK_BITS`
    // bits passed (`maxnode - 1`); no address: the thread's own policy.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut c_int,
            mask.as_mut_ptr(),
            (SAVED_MASK_BITS + 1) as c_ulong,
            std::ptr::null::<u8>(),
            0 as c_ulong,
        )
    };
    syscall_result("get_mempolicy", rc)?;
    Ok((mode, mask))
}

impl Drop for ThreadPolicyGuard {
    fn drop(&mut self) {
        let maxnode = (self.mask.len() * BITS + 1) as c_ulong;
        if set_thread_policy(self.mode, &self.mask, maxnode).is_err() {
            // The saved policy cannot be put back as it was read (a node went offline since):
            // the default is the closest thing, and better than leaving ours in place.
            let _ = set_thread_policy(MPOL_DEFAULT, &[], 1);
        }
    }
}

/// `set_mempolicy(mode, mask, maxnode)` for the calling thread.
fn set_thread_policy(mode: c_int, mask: &[c_ulong], maxnode: c_ulong) -> Result<()> {
    let mask_ptr = if mask.is_empty() { std::ptr::null() } else { mask.as_ptr() };
    // SAFETY: set_mempolicy only changes the calling thread's memory policy; `mask` is
    // readable for the `maxnode - 1` bits it is given with (or NULL with `maxnode - 1 == 0`).
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode as c_long, mask_ptr, maxnode) };
    syscall_result("set_mempolicy", rc).map(drop)
}

/// The CPUs the calling thread may run on (`sched_getaffinity`).
pub fn allowed_cpus() -> Result<Vec<usize>> {
    let mut words = 1024 / BITS;
    loop {
        let mut mask = vec![0 as c_ulong; words];
        let bytes = words * std::mem::size_of::<c_ulong>();
        // SAFETY: `mask` is writable for `bytes` bytes; pid 0 is the calling thread.
        let rc = unsafe {
            libc::syscall(libc::SYS_sched_getaffinity, 0 as c_long, bytes, mask.as_mut_ptr())
        };
        match syscall_result("sched_getaffinity", rc) {
            Ok(_) => {
                let cpus =
                    (0..words * BITS).filter(|&cpu| mask[cpu / BITS] >> (cpu % BITS) & 1 == 1);
                return Ok(cpus.collect());
            }
            // The kernel's CPU mask is larger than ours: try a larger one.
            Err(Error::Os { errno: libc::EINVAL, .. }) if words < (1 << 20) / BITS => words *= 2,
            Err(e) => return Err(e),
        }
    }
}

/// Restricts the calling thread to `cpus` (`sched_setaffinity`). Meant for pinpool's own
/// threads only (see the module's invariants).
pub fn pin_current_thread(cpus: &[usize]) -> Result<()> {
    let Some(&highest) = cpus.iter().max() else {
        return Err(Error::Invalid("cannot pin a thread to no CPU".into()));
    };
    let mut mask = vec![0 as c_ulong; highest / BITS + 1];
    for &cpu in cpus {
        mask[cpu / BITS] |= 1 << (cpu % BITS);
    }
    let bytes = mask.len() * std::mem::size_of::<c_ulong>();
    // SAFETY: `mask` is readable for `bytes` bytes; pid 0 is the calling thread, whose CPU
    // affinity is all this changes.
    let rc =
        unsafe { libc::syscall(libc::SYS_sched_setaffinity, 0 as c_long, bytes, mask.as_ptr()) };
    syscall_result("sched_setaffinity", rc).map(drop)
}

/// Where one arena's pages and its threads go, and what to say about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The node the arena's pages are asked for on.
    node: Option<usize>,
    /// The CPUs pinpool's threads for this arena run on.
    thread_cpus: Option<Vec<usize>>,
    /// The GPU, in sysfs's form, when placed.
    bus_id: Option<String>,
    /// Where the pages went, a clause ("arena on NUMA node 1 (GPU 0000:41:00.0)").
    memory: String,
    /// Where the threads run, a clause ("copy threads on CPUs 8-15"), if it is worth saying.
    threads: Option<String>,
    notes: Vec<String>,
}

impl Placement {
    /// No placement, for `reason` (a clause: "no GPU").
    pub fn unplaced(reason: &str) -> Self {
        Placement {
            node: None,
            thread_cpus: None,
            bus_id: None,
            memory: format!("arena not placed: {reason}"),
            threads: None,
            notes: Vec::new(),
        }
    }

    /// The placement for an arena of the GPU at PCI address `bus_id` (or the error that kept
    /// the address unknown), from the sysfs tree ([`topology::sysfs_root`]) and the CPUs the
    /// calling thread may use.
    pub fn for_gpu(bus_id: Result<String>) -> Self {
        let root = topology::sysfs_root();
        let decision = match bus_id {
            Ok(id) => topology::decide(&root, &id),
            Err(e) => Decision::Stay {
                reason: format!("the GPU's PCI address is unknown ({e})"),
                several_nodes: topology::node_count(&root).is_some_and(|n| n > 1),
            },
        };
        Self::plan(decision, allowed_cpus().ok().as_deref())
    }

    /// The placement `decision` comes to when this process may run on `allowed` CPUs (None:
    /// unknown, taken as all).
    pub fn plan(decision: Decision, allowed: Option<&[usize]>) -> Self {
        match decision {
            Decision::Stay { reason, several_nodes } => {
                let mut placement = Self::unplaced(&reason);
                if several_nodes {
                    placement.notes.push(format!(
                        "arena not placed on its GPU's NUMA node ({reason}): the GPU may reach \
                         it across the link between sockets, at a lower bandwidth"
                    ));
                }
                placement
            }
            Decision::Place { node, cpus, bus_id } => {
                let usable: Vec<usize> = match allowed {
                    Some(allowed) => cpus.iter().copied().filter(|c| allowed.contains(c)).collect(),
                    None => cpus.clone(),
                };
                let mut notes = Vec::new();
                let threads = if usable.is_empty() {
                    notes.push(format!(
                        "copy threads not pinned to NUMA node {node}: none of its CPUs ({}) is \
                         allowed to this process ({})",
                        format_cpulist(&cpus),
                        allowed.map_or_else(|| "unknown".into(), format_cpulist)
                    ));
                    "copy threads not pinned".to_string()
                } else {
                    format!("copy threads on CPUs {}", format_cpulist(&usable))
                };
                Placement {
                    node: Some(node),
                    thread_cpus: (!usable.is_empty()).then_some(usable),
                    memory: format!("arena on NUMA node {node} (GPU {bus_id})"),
                    bus_id: Some(bus_id),
                    threads: Some(threads),
                    notes,
                }
            }
        }
    }

    /// The node the arena's pages are asked for on, if any.
    pub fn node(&self) -> Option<usize> {
        self.node
    }

    /// The CPUs pinpool's threads for this arena run on, if they are pinned.
    pub fn thread_cpus(&self) -> Option<&[usize]> {
        self.thread_cpus.as_deref()
    }

    /// One sentence: where the arena went and where its threads run, or why it was not placed.
    pub fn summary(&self) -> String {
        match &self.threads {
            Some(threads) => format!("{}, {threads}", self.memory),
            None => self.memory.clone(),
        }
    }

    /// What went wrong on a machine where placement matters (more than one node).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// `asked` threads, but no more than the CPUs they are pinned to.
    pub fn thread_count(&self, asked: usize) -> usize {
        self.thread_cpus.as_ref().map_or(asked, |cpus| asked.min(cpus.len())).max(1)
    }

    /// Asks for the pages of the arena's mapping `[addr, addr + len)` on the node, before any
    /// is touched. A failure becomes a note: the pages then go where the (pinned) threads
    /// that fault them in run.
    pub fn bind(&mut self, addr: *mut u8, len: usize) {
        let (Some(node), Some(bus_id)) = (self.node, self.bus_id.clone()) else { return };
        if let Err(e) = prefer_node(addr as usize, len, node) {
            self.memory =
                format!("arena on NUMA node {node} by first touch only (GPU {bus_id}; {e})");
            self.notes.push(format!(
                "could not ask for the arena's pages on NUMA node {node} ({e}): they go where \
                 the threads that fault them in run"
            ));
        }
    }

    /// Runs `allocate` (a driver allocation on the calling thread) with the calling thread's
    /// memory policy preferring the node, then restores the policy. Where the first and last
    /// pages of `[addr, addr + len)`, as `allocate` returns them, landed is checked after.
    pub fn allocate<T>(
        &mut self,
        allocate: impl FnOnce() -> Result<(T, *mut u8, usize)>,
    ) -> Result<T> {
        let (Some(node), Some(bus_id)) = (self.node, self.bus_id.clone()) else {
            return allocate().map(|(out, _, _)| out);
        };
        let guard = match ThreadPolicyGuard::prefer(node) {
            Ok(guard) => Some(guard),
            Err(e) => {
                self.memory = format!(
                    "arena where the driver put it (GPU {bus_id} is on NUMA node {node}; {e})"
                );
                self.notes
                    .push(format!("could not ask for the arena's pages on NUMA node {node} ({e})"));
                None
            }
        };
        let asked = guard.is_some();
        let result = allocate();
        drop(guard);
        let (out, addr, len) = result?;
        if asked && len > 0 {
            let ends = [addr as usize, addr as usize + (len - 1)];
            let seen: Vec<Result<usize>> = ends.iter().map(|&p| page_node(p)).collect();
            match seen.iter().find_map(|r| r.as_ref().ok().filter(|&&n| n != node)) {
                Some(other) => {
                    self.memory = format!(
                        "arena on NUMA node {other}, not its GPU's node {node} (GPU {bus_id})"
                    );
                    self.notes.push(format!(
                        "the driver put the arena's pages on NUMA node {other}, not on node {node} \
                         of its GPU {bus_id}"
                    ));
                }
                None if seen.iter().all(Result::is_err) => {
                    self.memory.push_str(" (asked for; where the driver's pages are is unknown)")
                }
                None => {}
            }
        }
        Ok(out)
    }

    /// Pins the calling thread (one of pinpool's own) to the placement's CPUs; without
    /// placement, or if the kernel refuses, the thread runs where it did.
    pub fn pin_calling_thread(&self) {
        if let Some(cpus) = &self.thread_cpus {
            let _ = pin_current_thread(cpus);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::shm::{page_size, Region};

    fn placed(node: usize, cpus: &[usize]) -> Decision {
        Decision::Place { node, cpus: cpus.to_vec(), bus_id: "0000:41:00.0".into() }
    }

    #[test]
    fn a_placement_says_where_the_arena_and_its_threads_go() {
        let p = Placement::plan(placed(1, &[8, 9, 10, 11, 12, 13, 14, 15]), None);
        assert_eq!(p.node(), Some(1));
        assert_eq!(p.thread_cpus(), Some(&[8, 9, 10, 11, 12, 13, 14, 15][..]));
        assert_eq!(
            p.summary(),
            "arena on NUMA node 1 (GPU 0000:41:00.0), copy threads on CPUs 8-15"
        );
        assert!(p.notes().is_empty());
        assert_eq!((p.thread_count(32), p.thread_count(4), p.thread_count(0)), (8, 4, 1));
    }

    #[test]
    fn threads_stay_within_the_cpus_this_process_may_use() {
        let p = Placement::plan(placed(1, &[8, 9, 10, 11]), Some(&[0, 1, 10, 11, 12]));
        assert_eq!(p.thread_cpus(), Some(&[10, 11][..]));
        assert!(p.summary().ends_with("copy threads on CPUs 10-11"), "{}", p.summary());
        let p = Placement::plan(placed(1, &[8, 9]), Some(&[0, 1]));
        assert_eq!((p.node(), p.thread_cpus()), (Some(1), None), "memory placed, threads not");
        assert!(p.notes()[0].contains("none of its CPUs (8-9) is allowed to this process (0-1)"));
        assert_eq!(p.thread_count(16), 16);
    }

    #[test]
    fn staying_put_is_a_note_only_where_there_are_several_nodes() {
        let one = Decision::Stay { reason: "one NUMA node".into(), several_nodes: false };
        let p = Placement::plan(one, None);
        assert_eq!((p.node(), p.thread_cpus()), (None, None));
        assert_eq!(p.summary(), "arena not placed: one NUMA node");
        assert!(p.notes().is_empty());
        let unknown =
            Decision::Stay { reason: "GPU 0000:41:00.0's node is -1".into(), several_nodes: true };
        let p = Placement::plan(unknown, None);
        assert!(p.notes()[0].contains("node is -1"), "{:?}", p.notes());
    }

    /// Whether this kernel reports no NUMA nodes (the test that asks is then skipped).
    fn no_numa() -> bool {
        let none = topology::node_count(std::path::Path::new("/sys")).is_none();
        if none {
            eprintln!("skipped: this kernel reports no NUMA nodes");
        }
        none
    }

    #[test]
    // Miri: mmap, memfd_create and mbind are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn mbind_on_a_real_shared_mapping_and_on_anonymous_memory() {
        // Node 0 exists on every Linux machine with NUMA support.
        if no_numa() {
            return;
        }
        let page = page_size();
        let region = Region::new("pinpool-test", 8 * page, page, 2).unwrap();
        prefer_node(region.as_ptr() as usize, region.len(), 0).unwrap();
        region.populate_then(2, &|| {}, |_| Ok(())).unwrap();
        assert_eq!(page_node(region.as_ptr() as usize).unwrap(), 0);
        // The kernel reports the policy on the mapping (on the memfd, in fact).
        let policy = numa_maps_line(region.as_ptr() as usize);
        assert_eq!(policy.split_whitespace().nth(1), Some("prefer:0"), "{policy}");
        let mut placement = Placement::plan(placed(0, &[0]), None);
        placement.bind(region.as_ptr(), region.len());
        assert!(placement.notes().is_empty(), "{:?}", placement.notes());
        let mut anonymous = vec![0u8; 4 * page];
        let len = anonymous.len();
        let kept = placement
            .allocate(|| {
                anonymous.fill(1);
                Ok((7, anonymous.as_mut_ptr(), len))
            })
            .unwrap();
        assert_eq!(kept, 7);
        assert!(placement.notes().is_empty(), "{:?}", placement.notes());
        // A range that is not mapped is refused with an error, not a crash.
        assert!(prefer_node(page, page, 0).is_err());
    }

    /// The calling thread's policy mode.
    fn thread_policy_mode() -> c_int {
        thread_policy().expect("get_mempolicy").0
    }

    #[test]
    // Miri: get_mempolicy and set_mempolicy are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn the_thread_policy_is_restored_after_the_allocation() {
        if no_numa() {
            return;
        }
        std::thread::spawn(|| {
            let before = thread_policy_mode();
            let during = {
                let _guard = ThreadPolicyGuard::prefer(0).unwrap();
                thread_policy_mode()
            };
            assert_eq!(during & 0xff, MPOL_PREFERRED);
            assert_eq!(thread_policy_mode(), before);
            // And after a failed allocation too.
            let mut placement = Placement::plan(placed(0, &[0]), None);
            let err = placement.allocate::<()>(|| Err(Error::Invalid("no".into()))).unwrap_err();
            assert_eq!(err, Error::Invalid("no".into()));
            assert_eq!(thread_policy_mode(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    // Miri: sched_getaffinity and sched_setaffinity are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn pinning_changes_only_the_pinned_thread() {
        let mine = allowed_cpus().unwrap();
        assert!(!mine.is_empty());
        let last = *mine.last().unwrap();
        let seen = std::thread::spawn(move || {
            pin_current_thread(&[last]).unwrap();
            allowed_cpus().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(seen, vec![last]);
        assert_eq!(allowed_cpus().unwrap(), mine, "the spawning thread was pinned too");
        assert!(pin_current_thread(&[]).is_err());
    }

    /// The `/proc/self/numa_maps` line of the mapping that starts at `addr`.
    fn numa_maps_line(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
        let line = maps.lines().find(|l| {
            l.split_whitespace().next().and_then(|a| usize::from_str_radix(a, 16).ok())
                == Some(addr)
        });
        line.unwrap_or_else(|| panic!("no numa_maps line at {addr:#x}")).to_string()
    }

    /// The `N<node>=<pages>` counts of the `/proc/self/numa_maps` line of the mapping at `addr`.
    fn numa_maps_pages(addr: usize) -> Vec<(usize, usize)> {
        numa_maps_line(addr)
            .split_whitespace()
            .filter_map(|field| {
                let (node, pages) = field.strip_prefix('N')?.split_once('=')?;
                Some((node.parse().ok()?, pages.parse().ok()?))
            })
            .collect()
    }

    #[test]
    // Miri: mmap, mbind and /proc are out of Miri's reach.
    #[cfg_attr(miri, ignore)]
    fn pages_land_on_the_asked_node_where_there_are_several() {
        let root = std::path::Path::new("/sys");
        let nodes = topology::node_count(root).unwrap_or(0);
        if nodes < 2 {
            eprintln!(
                "skipped: this machine has {nodes} NUMA node(s); placement needs two or more"
            );
            return;
        }
        let online = std::fs::read_to_string(root.join("devices/system/node/online")).unwrap();
        let target = *topology::parse_cpulist(&online).unwrap().last().unwrap();
        let page = page_size();
        // Faulted in from a thread on another node's CPUs: the policy, not first touch, decides.
        let first =
            std::fs::read_to_string(root.join("devices/system/node/node0/cpulist")).unwrap();
        let region = Region::new("pinpool-test", 64 * page, page, 1).unwrap();
        prefer_node(region.as_ptr() as usize, region.len(), target).unwrap();
        let away = topology::parse_cpulist(&first).unwrap();
        region
            .populate_then(
                1,
                &|| {
                    let _ = pin_current_thread(&away);
                },
                |_| Ok(()),
            )
            .unwrap();
        assert_eq!(numa_maps_pages(region.as_ptr() as usize), vec![(target, 64)]);
    }
}
