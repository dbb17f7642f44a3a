#!/usr/bin/env bash
# /usr/bin/kubelet-plugin-prestart.sh: the init container of NVIDIA's kubelet-plugin DaemonSet runs this
# (`command: [bash, /usr/bin/kubelet-plugin-prestart.sh]`) and the plugin starts only once it exits 0.
#
# It reports, once, whether the NVIDIA driver under the driver root is usable: libnvidia-ml.so.1 and nvidia-smi
# are there and `env -i LD_PRELOAD=<libnvidia-ml.so.1> <nvidia-smi> --version` succeeds; when it is not, what it
# found and a hint about the chart value nvidiaDriverRoot. It never waits and always exits 0: the plugin starts
# without the driver (it unprepares the claims of pods evicted during a driver upgrade, refuses prepares with the
# reason and picks the driver up when it appears), so a driver reinstall never deadlocks on their Unprepare.
#
# Environment (the chart's):
#   NVIDIA_DRIVER_ROOT   the driver root on the host: "/" (host install) or e.g. /run/nvidia/driver (default "/")
# The chart mounts the driver root's parent at /driver-root-parent (HostToContainer, so a driver mounted later
# shows). Knobs with defaults for the container, set by tests only:
#   DRIVER_ROOT_PARENT   where that parent is mounted (default /driver-root-parent)
#   DRIVER_ROOT_LINK     the link made to the driver root inside this container (default /driver-root)
set -u

driver_root="${NVIDIA_DRIVER_ROOT:-/}"
parent="${DRIVER_ROOT_PARENT:-/driver-root-parent}"
link="${DRIVER_ROOT_LINK:-/driver-root}"

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

smi="$(find_first nvidia-smi opt/bin usr/bin usr/sbin bin sbin)"
nvml="$(find_first libnvidia-ml.so.1 usr/lib64 usr/lib/x86_64-linux-gnu usr/lib/aarch64-linux-gnu \
    lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)"
if [ -n "$smi" ] && [ -n "$nvml" ]; then
    if output="$(env -i LD_PRELOAD="$nvml" "$smi" --version 2>&1)"; then
        log "found $smi and $nvml; '$smi --version' succeeded:"
        printf '%s\n' "$output"
        exit 0
    fi
    log "found $smi and $nvml, but '$smi --version' failed: ${output//$'\n'/ }"
else
    log "nvidia-smi ${smi:-not found} (opt/bin usr/bin usr/sbin bin sbin), libnvidia-ml.so.1" \
        "${nvml:-not found} (usr/lib64 usr/lib/<arch>-linux-gnu lib64 lib/<arch>-linux-gnu) under $root"
fi
if [ "$driver_root" = "/" ]; then
    log "hint: no usable driver installed on the host under /. If the GPU Operator's driver container manages" \
        "the driver, install the chart with nvidiaDriverRoot=/run/nvidia/driver."
else
    log "hint: no usable driver under the host path $driver_root (chart value nvidiaDriverRoot) yet." \
        "If the driver is installed on the host itself, use nvidiaDriverRoot=/."
fi
log "starting the plugin without the driver: it unprepares claims, refuses prepares until the driver is" \
    "usable, and picks it up without a restart"
exit 0
