#!/usr/bin/env bash
# The memory-protection-key paths (src/pkeys.rs, windows opened keyed) on a machine whose CPU
# has no `pku`: a virtual machine under QEMU's emulation of it (TCG, `-cpu max`), booting
# Debian's kernel, with this machine's root shared read-only (9p) and the tests run inside it
# with PINPOOL_REQUIRE_PKEYS=1 (a keyed test that finds no key fails instead of passing).
#
#   tests/pkeys_vm.sh rust             # the Rust unit tests (cargo's test binary)
#   tests/pkeys_vm.sh python ARGS...   # pytest ARGS with the checkout's .venv (make build first)
#
# Needs Debian's qemu-system-x86, busybox-static and cpio (installed when missing, as root) and
# downloads the kernel package into .pkeys-vm/ (git-ignored). The emulated CPU is some 20
# times slower than this one: importing torch takes about a minute there.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$repo/.pkeys-vm
mkdir -p "$work"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] || command -v busybox >/dev/null || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi

# Debian's generic kernel: memory protection keys built in, 9p and virtio as modules.
if [ ! -d "$work/kernel" ]; then
  image=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
  (cd "$work" && apt-get download -q "$image" >/dev/null 2>&1)
  dpkg -x "$work"/"$image"_*.deb "$work/kernel"
fi
vmlinuz=$(ls "$work"/kernel/boot/vmlinuz-* | head -1)
modules=$(ls -d "$work"/kernel/lib/modules/* | head -1)

root=$work/initramfs
rm -rf "$root"
mkdir -p "$root"/{bin,proc,dev,mnt,mods}
cp "$(command -v busybox)" "$root/bin/busybox"
for a in sh insmod mount chroot poweroff cat grep tr; do ln -s busybox "$root/bin/$a"; done
order="virtio virtio_ring virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci"
order="$order netfs fscache 9pnet 9pnet_virtio 9p"
for m in $order; do
  f=$(find "$modules" -name "$m.ko" | head -1)
  if [ -n "$f" ]; then cp "$f" "$root/mods/"; fi
done

case ${1:-} in
  rust)
    shift
    bin=$(cargo test -q --lib --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "pinpool":
        print(m["executable"])' | tail -1)
    cmd="$bin --test-threads 2 $(printf '%q ' "$@")"
    ;;
  python)
    shift
    cmd="timeout 3000 .venv/bin/python -m pytest -q -p no:cacheprovider $(printf '%q ' "$@")"
    ;;
  *)
    echo "usage: $0 rust [FILTER...] | python PYTEST-ARGS..." >&2
    exit 2
    ;;
esac

# Inside: this machine's root, read-only, with a /proc, /dev, /tmp and /dev/shm of its own.
# (Only /proc is mounted inside the chroot: over 9p the host's mount points share inode
# numbers, and a second file system mounted there would land on the first.)
cat >"$root/init" <<EOF
#!/bin/sh
mount -t proc proc /proc
mount -t devtmpfs dev /dev
for m in $order; do [ -f /mods/\$m.ko ] && insmod /mods/\$m.ko; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose host /mnt
mount -t devtmpfs dev /mnt/dev
mount -t tmpfs tmp /mnt/tmp
mkdir -p /mnt/dev/shm && mount -t tmpfs shm /mnt/dev/shm
echo "cpu: \$(grep -m1 -o -w -E 'pku|ospke' /proc/cpuinfo | tr '\n' ' ')"
cat > /mnt/tmp/run.sh <<'EOR'
mount -t proc proc /proc
export HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PINPOOL_REQUIRE_PKEYS=1
cd $repo
$cmd
echo "exit status: \$?"
EOR
chroot /mnt /bin/sh /tmp/run.sh 2>&1
poweroff -f
EOF
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1 >"$work/initramfs.gz")

log=$work/console.log
qemu-system-x86_64 -cpu max -smp "$(nproc)" -m 6144 -nographic -no-reboot \
  -kernel "$vmlinuz" -initrd "$work/initramfs.gz" \
  -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on \
  -append "console=ttyS0 quiet panic=-1" 2>&1 | tr -d '\r' | tee "$log" | sed -n '/^cpu: /,$p'
grep -q '^cpu: pku ospke' "$log" || { echo "the emulated CPU has no protection keys" >&2; exit 1; }
grep -q '^exit status: 0$' "$log"
