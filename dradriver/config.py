"""Kubelet-plugin configuration: every flag, its environment twin, and the paths derived from them.

:data:`PLUGIN_FLAGS` is the single source of truth. The CLI builds its options from it, and the
DaemonSet in ``deploy/`` sets exactly these environment variables (a test compares both). Flag and
variable names follow NVIDIA's gpu-kubelet-plugin where it has an equivalent (reference:
``nvidia-dra-driver.md`` section 1.1), so existing manifests keep working.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dradriver.domain.featuregates import FeatureGateError, FeatureGates, parse_feature_gates
from dradriver.domain.identity import GPU_DRIVER
from dradriver.domain.shares import ShareMode, ShareModeError, parse_share_mode
from dradriver.errors import FlagError
from dradriver.host.driverfiles import DEFAULT_CDI_HOOK_PATH
from dradriver.host.mounts import MountCommands


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and its environment twin.

    :param option: the long option, e.g. ``--node-name``.
    :param env: the environment variable read when the flag is not given.
    :param default: value used when neither is set; ``None`` means required.
    :param kind: ``str``, ``int``, ``bool`` or ``path``.
    """

    option: str
    env: str
    default: str | int | bool | None
    help: str
    kind: str = "str"
    choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The attribute name on the parsed namespace and on :class:`PluginConfig`."""
        return self.option.removeprefix("--").replace("-", "_")


PLUGIN_FLAGS: tuple[Flag, ...] = (
    Flag("--node-name", "NODE_NAME", None, "Kubernetes Node this plugin serves; also the pool name."),
    Flag("--namespace", "NAMESPACE", "default", "Namespace of the plugin, where MPS control daemon Deployments run."),
    Flag("--image-name", "IMAGE_NAME", "", "The plugin's image, run by the MPS control daemon Deployments; required "
         "with the MPSSupport feature gate."),
    Flag("--kubeconfig", "KUBECONFIG", "", "kubeconfig file; empty means in-cluster configuration.", "path"),
    Flag("--cdi-root", "CDI_ROOT", "/var/run/cdi", "Directory for the per-claim CDI spec files.", "path"),
    Flag(
        "--kubelet-registrar-directory-path",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        "/var/lib/kubelet/plugins_registry",
        "The kubelet's plugin registration directory.",
        "path",
    ),
    Flag(
        "--kubelet-plugins-directory-path",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        "/var/lib/kubelet/plugins",
        "The kubelet's plugins directory; the plugin keeps its sockets and claim state in <dir>/gpu.nvidia.com.",
        "path",
    ),
    Flag(
        "--kubelet-device-plugins-directory-path",
        "KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH",
        "/var/lib/kubelet/device-plugins",
        "Where the kubelet's device plugins put their sockets (for the device-plugin guard).",
        "path",
    ),
    Flag(
        "--nvidia-driver-root",
        "NVIDIA_DRIVER_ROOT",
        "/",
        "Host path of the NVIDIA driver installation; used as the root of host paths in CDI specs.",
        "path",
    ),
    Flag(
        "--container-driver-root",
        "DRIVER_ROOT_CTR_PATH",
        "/driver-root",
        "Where the driver root is mounted inside the plugin's container.",
        "path",
    ),
    Flag(
        "--nvidia-cdi-hook-path",
        "NVIDIA_CDI_HOOK_PATH",
        DEFAULT_CDI_HOOK_PATH,
        "Host path of nvidia-cdi-hook (nvidia-container-toolkit), run by the hooks of claim CDI specs; "
        f"empty means {DEFAULT_CDI_HOOK_PATH}.",
        "path",
    ),
    Flag("--dev-root", "DEV_ROOT", "/", "Root under which /dev device nodes are looked up.", "path"),
    Flag("--sysfs-root", "SYSFS_ROOT", "/sys", "Root of sysfs, for PCIe root and NUMA lookups.", "path"),
    Flag(
        "--proc-root",
        "PROC_ROOT",
        "/proc",
        "Root of procfs: device majors (devices), MIG capability minors (driver/nvidia-caps), boot ID.",
        "path",
    ),
    Flag(
        "--nvml-library",
        "DRADRIVER_NVML_LIBRARY",
        "",
        "Path of libnvidia-ml.so.1; empty means the system's library search path.",
        "path",
    ),
    Flag(
        "--mock-profile",
        "DRADRIVER_MOCK_PROFILE",
        "",
        "Run against the bundled mock NVML library with this profile (see `dradriver mock-profiles`).",
    ),
    Flag("--pod-uid", "POD_UID", "", "This pod's UID; when set, socket names carry it (rolling updates)."),
    Flag(
        "--healthcheck-port",
        "HEALTHCHECK_PORT",
        -1,
        "TCP port of the gRPC health service (grpc.health.v1); -1 disables, 0 picks a free port.",
        "int",
    ),
    Flag(
        "--prepare-deadline-seconds",
        "PREPARE_DEADLINE_SECONDS",
        40,
        "Longest a NodePrepareResources may take, in seconds (1-44, below the kubelet's 45 s; a shorter gRPC "
        "deadline from the kubelet wins). Claims whose ResourceClaim GET has not answered by then get a per-claim "
        "error.",
        "int",
    ),
    Flag(
        "--stale-claim-grace-seconds",
        "STALE_CLAIM_GRACE_SECONDS",
        300,
        "Unprepare a prepared claim whose ResourceClaim is gone, re-created under another UID or no longer "
        "allocated to this node once it has stood so for this long (checked at start and every minute); 0 "
        "disables the cleanup.",
        "int",
    ),
    Flag(
        "--http-endpoint",
        "HTTP_ENDPOINT",
        "",
        "host:port for the Prometheus metrics server, e.g. ':8080'; empty disables.",
    ),
    Flag("--metrics-path", "METRICS_PATH", "/metrics", "HTTP path of the metrics endpoint."),
    Flag(
        "--additional-xids-to-ignore",
        "ADDITIONAL_XIDS_TO_IGNORE",
        "",
        "Comma-separated Xids treated as application errors (no taint), on top of the defaults.",
    ),
    Flag(
        "--ignore-device-plugin",
        "DRADRIVER_IGNORE_DEVICE_PLUGIN",
        False,
        "Publish GPUs even when the NVIDIA device plugin is found on this node (double allocation risk).",
        "bool",
    ),
    Flag(
        "--feature-gates",
        "FEATURE_GATES",
        "",
        "NVIDIA's feature gates, 'Name=true,Other=false,' (see `dradriver feature-gates`); a gate dradriver does not "
        "implement may only be set to NVIDIA's default.",
    ),
    Flag(
        "--consumable-shares",
        "CONSUMABLE_SHARES",
        "disabled",
        "NVIDIA's consumable GPU shares: 'disabled', 'memory', 'unlimited' or a number of shares N; anything but "
        "'disabled' needs the ConsumableShares feature gate. dradriver enforces each claim's share through one MPS "
        "control daemon per shared GPU.",
    ),
    Flag("--log-level", "LOG_LEVEL", "info", "Log level.", "str", ("debug", "info", "warning", "error")),
    Flag("--log-format", "LOG_FORMAT", "text", "Log format.", "str", ("text", "json")),
)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise FlagError(f"not a boolean: {text!r}")


def add_flags(
    parser: argparse.ArgumentParser,
    flags: Sequence[Flag] = PLUGIN_FLAGS,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add ``flags`` to ``parser``; each default comes from its environment twin when that is set.

    :raises FlagError: an environment variable holds a value of the wrong type.
    """
    env = os.environ if environ is None else environ
    for flag in flags:
        raw = env.get(flag.env)
        help_text = f"{flag.help} [env {flag.env}]"
        if flag.kind == "bool":
            default_bool = _parse_bool(raw) if raw is not None else bool(flag.default)
            parser.add_argument(
                flag.option,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=default_bool,
                help=help_text,
            )
            continue
        default: object = flag.default
        if raw is not None:
            if flag.kind == "int":
                try:
                    default = int(raw)
                except ValueError:
                    raise FlagError(f"{flag.env}={raw!r} is not an integer") from None
            else:
                default = raw
        parser.add_argument(
            flag.option,
            dest=flag.dest,
            type=int if flag.kind == "int" else str,
            default=default,
            choices=flag.choices or None,
            help=help_text,
        )


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Validated kubelet-plugin settings; derived paths are properties so they live in one place."""

    node_name: str
    namespace: str = "default"
    image_name: str = ""
    cdi_root: Path = Path("/var/run/cdi")
    kubelet_registrar_directory_path: Path = Path("/var/lib/kubelet/plugins_registry")
    kubelet_plugins_directory_path: Path = Path("/var/lib/kubelet/plugins")
    kubelet_device_plugins_directory_path: Path = Path("/var/lib/kubelet/device-plugins")
    kubeconfig: str = ""
    nvidia_driver_root: Path = Path("/")
    container_driver_root: Path = Path("/driver-root")
    nvidia_cdi_hook_path: str = DEFAULT_CDI_HOOK_PATH
    dev_root: Path = Path("/")
    sysfs_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    nvml_library: str = ""
    mock_profile: str = ""
    pod_uid: str = ""
    healthcheck_port: int = -1
    prepare_deadline_seconds: int = 40
    stale_claim_grace_seconds: int = 300
    http_endpoint: str = ""
    metrics_path: str = "/metrics"
    additional_xids_to_ignore: tuple[int, ...] = ()
    ignore_device_plugin: bool = False
    log_level: str = "info"
    log_format: str = "text"
    feature_gates: FeatureGates = field(default_factory=FeatureGates)
    consumable_shares: ShareMode = field(default_factory=ShareMode)
    driver_name: str = field(default=GPU_DRIVER.driver_name)
    mounts: MountCommands = field(default_factory=MountCommands)
    """How tmpfs is mounted (MPS shm directories): the system's ``mount``/``umount``; the sandbox may give
    stand-ins. Not a flag."""

    @property
    def plugin_dir(self) -> Path:
        """``<kubelet plugins dir>/<driver>``: sockets, claim state and the node-wide lock live here."""
        return self.kubelet_plugins_directory_path / self.driver_name

    @property
    def dra_socket(self) -> Path:
        """The DRA gRPC socket: ``dra.sock``, or ``dra-<podUID>.sock`` in rolling-update mode."""
        name = f"dra-{self.pod_uid}.sock" if self.pod_uid else "dra.sock"
        return self.plugin_dir / name

    @property
    def registration_socket(self) -> Path:
        """``<registrar dir>/<driver>-reg.sock``, or ``<driver>-<podUID>-reg.sock`` with a pod UID."""
        name = f"{self.driver_name}-{self.pod_uid}-reg.sock" if self.pod_uid else f"{self.driver_name}-reg.sock"
        return self.kubelet_registrar_directory_path / name

    @property
    def mps_root(self) -> Path:
        """``<plugin dir>/mps``: one directory per MPS control daemon (``pipe``, ``shm``, ``log``)."""
        return self.plugin_dir / "mps"

    @property
    def boot_id_path(self) -> Path:
        """``<proc root>/sys/kernel/random/boot_id``: claim state prepared before a reboot is invalid."""
        return self.proc_root / "sys" / "kernel" / "random" / "boot_id"

    @property
    def lock_path(self) -> Path:
        """The node-wide ``flock`` file serialising claim-state changes across plugin instances."""
        return self.plugin_dir / "serialize.lock"


def _xids(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise FlagError(f"ADDITIONAL_XIDS_TO_IGNORE: {part!r} is not an integer Xid") from None
    return tuple(out)


def _non_negative(what: str, value: int) -> int:
    if value < 0:
        raise FlagError(f"{what} {value} must not be negative")
    return value


def _deadline(seconds: int) -> int:
    if not 1 <= seconds <= 44:
        raise FlagError(f"--prepare-deadline-seconds (env PREPARE_DEADLINE_SECONDS) {seconds} is outside 1-44: the "
                        "kubelet gives up on NodePrepareResources after 45 s")
    return seconds


def config_from_args(args: argparse.Namespace) -> PluginConfig:
    """Build a :class:`PluginConfig` from a namespace produced by a parser with :func:`add_flags`.

    :raises FlagError: a required value is missing or a value is malformed.
    """
    if not args.node_name:
        raise FlagError("--node-name (env NODE_NAME) is required")
    hook_path = args.nvidia_cdi_hook_path or DEFAULT_CDI_HOOK_PATH
    gates = _gates(args.feature_gates)
    try:
        shares = parse_share_mode(args.consumable_shares, gate_enabled=gates.consumable_shares)
    except ShareModeError as exc:
        raise FlagError(str(exc)) from None
    if not hook_path.startswith("/"):
        raise FlagError(f"--nvidia-cdi-hook-path (env NVIDIA_CDI_HOOK_PATH) {hook_path!r} is not an absolute path")
    if gates.mps_support and not args.image_name:
        raise FlagError("--image-name (env IMAGE_NAME) is required with the MPSSupport feature gate: MPS control "
                        "daemon Deployments run the plugin's image")
    if shares.enabled and not args.image_name:
        raise FlagError(f"--image-name (env IMAGE_NAME) is required with --consumable-shares={shares}: the MPS "
                        "control daemon of each shared GPU is a Deployment running the plugin's image")
    if not args.namespace:
        raise FlagError("--namespace (env NAMESPACE) must not be empty")
    return PluginConfig(
        node_name=args.node_name,
        namespace=args.namespace,
        image_name=args.image_name,
        cdi_root=Path(args.cdi_root),
        kubelet_registrar_directory_path=Path(args.kubelet_registrar_directory_path),
        kubelet_plugins_directory_path=Path(args.kubelet_plugins_directory_path),
        kubelet_device_plugins_directory_path=Path(args.kubelet_device_plugins_directory_path),
        kubeconfig=args.kubeconfig,
        nvidia_driver_root=Path(args.nvidia_driver_root),
        container_driver_root=Path(args.container_driver_root),
        nvidia_cdi_hook_path=hook_path,
        dev_root=Path(args.dev_root),
        sysfs_root=Path(args.sysfs_root),
        proc_root=Path(args.proc_root),
        nvml_library=args.nvml_library,
        mock_profile=args.mock_profile,
        pod_uid=args.pod_uid,
        healthcheck_port=args.healthcheck_port,
        prepare_deadline_seconds=_deadline(args.prepare_deadline_seconds),
        stale_claim_grace_seconds=_non_negative("--stale-claim-grace-seconds (env STALE_CLAIM_GRACE_SECONDS)",
                                                args.stale_claim_grace_seconds),
        http_endpoint=args.http_endpoint,
        metrics_path=args.metrics_path,
        additional_xids_to_ignore=_xids(args.additional_xids_to_ignore),
        ignore_device_plugin=args.ignore_device_plugin,
        log_level=args.log_level,
        log_format=args.log_format,
        feature_gates=gates,
        consumable_shares=shares,
    )


def _gates(text: str) -> FeatureGates:
    try:
        return parse_feature_gates(text, where="--feature-gates (env FEATURE_GATES)")
    except FeatureGateError as exc:
        raise FlagError(str(exc)) from None
