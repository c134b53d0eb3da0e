//! How much memory this process could still fault in, so that an arena larger than that is
//! refused before anything is mapped (faulting it in would end in the kernel's out-of-memory
//! killer, not in an error).
//!
//! Invariant: only reads `/proc` and the cgroup (v2) files; `None` when neither can be read,
//! never a guess.

/// Bytes of memory this process could still fault in: the kernel's `MemAvailable`, and,
/// inside a cgroup (v2) with a memory limit, no more than that limit minus what the cgroup
/// already uses. `None` when neither can be read.
pub fn available_memory() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    let cgroup = cgroup_headroom();
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `memory.max` minus the memory in use (`memory.current` less the reclaimable
/// `inactive_file` page cache) of this process's cgroup (v2), if it has a limit.
fn cgroup_headroom() -> Option<usize> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = format!("/sys/fs/cgroup{path}");
    let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).ok();
    let max: usize = read("memory.max")?.trim().parse().ok()?; // "max" (no limit) fails here
    let current: usize = read("memory.current")?.trim().parse().ok()?;
    let inactive_file: usize = read("memory.stat")
        .and_then(|stat| {
            let line = stat.lines().find(|l| l.starts_with("inactive_file "))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(inactive_file)))
}
