"""Where the arena goes on a machine with several NUMA nodes: on its GPU's node, with the copy
threads on that node's CPUs (issue #13). The placement logic itself is tested in Rust on fake
sysfs trees (``src/system/topology.rs``, ``src/memory/numa.rs``); here, the pool as Python sees it.

Without a GPU there is nothing to place (host memory belongs to no GPU): those tests are marked
``cuda``. One of them runs on any GPU machine, with a fake sysfs tree
(``$PINPOOL_SYSFS_ROOT``) that claims two nodes; the other needs a real machine with two or
more nodes and skips, saying so, elsewhere.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import pinpool

MiB = 1 << 20
SYS = Path("/sys")


def parse_cpulist(text: str) -> list[int]:
    """A kernel CPU or node list (``0-3,8``) as sorted numbers."""
    out: set[int] = set()
    for item in text.strip().split(","):
        if not item.strip():
            continue
        first, _, last = item.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return sorted(out)


def format_cpulist(cpus: list[int]) -> str:
    """Sorted CPU numbers as a kernel list, the way pinpool writes them (``0-3,8``)."""
    parts: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def online_nodes() -> list[int]:
    try:
        return parse_cpulist((SYS / "devices/system/node/online").read_text())
    except OSError:
        return []


def arena_pages_by_node(address: int, nbytes: int) -> dict[int, int]:
    """Pages of ``[address, address + nbytes)`` on each node, from ``/proc/self/numa_maps``."""
    pages: dict[int, int] = {}
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        fields = line.split()
        if not (address <= int(fields[0], 16) < address + nbytes):
            continue
        for field in fields[2:]:
            if m := re.fullmatch(r"N(\d+)=(\d+)", field):
                pages[int(m[1])] = pages.get(int(m[1]), 0) + int(m[2])
    return pages


def arena_policies(address: int, nbytes: int) -> set[str]:
    """The memory policies ``/proc/self/numa_maps`` shows for the arena's mappings."""
    lines = Path("/proc/self/numa_maps").read_text().splitlines()
    return {
        line.split()[1] for line in lines if address <= int(line.split()[0], 16) < address + nbytes
    }


