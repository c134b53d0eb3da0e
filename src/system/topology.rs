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
mod tests {
    use super::*;

    /// A fake sysfs tree in a fresh temporary directory, removed on drop.
    struct FakeSysfs {
        root: PathBuf,
    }

    impl FakeSysfs {
        fn new(name: &str) -> Self {
            let root =
                std::env::temp_dir().join(format!("pinpool-sysfs-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            FakeSysfs { root }
        }

        fn write(&self, path: &str, text: &str) -> &Self {
            let path = self.root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
            self
        }

        /// Two nodes of 8 CPUs each (the second's split in two ranges), the GPU
        /// `0000:41:00.0` on node `gpu_node`.
        fn two_nodes(name: &str, gpu_node: &str) -> Self {
            let fake = FakeSysfs::new(name);
            fake.write("devices/system/node/online", "0-1\n")
                .write("devices/system/node/node0/cpulist", "0-3,16-19\n")
                .write("devices/system/node/node1/cpulist", "4-7,20-23\n")
                .write("bus/pci/devices/0000:41:00.0/numa_node", &format!("{gpu_node}\n"));
            fake
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    // Miri: reads files, which isolation forbids.
    #[cfg_attr(miri, ignore)]
    fn two_nodes_place_the_arena_on_the_gpus_node_with_its_cpus() {
        let fake = FakeSysfs::two_nodes("two", "1");
        // The driver's spellings of the address all name the same sysfs directory.
        for bus_id in [
            "0000:41:00.0",
            "00000000:41:00.0",
            "0000:41:00.0\n",
            "41:00.0",
            "0000:41:00.0".to_uppercase().as_str(),
        ] {
            let expected = Decision::Place {
                node: 1,
                cpus: vec![4, 5, 6, 7, 20, 21, 22, 23],
                bus_id: "0000:41:00.0".into(),
            };
            assert_eq!(decide(&fake.root, bus_id), expected, "{bus_id:?}");
        }
        let on_zero = FakeSysfs::two_nodes("two-zero", "0");
        let Decision::Place { node, cpus, .. } = decide(&on_zero.root, "0000:41:00.0") else {
            panic!("not placed")
        };
        assert_eq!((node, format_cpulist(&cpus)), (0, "0-3,16-19".to_string()));
    }

    #[test]
    // Miri: reads files, which isolation forbids.
    #[cfg_attr(miri, ignore)]
    fn one_node_places_nothing_and_says_so_quietly() {
        let fake = FakeSysfs::new("one");
        fake.write("devices/system/node/online", "0\n")
            .write("devices/system/node/node0/cpulist", "0-7\n")
            .write("bus/pci/devices/0000:41:00.0/numa_node", "0\n");
        let d = decide(&fake.root, "0000:41:00.0");
        assert_eq!(d, Decision::Stay { reason: "one NUMA node".into(), several_nodes: false });
    }

    #[test]
    // Miri: reads files, which isolation forbids.
    #[cfg_attr(miri, ignore)]
    fn the_node_count_falls_back_on_the_node_directories() {
        let fake = FakeSysfs::new("dirs");
        fake.write("devices/system/node/node0/cpulist", "0-1\n")
            .write("devices/system/node/node1/cpulist", "2-3\n")
            .write("devices/system/node/possible", "0-7\n")
            .write("bus/pci/devices/0000:41:00.0/numa_node", "1\n");
        assert_eq!(node_count(&fake.root), Some(2));
        assert!(matches!(decide(&fake.root, "0000:41:00.0"), Decision::Place { node: 1, .. }));
    }

    #[test]
    // Miri: reads files, which isolation forbids.
    #[cfg_attr(miri, ignore)]
    fn missing_or_odd_files_place_nothing_and_never_fail() {
        let stays = |fake: &FakeSysfs, bus_id: &str, needle: &str, several: bool| {
            let Decision::Stay { reason, several_nodes } = decide(&fake.root, bus_id) else {
                panic!("placed although {needle}")
            };
            assert!(reason.contains(needle), "{reason:?} does not say {needle:?}");
            assert_eq!(several_nodes, several, "{reason}");
        };
        // Nothing at all: a kernel without NUMA, or no sysfs.
        let empty = FakeSysfs::new("empty");
        stays(&empty, "0000:41:00.0", "unknown", false);
        // The GPU's node unknown to the kernel, or the GPU missing from the tree.
        stays(&FakeSysfs::two_nodes("minus-one", "-1"), "0000:41:00.0", "-1", true);
        stays(&FakeSysfs::two_nodes("other-gpu", "1"), "0000:42:00.0", "0000:42:00.0", true);
        stays(&FakeSysfs::two_nodes("garbage", "one"), "0000:41:00.0", "not a node", true);
        stays(&FakeSysfs::two_nodes("bad-id", "1"), "GPU-1234", "not understood", true);
        // The node's CPU list missing, unreadable or empty.
        let no_cpus = FakeSysfs::two_nodes("no-cpus", "1");
        std::fs::remove_file(no_cpus.root.join("devices/system/node/node1/cpulist")).unwrap();
        stays(&no_cpus, "0000:41:00.0", "cpulist", true);
        let empty_cpus = FakeSysfs::two_nodes("empty-cpus", "1");
        empty_cpus.write("devices/system/node/node1/cpulist", "\n");
        stays(&empty_cpus, "0000:41:00.0", "no CPUs", true);
        let bad_cpus = FakeSysfs::two_nodes("bad-cpus", "1");
        bad_cpus.write("devices/system/node/node1/cpulist", "7-4\n");
        stays(&bad_cpus, "0000:41:00.0", "not a CPU list", true);
    }

    #[test]
    // Miri: reads the environment and files.
    #[cfg_attr(miri, ignore)]
    fn this_machine_never_fails_to_decide() {
        // Whatever this machine is, deciding for a GPU that is not there is not an error.
        match decide(&sysfs_root(), "0000:ff:1f.7") {
            Decision::Stay { reason, .. } => assert!(!reason.is_empty()),
            Decision::Place { .. } => panic!("placed for a GPU that does not exist"),
        }
    }

    #[test]
    fn cpulists_parse_and_print_back() {
        assert_eq!(parse_cpulist("0-3,8-11\n"), Some(vec![0, 1, 2, 3, 8, 9, 10, 11]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist(" 3, 1-2 ,1\n"), Some(vec![1, 2, 3]));
        assert_eq!(parse_cpulist("\n"), Some(vec![]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        for bad in ["a", "3-1", "1-", "-2", "0-99999999", "1;2"] {
            assert_eq!(parse_cpulist(bad), None, "{bad:?}");
        }
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 9, 10, 11]), "0-3,8-11");
        assert_eq!(format_cpulist(&[5]), "5");
        assert_eq!(format_cpulist(&[1, 3, 4]), "1,3-4");
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn bus_ids_are_normalised_to_the_sysfs_form() {
        assert_eq!(normalise_bus_id("0000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalise_bus_id("00000000:3b:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalise_bus_id("3b:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalise_bus_id("0001:c1:1f.7").as_deref(), Some("0001:c1:1f.7"));
        assert_eq!(normalise_bus_id("10000:01:00.0").as_deref(), Some("10000:01:00.0"));
        for bad in [
            "",
            "0000:3b:00",
            "0000:3b:00.8",
            "0000:3b:20.0",
            "0000:3b:00:00.0",
            "0000:xyz:00.0",
            "GPU-0",
        ] {
            assert_eq!(normalise_bus_id(bad), None, "{bad:?}");
        }
    }
}
