//! The machine's NUMA layout as sysfs tells it, and the node an arena for one GPU belongs on.
//!
//! On a machine with several NUMA nodes, a GPU hangs off one of them: pinned memory on that
//! node reaches the GPU without crossing the link between sockets, and threads on that node's
//! CPUs fill it without crossing it either. This module only reads and decides; putting
//! memory and threads there is [`crate::memory::numa`]'s.
//!
//! Files read, under a sysfs root (`/sys`, or `$PINPOOL_SYSFS_ROOT` so tests can use a fake
//! tree):
//! - `devices/system/node/online` (or the `node<N>` directories): how many nodes;
//! - `bus/pci/devices/<bus id>/numa_node`: the GPU's node (`-1`: the kernel does not know);
//! - `devices/system/node/node<N>/cpulist`: that node's CPUs (`0-3,8-11`).
//!
//! Invariants:
//! - [`decide`] depends only on the root and the bus id it is given (no CUDA), and never
//!   fails: placement is best-effort, so a missing or unreadable file, an unknown node, or a
//!   machine with one node gives [`Decision::Stay`] with the reason, never an error.
//! - A [`Decision::Place`] names a node sysfs lists CPUs for, and those CPUs (sorted, no
//!   repeats, never empty).

use std::path::{Path, PathBuf};

/// The environment variable that moves the sysfs root (for tests).
pub const SYSFS_ROOT_ENV: &str = "PINPOOL_SYSFS_ROOT";

/// The sysfs root: `$PINPOOL_SYSFS_ROOT` when set and not blank, else `/sys`.
pub fn sysfs_root() -> PathBuf {
    match std::env::var_os(SYSFS_ROOT_ENV) {
        Some(root) if !root.is_empty() => PathBuf::from(root),
        _ => PathBuf::from("/sys"),
    }
}

/// Where an arena for one GPU goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// On this node, with its threads on these CPUs.
    Place {
        /// The NUMA node of the GPU.
        node: usize,
        /// That node's CPUs, sorted, never empty.
        cpus: Vec<usize>,
        /// The GPU, as sysfs names it (`0000:41:00.0`).
        bus_id: String,
    },
    /// Wherever the kernel puts it.
    Stay {
        /// Why (a clause: "one NUMA node").
        reason: String,
        /// Whether the machine has more than one node (then staying put may cost bandwidth,
        /// and is worth a note).
        several_nodes: bool,
    },
}

/// The node an arena for the GPU at PCI address `bus_id` belongs on, read from the sysfs tree
/// at `root` (see the module's note).
pub fn decide(root: &Path, bus_id: &str) -> Decision {
    let stay = |reason: String, several_nodes: bool| Decision::Stay { reason, several_nodes };
    match node_count(root) {
        Some(n) if n > 1 => {}
        Some(_) => return stay("one NUMA node".into(), false),
        None => {
            let dir = root.join("devices/system/node");
            return stay(
                format!("the NUMA layout is unknown (nothing in {})", dir.display()),
                false,
            );
        }
    }
    let Some(bus_id) = normalise_bus_id(bus_id) else {
        return stay(format!("the GPU's PCI address {bus_id:?} is not understood"), true);
    };
    let path = root.join("bus/pci/devices").join(&bus_id).join("numa_node");
    let node = match read(&path) {
        Ok(text) => match text.trim().parse::<i64>() {
            Ok(n) if n >= 0 => n as usize,
            Ok(_) => {
                return stay(
                    format!(
                        "the kernel does not know GPU {bus_id}'s NUMA node ({} is -1)",
                        path.display()
                    ),
                    true,
                )
            }
            Err(_) => {
                return stay(format!("{} says {:?}, not a node", path.display(), text.trim()), true)
            }
        },
        Err(why) => return stay(why, true),
    };
    let path = root.join(format!("devices/system/node/node{node}/cpulist"));
    let cpus = match read(&path) {
        Ok(text) => match parse_cpulist(&text) {
            Some(cpus) if !cpus.is_empty() => cpus,
            Some(_) => return stay(format!("GPU {bus_id}'s NUMA node {node} has no CPUs"), true),
            None => {
                return stay(
                    format!("{} says {:?}, not a CPU list", path.display(), text.trim()),
                    true,
                )
            }
        },
        Err(why) => return stay(why, true),
    };
    Decision::Place { node, cpus, bus_id }
}

/// How many NUMA nodes the machine has: `devices/system/node/online` (a node list), else the
/// `node<N>` directories; None when neither can be read.
pub fn node_count(root: &Path) -> Option<usize> {
    let dir = root.join("devices/system/node");
    if let Some(nodes) =
        std::fs::read_to_string(dir.join("online")).ok().and_then(|t| parse_cpulist(&t))
    {
        if !nodes.is_empty() {
            return Some(nodes.len());
        }
    }
    let entries = std::fs::read_dir(&dir).ok()?;
    let count = entries
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("node")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    (count > 0).then_some(count)
}

/// Reads a small sysfs file; the error is a clause saying which file could not be read.
fn read(path: &Path) -> std::result::Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{} cannot be read ({e})", path.display()))
}

/// A PCI address in the form sysfs names devices by: `dddd:bb:dd.f`, lower case, with a
/// four-digit domain (the driver may write `00000000:41:00.0` or upper case, or leave the
/// domain out). None when `raw` is not a PCI address.
pub fn normalise_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let (rest, function) = raw.rsplit_once('.')?;
    let fields: Vec<&str> = rest.split(':').collect();
    let (domain, bus, device) = match fields.as_slice() {
        [domain, bus, device] => (*domain, *bus, *device),
        [bus, device] => ("0", *bus, *device),
        _ => return None,
    };
    let hex = |text: &str, max_digits: usize| -> Option<u32> {
        let ok = !text.is_empty()
            && text.len() <= max_digits
            && text.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| u32::from_str_radix(text, 16).ok()).flatten()
    };
    let domain = hex(domain, 8)?;
    let bus = hex(bus, 2)?;
    let device = hex(device, 2).filter(|&d| d < 32)?;
    let function = hex(function, 1).filter(|&f| f < 8)?;
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// Parses a kernel CPU or node list (`0-3,8-11`, `5`, or blank for none) into sorted numbers
/// without repeats; None when it is not one.
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    /// More CPUs than any machine has: a range past it is a misreading, not a list.
    const MAX_CPUS: usize = 1 << 20;
    let mut cpus = Vec::new();
    for item in text.trim().split(',').filter(|item| !item.trim().is_empty()) {
        let item = item.trim();
        let (first, last) = match item.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?),
            None => {
                let n = item.parse::<usize>().ok()?;
                (n, n)
            }
        };
        if first > last || last >= MAX_CPUS {
            return None;
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// Writes sorted CPU numbers back as a list: `[0, 1, 2, 3, 8]` as `0-3,8`.
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut iter = cpus.iter().copied().peekable();
    while let Some(first) = iter.next() {
        let mut last = first;
        while iter.peek() == Some(&(last + 1)) {
            last += 1;
            iter.next();
        }
        out.push(if first == last { first.to_string() } else { format!("{first}-{last}") });
    }
    out.join(",")
}

#[cfg(test)]
mod tests;
