"""``dradriver inspect``: print the ResourceSlices this node would publish.

Reads NVML (the system library, ``--nvml-library PATH``, or the bundled mock with ``--mock-profile NAME``),
discovers GPUs and MIG devices, and prints the ``resource.k8s.io/v1`` ResourceSlices as a YAML multi-document
stream (``-o yaml``, default) or a JSON list (``-o json``), each with the ``metadata.generateName`` the running
plugin gives it (``<index>-gpu.nvidia.com-<node>-``; the API server appends five random characters).
``-o table`` prints one line per published device instead: NODE, DEVICE, GPU (minor number of the physical
GPU), MIG (profile, ``-`` for a full GPU, ``vfio`` for a VFIO passthrough device ``gpu-vfio-<index>``), MEMORY
(a VFIO device's ``addressableMemory``), UUID, HEALTH (``Healthy``, ``Unhealthy`` or ``Unknown`` from one health
poll, as the plugin's health monitor judges it; a VFIO device is always ``Unknown``); ``-o wide`` adds PRODUCT,
PCI-BUS-ID, SLICE and TAINTS
(``key`` or ``key=value``, e.g. ``gpu.nvidia.com/fabric-unhealthy=registration-failed``).
GPUs left out by discovery and other warnings go to stderr and, in YAML, also into comments at the top.
``--default-config PROFILE`` applies a per-node device policy as the plugin would on a node whose label
``nvidia.com/dra-driver-gpu.config`` names PROFILE: the file PROFILE of ``--driver-config-directory``
(``version: v1alpha1``, ``gpu.advertisedDeviceTypes``) limits the devices printed to the types it advertises.
The plugin's options that decide what it publishes are taken with the plugin's names and environment twins:
``--feature-gates`` (``FEATURE_GATES``; with ``DynamicMIG=true`` the slices carry every MIG placement and the
counter sets they consume) and ``--consumable-shares`` (``CONSUMABLE_SHARES``; with the gate ``ConsumableShares``
every device is multi-allocatable with its request policies) and the KEP-5517 node-allocatable overhead flags
``--node-allocatable-<gpu|mig|vfio>-<cpu|memory>-overhead-per-<pod|container>`` (``NODE_ALLOCATABLE_*``; with the gate
``NodeAllocatableResources`` each full GPU and MIG device carries its class's ``nodeAllocatableResources``, and the
YAML header names the overhead). The slices are built by the very functions the
running plugin uses (discovery, then :func:`dradriver.domain.pools.build`). Their layout depends on the
API server's version, which the plugin reads from ``GET /version``: ``--kubernetes-version MAJOR.MINOR``
(default: the newest layout, 1.35, where a dynamic-MIG GPU's counter set and its devices are in separate slices;
give ``1.34`` for the combined layout of older API servers).
``--driver compute-domain.nvidia.com`` prints the compute-domain kubelet plugin's slices instead (the same
function builds them): ``channel-0`` and, unless ``--imex-mode hostManaged`` (``IMEX_MODE``), ``daemon-0``, each
tainted ``compute-domain.nvidia.com/fabric-unhealthy`` while the node's NVLink fabric is faulty (read as the
plugin reads it, strictly with the gate ``CrashOnNVLinkFabricErrors``); with ``--imex-isolation channel``
(``IMEX_ISOLATION``, implied by ``--imex-mode preWarmed``) every channel of the node, ``channel-0`` ..
``channel-<ImexChannelCount-1>`` (``<--proc-root>/driver/nvidia/params``, as the plugin reads it; 2048 when it
cannot be read, with a note); with ``--binding-conditions`` (``BINDING_CONDITIONS``) each channel carries the
KEP-5007 binding conditions ``ComputeDomainReady`` / ``ComputeDomainFailed`` and ``bindsToNode``. With the GPU
plugin's slices they are the input ``dradriver allocate``/``explain`` need for ComputeDomain workloads.
Exit status: 0 on success, 1 when NVML cannot be loaded or initialised, 2 for a ``--node-name`` that is not a
Node name (an RFC 1123 subdomain), a malformed ``--kubernetes-version``, a gate or share mode the plugin would
refuse, or a profile that cannot be used (unknown, or invalid: the field is named).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

from dradriver.config import COMPUTE_DOMAIN_PLUGIN_FLAGS, PLUGIN_FLAGS, PUBLICATION_FLAGS, add_flags
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, GPU_DRIVER
from dradriver.domain.partitions import SPLIT_LAYOUT_SINCE

_FLAGS = ("--node-name", "--nvml-library", "--mock-profile", "--sysfs-root", "--proc-root", "--default-config",
          "--driver-config-directory")
_CD_FLAGS = ("--imex-mode", "--imex-isolation", "--binding-conditions")
_KUBERNETES_VERSION = re.compile(r"^v?(\d+)\.(\d+)(\.\d+)?$")


def kubernetes_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of ``--kubernetes-version`` (``1.34``, ``v1.35.0``).

    :raises argparse.ArgumentTypeError: not ``MAJOR.MINOR[.PATCH]``.
    """
    found = _KUBERNETES_VERSION.match(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Kubernetes version such as 1.34 or v1.35.0")
    return int(found.group(1)), int(found.group(2))


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand (flags: ``--output``, ``--node-name``, ``--nvml-library``,
    ``--mock-profile``, ``--sysfs-root``, ``--default-config``, ``--driver-config-directory``, the plugin's
    :data:`~dradriver.config.PUBLICATION_FLAGS`, each with its environment twin, ``--kubernetes-version``,
    ``--driver``, ``--proc-root`` and the compute-domain plugin's ``--imex-mode``, ``--imex-isolation`` and
    ``--binding-conditions``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="print the ResourceSlices this node would publish",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output", "-o", choices=("yaml", "json", "table", "wide"), default="yaml",
        help="yaml (default), json, table (one line per device) or wide (table plus product, PCI bus ID, slice, "
             "taints)"
    )
    add_flags(parser, [f for f in PLUGIN_FLAGS if f.option in _FLAGS])
    add_flags(parser, [f for f in PLUGIN_FLAGS if f.option in PUBLICATION_FLAGS])
    parser.add_argument(
        "--driver", choices=(GPU_DRIVER.driver_name, COMPUTE_DOMAIN_DRIVER.driver_name),
        default=GPU_DRIVER.driver_name,
        help="whose slices to print: the GPU kubelet plugin's (default) or the compute-domain kubelet plugin's"
    )
    add_flags(parser, [f for f in COMPUTE_DOMAIN_PLUGIN_FLAGS if f.option in _CD_FLAGS])
    newest = ".".join(map(str, SPLIT_LAYOUT_SINCE))
    parser.add_argument(
        "--kubernetes-version", type=kubernetes_version, default=SPLIT_LAYOUT_SINCE, metavar="MAJOR.MINOR",
        help=f"the API server version whose ResourceSlice layout to print, as the plugin reads it from GET /version "
             f"(default {newest}, the newest layout; 1.34 and older: a dynamic-MIG GPU's counter set and devices "
             "share one slice)"
    )
    parser.set_defaults(func=run)


def _header(inventory: Any, node: str, slices: list[dict[str, Any]], notes: list[str]) -> list[str]:
    devices = sum(len(s["spec"]["devices"]) for s in slices)
    vfio = f", {len(inventory.vfio)} VFIO device(s)" if inventory.vfio else ""
    lines = [
        f"# node {node}: driver {inventory.versions.driver or '?'}, CUDA {inventory.versions.cuda_driver_text}, "
        f"{len(inventory.gpus)} GPU(s), {len(inventory.migs)} MIG device(s){vfio}; {devices} device(s) in "
        f"{len(slices)} ResourceSlice(s)",
    ]
    if inventory.clique is not None:
        lines.append(f"# fabric clique: {inventory.clique.id}")
    lines += [f"# {note}" for note in notes]
    return lines


def _memory(device: dict[str, Any]) -> str:
    capacity = device.get("capacity", {})
    value = (capacity.get("memory") or capacity.get("addressableMemory") or {}).get("value")
    return str(value) if value is not None else "-"


def _attribute(device: dict[str, Any], name: str) -> str:
    value = device.get("attributes", {}).get(name) or {}
    return str(next(iter(value.values()), "-")) if value else "-"


def _taints(device: dict[str, Any]) -> str:
    """The published taints of ``device`` as ``key`` or ``key=value`` joined by ``,`` (devices the health monitor
    does not watch: the compute-domain plugin's)."""
    return ",".join(f"{t['key']}={t['value']}" if t.get("value") else str(t["key"]) for t in device.get("taints", []))


def device_rows(inventory: Any, node: str, slices: list[dict[str, Any]], health: dict[str, tuple[str, str]], *,
                wide: bool) -> list[tuple[str, ...]]:
    """The ``table``/``wide`` rows, header first: one per published device, in slice order.

    :param health: device name -> (health word, taints as ``key`` or ``key=value`` joined by ``,``), from
        :func:`poll_health`; a device it does not name is ``Unknown`` with the taints it is published with.
    """
    from dradriver.domain.devices import MigDevice
    from dradriver.domain.passthrough import VfioDevice
    from dradriver.domain.resourceslices import PCI_BUS_ID

    header = ["NODE", "DEVICE", "GPU", "MIG", "MEMORY", "UUID", "HEALTH"]
    if wide:
        header += ["PRODUCT", "PCI-BUS-ID", "SLICE", "TAINTS"]
    rows: list[tuple[str, ...]] = [tuple(header)]
    for s in slices:
        for device in s["spec"]["devices"]:
            found = inventory.find(device["name"])
            if isinstance(found, VfioDevice):
                minor = "-" if found.parent_minor is None else str(found.parent_minor)
                kind = "vfio"
            else:
                gpu = found.parent if isinstance(found, MigDevice) else found
                minor = str(gpu.minor) if gpu is not None else "-"
                kind = found.profile if isinstance(found, MigDevice) else "-"
            state, taints = health.get(device["name"], ("Unknown", _taints(device)))
            row = [node, device["name"], minor, kind, _memory(device), _attribute(device, "uuid"), state]
            if wide:
                bus = _attribute(device, "pcieBusID")
                row += [_attribute(device, "productName"), _attribute(device, PCI_BUS_ID) if bus == "-" else bus,
                        s["metadata"].get("name") or s["metadata"].get("generateName", "-"), taints or "-"]
            rows.append(tuple(row))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell and separated by three spaces, as ``kubectl get`` prints them."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows)


def poll_health(inventory: Any, session: Any, node: str) -> dict[str, tuple[str, str]]:
    """One poll by the plugin's health monitor (no event thread): device name -> (health, taints as ``key`` or
    ``key=value`` joined by ``,``).

    A device whose GPU cannot be polled stays ``Unknown``.
    """
    from dradriver.health.monitor import HealthMonitor

    monitor = HealthMonitor(inventory, pool_name=node, session=session)
    try:
        if monitor.poll_now() is None:
            return {}
        monitor.flush()
        return {view.name: (view.health, ",".join(f"{key}={value}" if value else key for key, value, _ in view.taints))
                for view in monitor.devices()}
    finally:
        monitor.stop()


def compute_domain_slices(session: Any, node: str, gates: Any, *, host_managed: bool, channels: int = 1,
                          binding_conditions: bool = False) -> Any:
    """The compute-domain kubelet plugin's slices of ``node`` (:func:`dradriver.domain.computedomains.
    plugin_resource_slices`: ``channels`` channels, NVIDIA's ``channel-0`` only by default; with
    ``binding_conditions`` each channel carries KEP-5007's), tainted as the plugin taints them while the fabric it
    reads through ``session`` is faulty, as a :class:`~dradriver.domain.resourceslices.SliceBuild`.

    :raises dradriver.nvml.fabric.FabricError: the fabric cannot be assessed (a registration in progress in strict
        mode, GPUs in different cliques), as the plugin would not start.
    """
    from dradriver.domain.computedomains import fabric_taints, plugin_resource_slices
    from dradriver.domain.featuregates import CRASH_ON_NVLINK_FABRIC_ERRORS
    from dradriver.domain.resourceslices import SliceBuild
    from dradriver.nvml import fabric

    node_fabric = fabric.assess_node(fabric.read_node_fabric(session), strict=gates[CRASH_ON_NVLINK_FABRIC_ERRORS])
    slices = plugin_resource_slices(node, COMPUTE_DOMAIN_DRIVER.driver_name, daemon=not host_managed,
                                    channels=channels, binding_conditions=binding_conditions,
                                    taints=fabric_taints(COMPUTE_DOMAIN_DRIVER, node_fabric.reason))
    return SliceBuild(slices, [f"fabric: {node_fabric.message}"] if not node_fabric.healthy else [])


def run(args: argparse.Namespace) -> int:
    """Discover, build and print; returns the exit status."""
    import yaml

    from dradriver import _native
    from dradriver.commands._options import node_name_error
    from dradriver.config import CHANNEL_NEEDS_HOST_MANAGED, check_imex_mode, publication_from_args
    from dradriver.domain.driverconfig import EVERYTHING, DriverConfigError
    from dradriver.domain.nodeallocatable import apply_overhead
    from dradriver.domain.pools import build
    from dradriver.domain.resourceslices import ResourceSliceError
    from dradriver.errors import DradriverError
    from dradriver.host.driverconfigs import load_profile
    from dradriver.host.imexchannels import read_channel_count
    from dradriver.kube.resourceslices import slice_generate_name
    from dradriver.nvml.discovery import discover
    from dradriver.nvml.session import open_session

    error = node_name_error("dradriver inspect", args.node_name) if args.node_name else None
    if error:
        print(error, file=sys.stderr)
        return 2
    try:
        gates, shares, overhead = publication_from_args(args)
        check_imex_mode(args.imex_mode, gates)
    except DradriverError as exc:
        print(f"dradriver inspect: {exc}", file=sys.stderr)
        return 2
    if args.imex_isolation == "channel" and args.imex_mode not in ("hostManaged", "preWarmed"):
        print(f"dradriver inspect: {CHANNEL_NEEDS_HOST_MANAGED}", file=sys.stderr)  # as the plugin refuses it
        return 2
    channel_isolation = args.imex_isolation == "channel" or args.imex_mode == "preWarmed"  # pre_warmed_implied
    node = args.node_name or socket.gethostname().strip().lower()  # the kubelet's default Node name
    try:
        policy = load_profile(Path(args.driver_config_directory), args.default_config) if args.default_config \
            else EVERYTHING
    except DriverConfigError as exc:
        print(f"dradriver inspect: error: {exc}", file=sys.stderr)
        return 2
    health: dict[str, tuple[str, str]] = {}
    channel_note = ""
    try:
        _native.load_all()  # the hot paths must be there (or twins asked for): a loud error, not a slow path
        with open_session(args.nvml_library or "", args.mock_profile or "") as session:
            inventory = discover(session, sysfs_root=Path(args.sysfs_root or "/sys"), dynamic_mig=gates.dynamic_mig)
            if args.output in ("table", "wide"):
                health = poll_health(inventory, session, node)
            if args.driver == COMPUTE_DOMAIN_DRIVER.driver_name:
                channels, source = read_channel_count(Path(args.proc_root)) if channel_isolation else (1, "")
                result = compute_domain_slices(session, node, gates, host_managed=args.imex_mode == "hostManaged",
                                               channels=channels, binding_conditions=bool(args.binding_conditions))
                channel_note = f"IMEX channels: {source}" if source else ""
            else:
                result = build(inventory, node, server_version=args.kubernetes_version, shares=shares,
                               advertised=policy.advertised)
                apply_overhead(result.slices, overhead)  # as the plugin publishes them
    except (DradriverError, ResourceSliceError) as exc:
        print(f"dradriver inspect: error: {exc}", file=sys.stderr)
        return 1

    for i, s in enumerate(result.slices):
        s.setdefault("metadata", {})["generateName"] = slice_generate_name(i, len(result.slices), s["spec"]["driver"],
                                                                           node)
    notes = [
        f"discovery failure: GPU index {f.index}{f' ({f.uuid})' if f.uuid else ''} left out: {f.reason}"
        for f in inventory.failures
    ]
    notes += [f"warning: {w}" for w in (*inventory.warnings, *result.warnings)]
    if channel_note:
        notes.append(channel_note)
    if overhead and args.driver == GPU_DRIVER.driver_name:
        notes.append(f"node-allocatable overhead (KEP-5517): {overhead.render()}")
    if policy is not EVERYTHING:
        notes.append(policy.describe().replace("--default-config (env DEFAULT_CONFIG)", "--default-config"))
    for note in notes:
        print(f"dradriver inspect: {note}", file=sys.stderr)

    if args.output in ("table", "wide"):
        sys.stdout.write(format_table(device_rows(inventory, node, result.slices, health,
                                                  wide=args.output == "wide")))
    elif args.output == "json":
        sys.stdout.write(json.dumps(result.slices, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(_header(inventory, node, result.slices, notes)) + "\n")
        sys.stdout.write(yaml.safe_dump_all(result.slices, sort_keys=False, explicit_start=True))
    return 0
