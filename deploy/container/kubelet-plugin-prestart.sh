#!/usr/bin/env bash
# /usr/bin/kubelet-plugin-prestart.sh: the init container of NVIDIA's kubelet-plugin DaemonSet runs this
# (`command: [bash, /usr/bin/kubelet-plugin-prestart.sh]`) and the plugin starts only once it exits 0.
#
# It waits until the NVIDIA driver under the driver root is usable: libnvidia-ml.so.1 and nvidia-smi are
# there and `env -i LD_PRELOAD=<libnvidia-ml.so.1> <nvidia-smi> --version` succeeds. On a GPU Operator node
# the driver container installs the driver after boot, so this can take minutes; every attempt logs what
# it found, and every HINT_EVERY-th attempt adds a hint about the chart value nvidiaDriverRoot.
# Facts: ../shared/reference/nvidia-image-contract.md ("Executables inside the image").
#
# Environment (the chart's):
#   NVIDIA_DRIVER_ROOT   the driver root on the host: "/" (host install) or e.g. /run/nvidia/driver (default "/")
# The chart mounts the driver root's parent at /driver-root-parent (HostToContainer, so a driver mounted later
# shows). Knobs with defaults for the container, set by tests only:
#   DRIVER_ROOT_PARENT   where that parent is mounted (default /driver-root-parent)
#   DRIVER_ROOT_LINK     the link made to the driver root inside this container (default /driver-root)
#   WAIT_SECONDS         pause between attempts (default 10)
#   HINT_EVERY           attempts between hints (default 6)
set -u

driver_root="${NVIDIA_DRIVER_ROOT:-/}"
parent="${DRIVER_ROOT_PARENT:-/driver-root-parent}"
link="${DRIVER_ROOT_LINK:-/driver-root}"
wait_seconds="${WAIT_SECONDS:-10}"
hint_every="${HINT_EVERY:-6}"

log() {
    printf '%s kubelet-plugin-prestart: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*"
}

# The driver root as this container sees it: the parent mount itself for "/", else its last component there.
trimmed="${driver_root%/}"
if [ -z "$trimmed" ]; then
    target="$parent"
else
    target="$parent/${trimmed##*/}"
fi
# A link named like the plugin's mount makes the logs read as the plugin sees the paths; where the image's
# root file system is read-only (or the user cannot write /), the target is used directly.
if ln -sfn "$target" "$link" 2>/dev/null; then
    root="$link"
else
    root="$target"
fi
log "NVIDIA_DRIVER_ROOT=$driver_root; looking for the driver under $root (-> $target)"

find_first() {  # find_first NAME DIR... : print the first ROOT/DIR/NAME that exists
    local name="$1" dir
    shift
    for dir in "$@"; do
        if [ -e "$root/$dir/$name" ]; then
            printf '%s\n' "$root/$dir/$name"
            return 0
        fi
    done
    return 1
}

attempt=0
while :; do
    attempt=$((attempt + 1))
    smi="$(find_first nvidia-smi opt/bin usr/bin usr/sbin bin sbin)"
    nvml="$(find_first libnvidia-ml.so.1 usr/lib64 usr/lib/x86_64-linux-gnu usr/lib/aarch64-linux-gnu \
        lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)"
    if [ -n "$smi" ] && [ -n "$nvml" ]; then
        if output="$(env -i LD_PRELOAD="$nvml" "$smi" --version 2>&1)"; then
            log "found $smi and $nvml; '$smi --version' succeeded:"
            printf '%s\n' "$output"
            exit 0
        fi
        log "attempt $attempt: found $smi and $nvml, but '$smi --version' failed: ${output//$'\n'/ }"
    else
        log "attempt $attempt: nvidia-smi ${smi:-not found} (opt/bin usr/bin usr/sbin bin sbin), libnvidia-ml.so.1" \
            "${nvml:-not found} (usr/lib64 usr/lib/<arch>-linux-gnu lib64 lib/<arch>-linux-gnu) under $root"
    fi
    if [ $((attempt % hint_every)) -eq 1 ] || [ "$hint_every" -le 1 ]; then
        if [ "$driver_root" = "/" ]; then
            log "hint: waiting for a driver installed on the host under /. If the GPU Operator's driver container" \
                "manages the driver, install the chart with nvidiaDriverRoot=/run/nvidia/driver."
        else
            log "hint: waiting for the driver under the host path $driver_root (chart value nvidiaDriverRoot)." \
                "If the driver is installed on the host itself, use nvidiaDriverRoot=/."
        fi
    fi
    sleep "$wait_seconds"
done
