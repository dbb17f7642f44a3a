"""Kubelet-plugin configuration: every flag, its environment twin, and the paths derived from them.

:data:`PLUGIN_FLAGS` is the single source of truth. The CLI builds its options from it, and the
DaemonSet in ``deploy/`` sets exactly these environment variables (a test compares both). Flag and
variable names follow NVIDIA's gpu-kubelet-plugin where it has an equivalent (reference:
NVIDIA's ``cmd/gpu-kubelet-plugin/main.go``), so existing manifests keep working.

:data:`LOGGING_FLAGS` are klog's (component-base's) logging flags, shared by every NVIDIA-named entry point
(:mod:`dradriver.commands._entrypoint`); :data:`NVIDIA_ENVIRONMENT` lists the variables of NVIDIA's chart and binary
that are no flag's twin and what dradriver does with each. ``deploy/helm/README.md`` tabulates all of them.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dradriver.domain import nodeallocatable
from dradriver.domain.featuregates import FeatureGateError, FeatureGates, parse_feature_gates
from dradriver.domain.identity import COMPUTE_DOMAIN_DRIVER, GPU_DRIVER
from dradriver.domain.names import dns_subdomain_problems
from dradriver.domain.quantity import QuantityError, parse_quantity
from dradriver.domain.shares import ShareMode, ShareModeError, parse_share_mode
from dradriver.errors import FlagError
from dradriver.host.driverfiles import DEFAULT_CDI_HOOK_PATH
from dradriver.host.mounts import MountCommands
from dradriver.logs import LoggingConfig

IMAGE_CDI_HOOK_ENV = "DRADRIVER_IMAGE_CDI_HOOK"
MODPROBE_ENV = "DRADRIVER_MODPROBE"
"""Not a flag: the command (space-separated words) a kernel module name is appended to for VFIO passthrough; the
sandbox gives its ``modprobe`` stand-in. Unset: ``chroot <host root> modprobe``, as NVIDIA."""
"""Where the image carries ``nvidia-cdi-hook`` when not at ``/usr/bin/nvidia-cdi-hook`` (another image layout,
the sandbox and tests running the command outside the image)."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag and its environment twin.

    :param option: the long option, e.g. ``--node-name``.
    :param env: the environment variable read when the flag is not given.
    :param default: value used when neither is set; ``None`` means required.
    :param kind: ``str``, ``int``, ``float``, ``bool`` or ``path``.
    :param aliases: further spellings of the option (NVIDIA's ``--host_driver-root``, component-base's
        ``--logging-format``).
    :param env_aliases: further environment variables read when ``env`` is unset or empty (NVIDIA's
        ``HOST_DRIVER_ROOT``; ``ADDITIONAL_XIDs_TO_IGNORE``, the spelling issue 18 reports operators setting in
        NVIDIA's chart, while NVIDIA's v0.5.0-dev binary reads only ``ADDITIONAL_XIDS_TO_IGNORE``). Two
        non-empty values that differ are refused (:func:`environment_value`).
    :param name: the attribute name when it is not the option's (``-v`` is ``verbosity``).
    """

    option: str
    env: str
    default: str | int | float | bool | None
    help: str
    kind: str = "str"
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    name: str = ""

    @property
    def dest(self) -> str:
        """The attribute name on the parsed namespace and on :class:`PluginConfig`."""
        return self.name or self.option.removeprefix("--").replace("-", "_")

    @property
    def envs(self) -> tuple[str, ...]:
        """Every environment variable of this flag, the primary one first."""
        return (self.env, *self.env_aliases)


_OVERHEAD_CLASS_WORDS = {"gpu": "full GPU", "mig": "MIG device (static or dynamic)",
                         "vfio": "VFIO passthrough device"}
"""What each KEP-5517 overhead class of :data:`nodeallocatable.DEVICE_CLASSES` covers, for the flags' help."""

