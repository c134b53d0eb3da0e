//! Unit tests of `topology`, kept apart from the code they test.

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