def copy_thread_cpus(timeout: float = 10.0, expected: int = 1) -> list[list[int]]:
    """The CPUs each of this process's ``pinpool-copy-*`` threads may run on (waiting for at
    least ``expected`` of them: they pin themselves as they start)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = []
        for task in Path("/proc/self/task").iterdir():
            try:
                if not (task / "comm").read_text().startswith("pinpool-copy-"):
                    continue
                status = (task / "status").read_text()
            except OSError:
                continue  # the thread ended meanwhile
            m = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.MULTILINE)
            if m:
                seen.append(parse_cpulist(m[1]))
        if len(seen) >= expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.01)


# --------------------------------------------------------------------------- any machine


def test_a_host_pool_is_not_placed_and_says_nothing_about_numa(make_pool) -> None:
    pool = make_pool(4096, 2, device="cpu")
    assert pool.placement == "arena not placed: host memory, no GPU"
    assert not any("NUMA" in note for note in pool.notes), pool.notes


def test_a_fake_sysfs_root_never_breaks_a_pool(make_pool, monkeypatch, tmp_path) -> None:
    # Whatever the tree says (here: nothing), building a pool does not fail over it.
    monkeypatch.setenv("PINPOOL_SYSFS_ROOT", str(tmp_path / "missing"))
    pool = make_pool(4096, 2)
    assert pool.placement.startswith("arena not placed"), pool.placement


# --------------------------------------------------------------------------- with a GPU


def fake_two_node_sysfs(root: Path, gpu_node: int, node_cpus: list[int]) -> None:
    """A sysfs tree that claims two NUMA nodes, every real PCI device (so the GPU too) on node
    ``gpu_node``, whose CPUs are ``node_cpus``; the other node gets every other CPU."""
    others = sorted(set(range(os.cpu_count() or 1)) - set(node_cpus))
    node_dir = root / "devices/system/node"
    node_dir.mkdir(parents=True)
    (node_dir / "online").write_text("0-1\n")
    for node, cpus in ((gpu_node, node_cpus), (1 - gpu_node, others)):
        (node_dir / f"node{node}").mkdir()
        (node_dir / f"node{node}/cpulist").write_text(format_cpulist(cpus) + "\n")
    for device in os.listdir(SYS / "bus/pci/devices"):
        (root / "bus/pci/devices" / device).mkdir(parents=True)
        (root / "bus/pci/devices" / device / "numa_node").write_text(f"{gpu_node}\n")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda-register", "cuda-hostalloc"])
def test_on_a_fake_two_node_machine_the_arena_and_copy_threads_go_to_the_gpus_node(
    monkeypatch, tmp_path, backend
) -> None:
    # Node 0 is real on every machine, so the pages really can go there; its "CPUs" are the
    # first half of those this process may use, so pinning is visible.
    allowed = sorted(os.sched_getaffinity(0))
    node_cpus = allowed[: max(1, len(allowed) // 2)]
    fake_two_node_sysfs(tmp_path, 0, node_cpus)
    monkeypatch.setenv("PINPOOL_SYSFS_ROOT", str(tmp_path))
    before = len(copy_thread_cpus(timeout=0))
    pool = pinpool.PinPool(4 * MiB, 4, device=0, backend=backend, copy_threads=2)
    try:
        expected = r"arena on NUMA node 0 \(GPU [0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.\d\)"
        assert re.match(expected, pool.placement), pool.placement
        assert pool.placement.endswith(f"copy threads on CPUs {format_cpulist(node_cpus)}")
        assert not any("NUMA" in note for note in pool.notes), pool.notes
        # The pool's copy threads (the newest) run on the node's CPUs only.
        pinned = [cpus for cpus in copy_thread_cpus(expected=before + 2) if cpus == node_cpus]
        assert len(pinned) >= 2, copy_thread_cpus(timeout=0)
        if backend == "cuda-register":
            # The policy is on the arena's own mappings (a memfd each), before they were filled.
            policies = arena_policies(pool.address, pool.arena_bytes)
            assert policies == {"prefer:0"}, policies
            assert set(arena_pages_by_node(pool.address, pool.arena_bytes)) == {0}
    finally:
        pool.close(wait=True)


@pytest.mark.cuda
def test_on_several_real_nodes_the_arena_lands_on_its_gpus_node() -> None:
    nodes = online_nodes()
    if len(nodes) < 2:
        pytest.skip(f"this machine has {len(nodes)} NUMA node(s); placement needs two or more")
    pool = pinpool.PinPool(64 * MiB, 2, device=0)
    try:
        m = re.match(r"arena on NUMA node (\d+) \(GPU (\S+)\)", pool.placement)
        if m is None:
            # The kernel may not know the GPU's node (-1): then the pool must say so in a note.
            assert any("NUMA" in note for note in pool.notes), (pool.placement, pool.notes)
            pytest.skip(f"the arena was not placed here: {pool.placement}")
        node, bus_id = int(m[1]), m[2]
        assert (SYS / "bus/pci/devices" / bus_id / "numa_node").read_text().strip() == str(node)
        pages = arena_pages_by_node(pool.address, pool.arena_bytes)
        assert set(pages) == {node}, f"pages by node: {pages}, GPU on node {node}"
        cpulist = SYS / f"devices/system/node/node{node}/cpulist"
        node_cpus = set(parse_cpulist(cpulist.read_text()))
        for cpus in copy_thread_cpus(expected=pool.copy_threads):
            if set(cpus) <= node_cpus:
                break
        else:
            pytest.fail(f"no copy thread runs on node {node}'s CPUs: {copy_thread_cpus(timeout=0)}")
    finally:
        pool.close(wait=True)