PLUGIN_FLAGS: tuple[Flag, ...] = (
    Flag("--node-name", "NODE_NAME", None, "Kubernetes Node this plugin serves; also the pool name."),
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
        "Host path of the NVIDIA driver installation ('/' or '/run/nvidia/driver'); the root of host paths in CDI "
        "specs.",
        "path",
        aliases=("--host_driver-root",),
        env_aliases=("HOST_DRIVER_ROOT",),
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
        "",
        "Host path of nvidia-cdi-hook (nvidia-container-toolkit), run by the hooks of claim CDI specs; empty: the "
        f"image's {DEFAULT_CDI_HOOK_PATH} is copied to <plugin dir>/nvidia-cdi-hook (0755) and specs name that copy.",
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
    Flag("--metrics-path", "METRICS_PATH", "/metrics", "HTTP path of the metrics endpoint; empty disables the "
         "metrics server (as NVIDIA's)."),
    Flag(
        "--dcgm-compatible",
        "DRADRIVER_DCGM_COMPATIBLE",
        False,
        "Serve device metrics under dcgm-exporter's DCGM_FI_* names, units and labels (dra_claim_name, ...) "
        "instead of the dradriver_gpu_* ones.",
        "bool",
    ),
    Flag(
        "--nvidia-checkpoint",
        "DRADRIVER_NVIDIA_CHECKPOINT",
        True,
        "Keep NVIDIA's checkpoint.json in the plugin directory naming every prepared claim, so that NVIDIA's "
        "gpu-kubelet-plugin (or compute-domain-kubelet-plugin) started in dradriver's place (a rollback) sees them "
        "as prepared and can unprepare them. false saves one file rewrite per prepare and unprepare and makes a "
        "rollback strand the claims.",
        "bool",
    ),
    Flag(
        "--additional-xids-to-ignore",
        "ADDITIONAL_XIDS_TO_IGNORE",
        "",
        "Comma-separated Xids treated as application errors (no taint), on top of the defaults.",
        env_aliases=("ADDITIONAL_XIDs_TO_IGNORE",),
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
    Flag("--default-config", "DEFAULT_CONFIG", "", "Driver config profile of a node without the label "
         "nvidia.com/dra-driver-gpu.config (gate PerNodeGPUConfig); empty: such a node advertises every device "
         "type."),
    Flag("--driver-config-directory", "DRADRIVER_DRIVER_CONFIG_DIRECTORY", "/available-configs", "Directory of "
         "the driver config profiles, one file per profile (NVIDIA's chart mounts its ConfigMap at "
         "/available-configs).", "path"),
    Flag("--namespace", "NAMESPACE", "default", "Namespace of the plugin's own objects (MPS control-daemon "
         "Deployments); the chart passes the pod's namespace."),
    Flag("--image-name", "IMAGE_NAME", "", "Full image name for pods the plugin creates (MPS control daemons); "
         "the chart passes its own image."),
    Flag("--image-pull-secrets", "IMAGE_PULL_SECRETS", "", "Comma-separated imagePullSecret names for pods the "
         "plugin creates; empty means none."),
    Flag("--image-pull-policy", "IMAGE_PULL_POLICY", "", "imagePullPolicy for pods the plugin creates "
         "(Always, IfNotPresent, Never); empty means the Kubernetes default."),
    Flag("--service-account-name", "SERVICE_ACCOUNT_NAME", "", "ServiceAccount for pods the plugin creates; "
         "empty means the namespace's default."),
    Flag("--host-root", "HOST_ROOT", "/host-root", "Where the host's / is mounted in the container; NVIDIA uses it "
         "only with the gate PassthroughSupport.", "path"),
    Flag(
        "--alt-proc-devices-path",
        "ALT_PROC_DEVICES_PATH",
        "",
        "A file read instead of <proc root>/devices for device majors (NVIDIA's ALT_PROC_DEVICES_PATH, used with "
        "mock NVML); empty means <proc root>/devices.",
        "path",
    ),
    Flag(
        "--kube-api-qps",
        "KUBE_API_QPS",
        -1.0,
        "Requests per second to the API server (token bucket, as client-go's); 0 means client-go's 5, a "
        "negative value no client-side limit (dradriver's default: API Priority and Fairness still applies).",
        "float",
    ),
    Flag("--kube-api-burst", "KUBE_API_BURST", 10, "Burst of the API rate limit; 0 means client-go's 10.", "int"),
    Flag("--log-level", "LOG_LEVEL", "info", "Lowest level logged (-v 4 and above also log debug).", "str",
         ("debug", "info", "warning", "error")),
    Flag("--log-format", "LOG_FORMAT", "text", "Log format: 'text' is klog's header format, 'json' one object "
         "per line.", "str", ("text", "json"), aliases=("--logging-format",), env_aliases=("LOGGING_FORMAT",)),
    *(Flag(nodeallocatable.flag_name(c, r, p), nodeallocatable.env_name(c, r, p), "",
           f"KEP-5517 host {r} overhead of each {_OVERHEAD_CLASS_WORDS[c]} per "
           f"{'pod referencing a claim for it' if p == 'pod' else 'container referencing the claim'} (a quantity; "
           "empty or 0: none), published in the device's nodeAllocatableResources; any value, 0 included, needs "
           "the gate NodeAllocatableResources.")
      for c, r, p in nodeallocatable.FLAG_KEYS),
)

#: Options of :data:`PLUGIN_FLAGS` NVIDIA's compute-domain-kubelet-plugin shares with the GPU plugin
#: (NVIDIA's ``cmd/compute-domain-kubelet-plugin/main.go``), plus dradriver's own that apply to it.
_SHARED_WITH_COMPUTE_DOMAIN_PLUGIN = (
    "--node-name", "--kubeconfig", "--cdi-root", "--kubelet-registrar-directory-path",
    "--kubelet-plugins-directory-path", "--nvidia-driver-root", "--container-driver-root", "--nvidia-cdi-hook-path",
    "--dev-root", "--sysfs-root", "--proc-root", "--nvml-library", "--mock-profile", "--pod-uid", "--healthcheck-port",
    "--prepare-deadline-seconds", "--stale-claim-grace-seconds", "--http-endpoint", "--metrics-path",
    "--feature-gates", "--namespace", "--alt-proc-devices-path", "--kube-api-qps", "--kube-api-burst", "--log-level",
    "--log-format", "--nvidia-checkpoint",
)

IMEX_MODES = ("driverManaged", "hostManaged", "preWarmed")
IMEX_ISOLATIONS = ("domain", "channel")
CHANNEL_NEEDS_HOST_MANAGED = (
    "--imex-isolation (env IMEX_ISOLATION) 'channel' needs --imex-mode (env IMEX_MODE) hostManaged (or preWarmed, "
    "which implies it): in driverManaged "
    "mode each ComputeDomain runs its own IMEX daemon on each of its nodes, and that daemon owns the node's IMEX, so "
    "a node serves one domain at a time (a second domain would need a second IMEX daemon on the same node) and "
    "domains are already kept apart by their daemons; use 'domain' there")
"""Why ``channel`` isolation is refused with driver-managed IMEX (plugin and controller say the same)."""

#: The flags of ``compute-domain-kubelet-plugin`` (NVIDIA's ``cmd/compute-domain-kubelet-plugin/main.go``): the shared
#: ones and NVIDIA's four of its own plus dradriver's --binding-conditions, each with its environment twin.
COMPUTE_DOMAIN_PLUGIN_FLAGS: tuple[Flag, ...] = (
    *(f for f in PLUGIN_FLAGS if f.option in _SHARED_WITH_COMPUTE_DOMAIN_PLUGIN),
    Flag("--gpu-clique-label-enabled", "GPU_CLIQUE_LABEL_ENABLED", False, "Set the node label nvidia.com/gpu.clique "
         "to this node's NVLink clique ID at start (refreshed every 10 minutes, removed on shutdown).", "bool"),
    Flag("--imex-mode", "IMEX_MODE", "driverManaged", "Who runs the IMEX daemon: 'driverManaged' (a daemon pod per "
         "ComputeDomain and node), 'hostManaged' (the host's own nvidia-imex; needs the gate "
         "HostManagedIMEXDaemon) or 'preWarmed' (dradriver's: the controller's long-lived daemon pod per clique and "
         "node, each domain its own channel; implies --imex-isolation channel and --gpu-clique-label-enabled).",
         "str", IMEX_MODES),
    Flag("--imex-isolation", "IMEX_ISOLATION", "domain", "IMEX isolation: 'domain' (channel 0 for every domain, "
         "NVIDIA's) or 'channel' (each domain its own channel; needs --imex-mode hostManaged or preWarmed).", "str",
         IMEX_ISOLATIONS),
    Flag("--imex-host-socket-path", "IMEX_HOST_SOCKET_PATH", "/etc/nvidia-imex/imex_ctrl.sock", "Host-managed mode: "
         "the host IMEX daemon's control socket, queried with 'nvidia-imex-ctl -q --u=<path>' for readiness.",
         "path"),
    Flag("--binding-conditions", "BINDING_CONDITIONS", False, "Publish each IMEX channel with the binding "
         "conditions ComputeDomainReady / ComputeDomainFailed (KEP-5007; needs the cluster's gate "
         "DRADeviceBindingConditions): the scheduler binds a workload pod only once this plugin has set "
         "ComputeDomainReady in its claim's status.devices (the domain is ready on the node), so its prepare "
         "never waits; off: today's path, the prepare waits for the domain.", "bool"),
)

#: klog/component-base logging flags of NVIDIA's binaries (``gpu-kubelet-plugin --help``, section "Logging"),
#: shared by every kubelet-plugin entry point; :mod:`dradriver.logs` gives their meaning in dradriver.
LOGGING_FLAGS: tuple[Flag, ...] = (
    Flag("-v", "V", 0, "klog verbosity: 0-3 info, 4-5 also dradriver's debug, 6 and above also the client "
         "libraries' debug (HTTP requests); see dradriver.logs.", "int", aliases=("--v",), name="verbosity"),
    Flag("--vmodule", "VMODULE", "", "Comma-separated pattern=N: verbosity N for the Python modules whose file "
         "name (without .py) matches the glob pattern; text format only."),
    Flag("--log-flush-frequency", "LOG_FLUSH_FREQUENCY", "5s", "Longest time between log flushes (a Go "
         "duration); dradriver flushes every record, well inside any value."),
    Flag("--log-text-split-stream", "LOG_TEXT_SPLIT_STREAM", False, "Text format: errors to stderr, info to "
         "stdout (needs the gate LoggingAlphaOptions).", "bool"),
    Flag("--log-json-split-stream", "LOG_JSON_SPLIT_STREAM", False, "JSON format: errors to stderr, info to "
         "stdout (needs the gate LoggingAlphaOptions).", "bool"),
    Flag("--log-text-info-buffer-size", "LOG_TEXT_INFO_BUFFER_SIZE", "0", "Buffer for info records with split "
         "streams; dradriver writes records unbuffered and accepts only 0."),
    Flag("--log-json-info-buffer-size", "LOG_JSON_INFO_BUFFER_SIZE", "0", "Buffer for info records with split "
         "streams; dradriver writes records unbuffered and accepts only 0."),
)


def _parse_bool(text: str) -> bool:
    """Go's ``strconv.ParseBool`` spellings plus ``yes``/``no``/``on``/``off``; empty is false."""
    lowered = text.strip().lower()
    if lowered in {"1", "t", "true", "yes", "on"}:
        return True
    if lowered in {"0", "f", "false", "no", "off", ""}:
        return False
    raise FlagError(f"not a boolean: {text!r}")


def _bool_argument(text: str) -> bool:
    try:
        return _parse_bool(text)
    except FlagError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_argument(text: str) -> int:
    """An integer; a leading ``=`` is dropped, so klog's ``-v=4`` reads as ``-v 4``."""
    try:
        return int(text.removeprefix("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _float_argument(text: str) -> float:
    try:
        return float(text.removeprefix("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _str_argument(text: str) -> str:
    return text


_ARGUMENT_TYPES = {"int": _int_argument, "float": _float_argument}


def environment_value(flag: Flag, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The environment's value for ``flag`` and the variable it came from, or ``None`` when none is set.

    The primary variable wins; an alias is read when the primary is unset or empty. Two non-empty values
    that differ are an error rather than a silent choice (an operator who set ``ADDITIONAL_XIDs_TO_IGNORE``
    beside a manifest's empty ``ADDITIONAL_XIDS_TO_IGNORE`` gets the Xids; one who set both to different lists
    is told).

    :raises FlagError: two variables of ``flag`` hold different non-empty values.
    """
    found = [(name, environ[name]) for name in flag.envs if name in environ]
    if not found:
        return None
    non_empty = [(name, value) for name, value in found if value.strip()]
    if len({value.strip() for _, value in non_empty}) > 1:
        listed = " and ".join(f"{name}={value!r}" for name, value in non_empty)
        raise FlagError(f"{flag.option}: {listed} disagree; set one of them")
    name, value = non_empty[0] if non_empty else found[0]
    return value, name


def add_flags(
    parser: argparse.ArgumentParser,
    flags: Sequence[Flag] = PLUGIN_FLAGS,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add ``flags`` to ``parser``; each default comes from its environment twin (or an alias) when set.

    Boolean flags take Go's forms: ``--flag``, ``--flag=false``, and ``--no-flag``.

    :raises FlagError: an environment variable holds a value of the wrong type, or two spellings of one
        variable disagree.
    """
    env = os.environ if environ is None else environ
    for flag in flags:
        found = environment_value(flag, env)
        raw, source = found if found is not None else (None, flag.env)
        twins = ", ".join(flag.envs)
        help_text = f"{flag.help} [env {twins}]"
        options = (flag.option, *flag.aliases)
        if flag.kind == "bool":
            try:
                default_bool = _parse_bool(raw) if raw is not None else bool(flag.default)
            except FlagError as exc:
                raise FlagError(f"{source}: {exc}") from None
            parser.add_argument(*options, dest=flag.dest, nargs="?", const=True, type=_bool_argument,
                                default=default_bool, metavar="BOOL", help=help_text)
            parser.add_argument("--no-" + flag.option.removeprefix("--"), dest=flag.dest, action="store_false",
                                help=argparse.SUPPRESS)
            continue
        default: object = flag.default
        if raw is not None:
            if flag.kind == "int":
                try:
                    default = int(raw)
                except ValueError:
                    raise FlagError(f"{source}={raw!r} is not an integer") from None
            elif flag.kind == "float":
                try:
                    default = float(raw)
                except ValueError:
                    raise FlagError(f"{source}={raw!r} is not a number") from None
            else:
                default = raw
        parser.add_argument(
            *options,
            dest=flag.dest,
            type=_ARGUMENT_TYPES.get(flag.kind, _str_argument),
            default=default,
            choices=flag.choices or None,
            help=help_text,
        )


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Validated kubelet-plugin settings; derived paths are properties so they live in one place."""

    node_name: str
    cdi_root: Path = Path("/var/run/cdi")
    kubelet_registrar_directory_path: Path = Path("/var/lib/kubelet/plugins_registry")
    kubelet_plugins_directory_path: Path = Path("/var/lib/kubelet/plugins")
    kubelet_device_plugins_directory_path: Path = Path("/var/lib/kubelet/device-plugins")
    kubeconfig: str = ""
    nvidia_driver_root: Path = Path("/")
    container_driver_root: Path = Path("/driver-root")
    nvidia_cdi_hook_path: str = ""
    """``--nvidia-cdi-hook-path``: ``""`` means the image's hook, copied into the plugin directory
    (:attr:`cdi_hook_path`)."""
    image_cdi_hook: Path = Path(DEFAULT_CDI_HOOK_PATH)
    """Where the image carries ``nvidia-cdi-hook`` (copied when :attr:`nvidia_cdi_hook_path` is empty); not a flag:
    ``DRADRIVER_IMAGE_CDI_HOOK`` (:data:`IMAGE_CDI_HOOK_ENV`) overrides it, the sandbox gives a stand-in."""
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
    dcgm_compatible: bool = False
    nvidia_checkpoint: bool = True
    additional_xids_to_ignore: tuple[int, ...] = ()
    ignore_device_plugin: bool = False
    namespace: str = "default"
    image_name: str = ""
    image_pull_secrets: tuple[str, ...] = ()
    image_pull_policy: str = ""
    service_account_name: str = ""
    host_root: Path = Path("/host-root")
    modprobe: tuple[str, ...] = ()
    """The command a kernel module name is appended to (gate ``PassthroughSupport``); empty: ``chroot <host root>
    modprobe``, as NVIDIA. Not a flag: ``DRADRIVER_MODPROBE`` (:data:`MODPROBE_ENV`) sets it, the sandbox gives a
    stand-in."""
    alt_proc_devices_path: str = ""
    kube_api_qps: float = -1.0
    kube_api_burst: int = 10
    log_level: str = "info"
    log_format: str = "text"
    feature_gates: FeatureGates = field(default_factory=FeatureGates)
    consumable_shares: ShareMode = field(default_factory=ShareMode)
    default_config: str = ""
    """The driver config profile of a node without the label (gate ``PerNodeGPUConfig``)."""
    driver_config_directory: Path = Path("/available-configs")
    """The driver config profiles, one file each."""
    node_allocatable_overhead: nodeallocatable.NodeAllocatableOverhead = field(
        default_factory=nodeallocatable.NodeAllocatableOverhead)
    """KEP-5517 overhead per device class (``--node-allocatable-*`` flags, gate NodeAllocatableResources)."""
    driver_name: str = field(default=GPU_DRIVER.driver_name)
    gpu_clique_label_enabled: bool = False
    """compute-domain plugin: set ``nvidia.com/gpu.clique`` on the node."""
    imex_mode: str = "driverManaged"
    """compute-domain plugin: ``driverManaged`` or ``hostManaged``."""
    imex_isolation: str = "domain"
    imex_host_socket_path: str = "/etc/nvidia-imex/imex_ctrl.sock"
    binding_conditions: bool = False
    """compute-domain plugin: publish channels with KEP-5007 binding conditions and set them
    (:mod:`dradriver.kubeletplugin.bindingconditions`)."""
    mounts: MountCommands = field(default_factory=MountCommands)
    """How tmpfs is mounted (MPS shm directories): the system's ``mount``/``umount``; the sandbox may give
    stand-ins. Not a flag."""

    @property
    def plugin_dir(self) -> Path:
        """``<kubelet plugins dir>/<driver>``: sockets, claim state and the node-wide lock live here."""
        return self.kubelet_plugins_directory_path / self.driver_name

    @property
    def cdi_hook_path(self) -> str:
        """The host path of ``nvidia-cdi-hook`` that claim CDI specs name: ``--nvidia-cdi-hook-path``, else
        ``<plugin dir>/nvidia-cdi-hook`` (the image's copy, as NVIDIA's plugin does; :mod:`dradriver.host.cdihook`)."""
        return self.nvidia_cdi_hook_path or str(self.plugin_dir / "nvidia-cdi-hook")

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
    def proc_devices_path(self) -> Path:
        """Where device majors are read: ``--alt-proc-devices-path`` when set, else ``<proc root>/devices``."""
        return Path(self.alt_proc_devices_path) if self.alt_proc_devices_path else self.proc_root / "devices"

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


#: ``imagePullPolicy`` values (``core/v1`` ``Container.imagePullPolicy``); empty leaves the API default.
IMAGE_PULL_POLICIES = ("", "Always", "IfNotPresent", "Never")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _pull_policy(text: str) -> str:
    if text not in IMAGE_PULL_POLICIES:
        raise FlagError(f"--image-pull-policy (env IMAGE_PULL_POLICY) {text!r} is not one of "
                        "Always, IfNotPresent, Never (or empty)")
    return text


def _burst(burst: int) -> int:
    if burst < 0:
        raise FlagError(f"--kube-api-burst (env KUBE_API_BURST) {burst} must not be negative")
    return burst


def _deadline(seconds: int) -> int:
    if not 1 <= seconds <= 44:
        raise FlagError(f"--prepare-deadline-seconds (env PREPARE_DEADLINE_SECONDS) {seconds} is outside 1-44: the "
                        "kubelet gives up on NodePrepareResources after 45 s")
    return seconds


def _overhead_flag_value(key: tuple[str, str, str]) -> property:
    return property(lambda config: config.node_allocatable_overhead.flag_text(*key),
                    doc=f"The value of {nodeallocatable.flag_name(*key)} (from node_allocatable_overhead).")


# Every flag's dest is readable on PluginConfig (the sandbox turns a config back into the plugin's environment by
# dest); the overhead flags are views of the one parsed node_allocatable_overhead.
for _key in nodeallocatable.FLAG_KEYS:
    setattr(PluginConfig, nodeallocatable.flag_dest(*_key), _overhead_flag_value(_key))


def config_from_args(args: argparse.Namespace) -> PluginConfig:
    """Build a :class:`PluginConfig` from a namespace produced by a parser with :func:`add_flags`.

    :raises FlagError: a required value is missing or a value is malformed.
    """
    if not args.node_name:
        raise FlagError("--node-name (env NODE_NAME) is required")
    if problems := dns_subdomain_problems(args.node_name):
        raise FlagError(f"--node-name (env NODE_NAME) {args.node_name!r} is not a valid Node name: "
                        + "; ".join(problems))
    gates, shares, overhead = publication_from_args(args)
    hook_path = args.nvidia_cdi_hook_path
    if hook_path and not hook_path.startswith("/"):
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
        cdi_root=Path(args.cdi_root),
        kubelet_registrar_directory_path=Path(args.kubelet_registrar_directory_path),
        kubelet_plugins_directory_path=Path(args.kubelet_plugins_directory_path),
        kubelet_device_plugins_directory_path=Path(args.kubelet_device_plugins_directory_path),
        kubeconfig=args.kubeconfig,
        nvidia_driver_root=Path(args.nvidia_driver_root),
        container_driver_root=Path(args.container_driver_root),
        nvidia_cdi_hook_path=hook_path,
        image_cdi_hook=Path(os.environ.get(IMAGE_CDI_HOOK_ENV) or DEFAULT_CDI_HOOK_PATH),
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
        dcgm_compatible=args.dcgm_compatible,
        nvidia_checkpoint=args.nvidia_checkpoint,
        additional_xids_to_ignore=_xids(args.additional_xids_to_ignore),
        ignore_device_plugin=args.ignore_device_plugin,
        namespace=args.namespace or "default",
        image_name=args.image_name,
        image_pull_secrets=_names(args.image_pull_secrets),
        image_pull_policy=_pull_policy(args.image_pull_policy),
        service_account_name=args.service_account_name,
        host_root=Path(args.host_root),
        modprobe=tuple(os.environ.get(MODPROBE_ENV, "").split()),
        alt_proc_devices_path=args.alt_proc_devices_path,
        kube_api_qps=float(args.kube_api_qps),
        kube_api_burst=_burst(args.kube_api_burst),
        log_level=args.log_level,
        log_format=args.log_format,
        feature_gates=gates,
        consumable_shares=shares,
        default_config=args.default_config,
        driver_config_directory=Path(args.driver_config_directory),
        node_allocatable_overhead=overhead,
    )


#: The flags of :data:`PLUGIN_FLAGS` that decide which devices the GPU plugin publishes and how (besides the node's
#: hardware): ``dradriver inspect`` takes them too, so it prints what the plugin would publish with them.
PUBLICATION_FLAGS = ("--feature-gates", "--consumable-shares",
                     *(nodeallocatable.flag_name(*key) for key in nodeallocatable.FLAG_KEYS))


def publication_from_args(
    args: argparse.Namespace,
) -> tuple[FeatureGates, ShareMode, nodeallocatable.NodeAllocatableOverhead]:
    """The feature gates (``--feature-gates``), the consumable-share mode (``--consumable-shares``, which
    needs the gate ``ConsumableShares`` unless ``disabled``) and the KEP-5517 node-allocatable overhead
    (``--node-allocatable-*``, which needs the gate ``NodeAllocatableResources``) of a namespace parsed with
    :data:`PUBLICATION_FLAGS`: what the GPU plugin and ``dradriver inspect`` read them into.

    :raises FlagError: a gate, the share mode or an overhead value is malformed, or shares or overhead are set
        without their gate.
    """
    gates = _gates(args.feature_gates)
    try:
        shares = parse_share_mode(args.consumable_shares, gate_enabled=gates.consumable_shares)
        overhead = nodeallocatable.parse_overhead(
            {key: getattr(args, nodeallocatable.flag_dest(*key), "") for key in nodeallocatable.FLAG_KEYS},
            gate_enabled=gates.node_allocatable_resources)
    except (ShareModeError, nodeallocatable.OverheadError) as exc:
        raise FlagError(str(exc)) from None
    return gates, shares, overhead


def check_imex_mode(mode: str, gates: FeatureGates) -> None:
    """Refuse ``--imex-mode hostManaged`` without the gate HostManagedIMEXDaemon, as the compute-domain plugin does.

    :raises FlagError: the mode needs a gate that is off.
    """
    if mode == "hostManaged" and not gates["HostManagedIMEXDaemon"]:
        raise FlagError("--imex-mode (env IMEX_MODE) 'hostManaged' needs the feature gate HostManagedIMEXDaemon")


def compute_domain_config_from_args(args: argparse.Namespace) -> PluginConfig:
    """A :class:`PluginConfig` for ``compute-domain-kubelet-plugin`` from a namespace parsed with
    :data:`COMPUTE_DOMAIN_PLUGIN_FLAGS`; flags of the GPU plugin it does not take keep their defaults, and the
    driver name is ``compute-domain.nvidia.com``.

    :raises FlagError: a required value is missing, a value is malformed, ``--imex-isolation=channel`` without
        ``--imex-mode=hostManaged`` (:data:`CHANNEL_NEEDS_HOST_MANAGED`), or ``--imex-mode=hostManaged`` without
        the gate HostManagedIMEXDaemon.
    """
    full = argparse.Namespace(**{f.dest: f.default for f in PLUGIN_FLAGS})
    for name, value in vars(args).items():
        setattr(full, name, value)
    base = config_from_args(full)
    if args.imex_isolation == "channel" and args.imex_mode not in ("hostManaged", "preWarmed"):
        raise FlagError(CHANNEL_NEEDS_HOST_MANAGED)
    check_imex_mode(args.imex_mode, base.feature_gates)
    return pre_warmed_implied(replace(base, driver_name=COMPUTE_DOMAIN_DRIVER.driver_name,
                                      gpu_clique_label_enabled=bool(args.gpu_clique_label_enabled),
                                      imex_mode=args.imex_mode, imex_isolation=args.imex_isolation,
                                      imex_host_socket_path=str(args.imex_host_socket_path),
                                      binding_conditions=bool(args.binding_conditions)))


def pre_warmed_implied(config: PluginConfig) -> PluginConfig:
    """``--imex-mode preWarmed`` implies ``--imex-isolation channel`` (all domains of a clique share its IMEX
    domain, so only channels keep them apart) and ``--gpu-clique-label-enabled`` (the controller's clique
    DaemonSets select nodes by the ``nvidia.com/gpu.clique`` label); other modes are returned as they are."""
    if config.imex_mode != "preWarmed":
        return config
    return replace(config, imex_isolation="channel", gpu_clique_label_enabled=True)


def _gates(text: str) -> FeatureGates:
    try:
        return parse_feature_gates(text, where="--feature-gates (env FEATURE_GATES)")
    except FeatureGateError as exc:
        raise FlagError(str(exc)) from None


_DURATION = re.compile(r"^[+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+$")


def _go_duration(text: str, where: str) -> str:
    """Check ``text`` is a Go ``time.ParseDuration`` value (``5s``, ``1m30s``, ``500ms``; ``0`` alone)."""
    if text.strip() == "0" or _DURATION.match(text.strip()):
        return text.strip()
    raise FlagError(f"{where} {text!r} is not a duration such as '5s' or '1m30s'")


def _vmodule(text: str, fmt: str) -> tuple[tuple[str, int], ...]:
    """klog's ``--vmodule pattern=N,...``; component-base allows it with the text format only."""
    where = "--vmodule (env VMODULE)"
    out: list[tuple[str, int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        pattern, sep, number = part.partition("=")
        try:
            verbosity = int(number)
        except ValueError:
            verbosity = -1
        if not sep or not pattern or verbosity < 0:
            raise FlagError(f"{where} {part!r}: expected pattern=N with N >= 0")
        out.append((pattern.removesuffix(".go").removesuffix(".py"), verbosity))
    if out and fmt != "text":
        raise FlagError(f"{where} is only supported with the text log format, not {fmt!r}")
    return tuple(out)


def _buffer_size(text: str, where: str) -> None:
    try:
        size = parse_quantity(text.strip() or "0")
    except QuantityError as exc:
        raise FlagError(f"{where} {text!r}: {exc}") from None
    if size.value != 0:
        raise FlagError(f"{where} {text!r}: dradriver writes each log record unbuffered and accepts only 0")


def logging_config_from_args(args: argparse.Namespace, gates: FeatureGates, *, klog: bool) -> LoggingConfig:
    """A :class:`~dradriver.logs.LoggingConfig` from ``--log-level``/``--log-format`` and, where the parser has
    them, :data:`LOGGING_FLAGS`, checked as component-base checks NVIDIA's (the JSON format needs the gate
    LoggingBetaOptions, split streams LoggingAlphaOptions; ``--vmodule`` is text-only).

    :param klog: ``text`` is klog's header format (the kubelet plugin's entry points).
    :raises FlagError: a value is malformed, needs a gate that is off, or cannot be honoured.
    """
    fmt = args.log_format
    if fmt == "json" and not gates["LoggingBetaOptions"]:
        raise FlagError("--log-format json needs the feature gate LoggingBetaOptions (on by default)")
    verbosity = getattr(args, "verbosity", 0)
    if verbosity < 0:
        raise FlagError(f"-v (env V) {verbosity} must not be negative")
    vmodule = _vmodule(getattr(args, "vmodule", ""), fmt)
    _go_duration(getattr(args, "log_flush_frequency", "5s"), "--log-flush-frequency (env LOG_FLUSH_FREQUENCY)")
    split = getattr(args, "log_json_split_stream" if fmt == "json" else "log_text_split_stream", False)
    alpha = gates["LoggingAlphaOptions"]
    for dest, env in (("log_text_split_stream", "LOG_TEXT_SPLIT_STREAM"),
                      ("log_json_split_stream", "LOG_JSON_SPLIT_STREAM")):
        if getattr(args, dest, False) and not alpha:
            raise FlagError(f"--{dest.replace('_', '-')} (env {env}) needs the feature gate LoggingAlphaOptions")
    for dest, env in (("log_text_info_buffer_size", "LOG_TEXT_INFO_BUFFER_SIZE"),
                      ("log_json_info_buffer_size", "LOG_JSON_INFO_BUFFER_SIZE")):
        _buffer_size(getattr(args, dest, "0"), f"--{dest.replace('_', '-')} (env {env})")
    return LoggingConfig(level=args.log_level, format=fmt, verbosity=verbosity, vmodule=vmodule,
                         split_stream=bool(split), klog=klog)


@dataclass(frozen=True, slots=True)
class EnvironmentVariable:
    """An environment variable NVIDIA's chart or binaries use that is no flag's twin.

    :param name: the variable.
    :param treatment: what dradriver does with it, in one sentence (also ``deploy/helm/README.md``'s table).
    :param inert: True when a set value changes nothing in dradriver although it could in NVIDIA's binary with a
        gate dradriver does not implement; the plugin then logs a warning naming it at start-up.
    """

    name: str
    treatment: str
    inert: bool = False


#: Variables of NVIDIA's chart and gpu-kubelet-plugin that are no flag's twin (its
#: ``deployments/helm/dra-driver-nvidia-gpu/templates/kubeletplugin.yaml``; ``cmd/gpu-kubelet-plugin/main.go``).
NVIDIA_ENVIRONMENT: tuple[EnvironmentVariable, ...] = (
    EnvironmentVariable("LOG_VERBOSITY", "Expanded by the kubelet into the chart's `-v $(LOG_VERBOSITY)`; the plugin "
                        "reads `-v` (env twin `V`), not this variable, as NVIDIA's does."),
    EnvironmentVariable("MASK_NVIDIA_DRIVER_PARAMS", "Read by the chart's container script, which bind-mounts a copy "
                        "of /proc/driver/nvidia/params with `ModifyDeviceFiles: 0` when `true` (the image has "
                        "bash, cp, sed and mount); the plugin does not read it, as NVIDIA's does not."),
    EnvironmentVariable("NVIDIA_VISIBLE_DEVICES", "Read by the NVIDIA container runtime (`void`: no GPUs injected "
                        "into the plugin's own container); not by the plugin, as NVIDIA's."),
    EnvironmentVariable("NVIDIA_MIG_CONFIG_DEVICES", "Read by the NVIDIA container runtime (MIG configuration "
                        "capability for the container); not by the plugin, as NVIDIA's."),
    EnvironmentVariable("NVIDIA_DRA_TEST_FORCE_GPU_ARCH", "NVIDIA's test hook forcing its DynamicMIG Ampere "
                        "path (no MIG toggle without a reset); dradriver's DynamicMIG takes each GPU's architecture "
                        "from NVML (the mock NVML profiles provide Ampere nodes), so it has no effect (warned).", True),
    EnvironmentVariable("NVIDIA_FABRICMANAGER_ADDRESS", "With the gate FabricManagerPartitioning, the Fabric "
                        "Manager's TCP address `a.b.c.d[:port]` (port 6666 by default), used when "
                        "NVIDIA_FABRICMANAGER_UNIX_SOCKET is unset; unset: the Unix socket "
                        "`<driver root>/run/nvidia-fabricmanager/socket`, as NVIDIA."),
    EnvironmentVariable("NVIDIA_FABRICMANAGER_UNIX_SOCKET", "With the gate FabricManagerPartitioning, the Fabric "
                        "Manager's Unix socket path, taken as given (default `<driver root>/run/nvidia-"
                        "fabricmanager/socket`); it wins over NVIDIA_FABRICMANAGER_ADDRESS."),
)


def inert_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per :data:`NVIDIA_ENVIRONMENT` variable that is set (non-empty) and has no effect here."""
    env = os.environ if environ is None else environ
    return [f"{var.name}={env[var.name]!r} is set but has no effect: {var.treatment}"
            for var in NVIDIA_ENVIRONMENT if var.inert and env.get(var.name, "").strip()]


def startup_summary(config: PluginConfig) -> str:
    """``name=value`` for every setting of ``config``, one line, for the start-up log (NVIDIA logs its start-up
    configuration at level 0)."""
    parts = []
    for name in config.__dataclass_fields__:
        value = getattr(config, name)
        if isinstance(value, FeatureGates):
            value = value.render()
        elif isinstance(value, tuple):
            value = ",".join(str(v) for v in value)
        parts.append(f"{name}={value}")
    return " ".join(parts)
