"""Golden undo records: the claim payloads (with their undo records) a release writes for each kind of preparer
and sharing step, kept as JSON under ``tests/plugin/fixtures/undo-records/<release>/<kind>.json`` so that later
releases are tested against what earlier ones wrote (downgrade and upgrade safety: ``test_undo_records.py``).

Each :class:`Scenario` prepares one claim of its kind on a fresh sandbox node (the real plugin, the mock NVML, the
API emulator, the kubelet emulator over gRPC) and says how to check that its side effect is undone. Generating
the fixtures of this release (once per release whose records changed; a file is never edited afterwards)::

    python -m tests.plugin.undo_fixtures

In a stored payload the sandbox's root directory reads ``{root}`` and the claim's UID ``{claim_uid}``; everything
else is what the plugin wrote (device names, GPU UUIDs, MIG ids and placements come from the mock profile, the
same on every run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dradriver
from dradriver.app.gpu import GpuPlugin
from dradriver.config import PluginConfig
from dradriver.domain import featuregates as fg
from dradriver.domain import mps
from dradriver.domain.claims import ClaimRef
from dradriver.nvml import settings
from dradriver.sandbox.kubelet import PluginConnection
from dradriver.sandbox.node import SANDBOX_NAMESPACE, SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests.configs.test_plugin import allocate
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import ref_of, result, running

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "undo-records"
ROOT_MARK, UID_MARK = "{root}", "{claim_uid}"

Context = dict[str, Any]
"""What a scenario's prepare found out (GPU UUIDs, daemon IDs) for its check."""


@dataclass(frozen=True)
class Scenario:
    """One kind's claim: the node it needs, the plugin's configuration, the prepare and the check after the undo.

    :param kind: the fixture's name (the kind of the record that matters; the payload holds every record the
        claim got, e.g. a ``gpu`` record beside a ``timeslicing`` one).
    :param node: a fresh sandbox node in a directory.
    :param config: the plugin's configuration on that node (the gates the claim needs).
    :param prepare: prepares the claim; returns it and the facts the check needs.
    :param held: asserts that the claim's side effects are there (before its unprepare).
    :param undone: asserts that the claim's side effects are gone (after its unprepare).
    :param running: starts the scenario's plugin behind the kubelet emulator (the GPU plugin unless said).

    A prepare's context may hold ``marks``: values of this run (a ComputeDomain's UID) -> the placeholder a fixture
    holds instead (``{domain_uid}``).
    """

    kind: str
    node: Callable[[Path], contextlib.AbstractContextManager[SandboxNode]]
    config: Callable[[SandboxNode], PluginConfig]
    prepare: Callable[[SandboxNode, GpuPlugin, PluginConnection], Awaitable[tuple[ClaimRef, Context]]]
    held: Callable[[SandboxNode, GpuPlugin, Context], None]
    undone: Callable[[SandboxNode, GpuPlugin, Context], None]
    running: Callable[[PluginConfig], contextlib.AbstractAsyncContextManager[tuple[Any, PluginConnection]]] = running


@contextlib.contextmanager
def h100_node(_directory: Path, *, mig_state: bool = False) -> Iterator[SandboxNode]:
    """A DGX H100 sandbox with the GPU DeviceClass and the sandbox's Deployment runner (MPS daemons)."""
    with SandboxNode(profile="dgx-h100", mig_state=mig_state) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.run_workloads()
        yield node


@contextlib.contextmanager
def shares_node(directory: Path) -> Iterator[SandboxNode]:
    """Two H200 GPUs with consumable shares possible (the share's MPS daemon runs as a Deployment)."""
    with SandboxNode(profile=h200_node(directory, gpus=2)) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.run_workloads()
        yield node


def _gates(node: SandboxNode, **gates: bool) -> PluginConfig:
    base = node.mps_config()
    return replace(base, feature_gates=base.feature_gates.with_gates(**gates))


def _plain_gates(node: SandboxNode, gate: str) -> PluginConfig:
    return node.config(feature_gates=node.config().feature_gates.with_gates(**{gate: True}))


def _config_entry(sharing: dict[str, Any]) -> dict[str, Any]:
    from tests.configs.helpers import entry, params

    return entry(params(sharing=sharing))


def _uuid(plugin: GpuPlugin, device: str) -> str:
    assert plugin.registry is not None
    uuid = getattr(plugin.registry.get(device), "uuid", None)
    assert isinstance(uuid, str)
    return uuid


def _nvml(plugin: GpuPlugin) -> Any:
    assert plugin.session is not None
    return plugin.session


# -- gpu ----------------------------------------------------------------------------------------------------

async def _prepare_gpu(node: SandboxNode, plugin: GpuPlugin, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    ref = ref_of(allocate(node, "whole-gpu", [result("gpu-0")], []))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    return ref, {}


def _gpu_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert len(node.cdi_specs()) == 1


def _gpu_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert node.cdi_specs() == []


# -- timeslicing --------------------------------------------------------------------------------------------

async def _prepare_timeslicing(node: SandboxNode, plugin: GpuPlugin,
                               kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    gpu = _uuid(plugin, "gpu-1")
    settings.set_compute_mode(_nvml(plugin), gpu, settings.ComputeMode.EXCLUSIVE_PROCESS)  # the admin's setting
    ref = ref_of(allocate(node, "time-sliced", [result("gpu-1")],
                          [_config_entry({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})]))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    assert settings.compute_timeslice(_nvml(plugin), gpu) == 3
    return ref, {"gpu": gpu}


def _timeslicing_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert settings.compute_timeslice(_nvml(plugin), ctx["gpu"]) == 3


def _timeslicing_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert settings.compute_timeslice(_nvml(plugin), ctx["gpu"]) == 0
    assert settings.compute_mode(_nvml(plugin), ctx["gpu"]) is settings.ComputeMode.EXCLUSIVE_PROCESS


# -- mps ----------------------------------------------------------------------------------------------------

async def _prepare_mps(node: SandboxNode, plugin: GpuPlugin, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    ref = ref_of(allocate(node, "mps", [result("gpu-2")],
                          [_config_entry({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})]))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    gpu = _uuid(plugin, "gpu-2")
    daemon = mps.control_daemon_id(ref.uid, [gpu])
    assert settings.compute_mode(_nvml(plugin), gpu) is settings.ComputeMode.EXCLUSIVE_PROCESS
    return ref, {"gpu": gpu, "daemon": daemon}


def _mps_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert node.api is not None
    assert node.api.get("Deployment", mps.deployment_name(ctx["daemon"]), SANDBOX_NAMESPACE) is not None
    assert (plugin.config.mps_root / ctx["daemon"] / mps.PIPE_DIR).is_dir()


def _mps_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert node.api is not None
    assert node.api.get("Deployment", mps.deployment_name(ctx["daemon"]), SANDBOX_NAMESPACE) is None
    assert not (plugin.config.mps_root / ctx["daemon"]).exists()
    assert settings.compute_mode(_nvml(plugin), ctx["gpu"]) is settings.ComputeMode.DEFAULT


# -- mig (static) and dynamic-mig -----------------------------------------------------------------------------

def _instances(node: SandboxNode) -> list[list[str]]:
    from tests.plugin.test_dynamic_mig import state_lines

    return state_lines(node, "gi")


async def _prepare_static_mig(node: SandboxNode, plugin: GpuPlugin,
                              kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    device = "gpu-2-mig-1g10gb-19-6"
    ref = ref_of(allocate(node, "static-mig", [result(device)], []))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    # the MIG UUID of an instance made out of band differs from run to run
    return ref, {"instances": _instances(node), "marks": {_uuid(plugin, device): "{mig_uuid}"}}


def _static_mig_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert len(_instances(node)) == 1 and len(node.cdi_specs()) == 1


def _static_mig_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert _instances(node) == ctx["instances"] and node.cdi_specs() == []  # the admin's instance stays


@contextlib.contextmanager
def static_mig_node(directory: Path) -> Iterator[SandboxNode]:
    """An H100 node with the admin's static MIG layout: one 1g.10gb at slice 6 of GPU 2."""
    from dradriver.nvml.session import open_session
    from tests.plugin.test_dynamic_mig import _create_out_of_band

    with h100_node(directory, mig_state=True) as node:
        open_session(mock_profile=node.profile).close()  # pynvml now loads the mock library, as under pytest
        _create_out_of_band(2, 19, 6, 1)
        yield node


async def _prepare_dynamic_mig(node: SandboxNode, plugin: GpuPlugin,
                               kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    ref = ref_of(allocate(node, "dynamic-mig", [result("gpu-1-mig-1g10gb-19-5")], []))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    assert len(_instances(node)) == 1
    return ref, {}


def _dynamic_mig_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert len(_instances(node)) == 1


def _dynamic_mig_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    from tests.plugin.test_dynamic_mig import mig_mode

    assert _instances(node) == [] and mig_mode(node, 1) == (0, 0)


# -- gpu-share ----------------------------------------------------------------------------------------------

async def _prepare_share(node: SandboxNode, plugin: GpuPlugin, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    from tests.plugin.conftest import wait_for
    from tests.plugin.test_shares import allocate as allocate_shares
    from tests.plugin.test_shares import daemons, share_claim

    await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
    [claim] = allocate_shares(node, share_claim("share", "10Gi"))
    ref = ref_of(claim)
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    assert len(daemons(node)) == 1
    return ref, {}


def _share_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    from tests.plugin.test_shares import daemons

    assert len(daemons(node)) == 1


def _share_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    from tests.plugin.test_shares import daemons

    assert daemons(node) == []


# -- imex-channel and imex-daemon (the compute-domain plugin) --------------------------------------------------

@contextlib.contextmanager
def gb200_node(_directory: Path) -> Iterator[SandboxNode]:
    """A GB200 NVL72 tray with the IMEX procfs files (channels, ``fabric-imex-mgmt``)."""
    from tests.computedomain.cdplugin_helpers import write_imex_proc

    with SandboxNode(profile="gb200-nvl72-node") as node:
        write_imex_proc(node)
        yield node


def _cd_config(node: SandboxNode) -> PluginConfig:
    from tests.computedomain.cdplugin_helpers import cd_config

    return cd_config(node)


def _cd_running(config: PluginConfig) -> contextlib.AbstractAsyncContextManager[tuple[Any, PluginConnection]]:
    from tests.computedomain.cdplugin_helpers import running as cd_running

    return cd_running(config)


async def _prepare_channel(node: SandboxNode, plugin: Any, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    from tests.computedomain.cdplugin_helpers import seed_claim, seed_clique, seed_domain

    assert node.api is not None
    domain = seed_domain(node.api)
    seed_clique(node.api, domain, node.node_name, "Ready")
    ref = seed_claim(node.api, "channel", domain)
    got = (await kubelet.prepare([ref]))[ref.uid]
    assert got.ok, got.error
    return ref, {"domain": domain, "marks": {domain: "{domain_uid}"}}


def _channel_held(node: SandboxNode, plugin: Any, ctx: Context) -> None:
    from tests.computedomain.cdplugin_helpers import node_label

    assert node.api is not None and node_label(node.api) == ctx["domain"] and len(node.cdi_specs()) >= 1


def _channel_undone(node: SandboxNode, plugin: Any, ctx: Context) -> None:
    from tests.computedomain.cdplugin_helpers import node_label

    assert node.api is not None and node_label(node.api) is None


async def _prepare_daemon(node: SandboxNode, plugin: Any, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    from tests.computedomain.cdplugin_helpers import DRIVER_NAMESPACE, seed_claim, seed_domain

    assert node.api is not None
    domain = seed_domain(node.api)
    ref = seed_claim(node.api, "daemon", domain, namespace=DRIVER_NAMESPACE, kind="daemon")
    got = (await kubelet.prepare([ref]))[ref.uid]
    assert got.ok, got.error
    return ref, {"uid": ref.uid, "marks": {domain: "{domain_uid}"}}


def _daemon_held(node: SandboxNode, plugin: Any, ctx: Context) -> None:
    from tests.computedomain.cdplugin_helpers import spec_path

    assert spec_path(node, ctx["uid"]).exists()


def _daemon_undone(node: SandboxNode, plugin: Any, ctx: Context) -> None:
    from tests.computedomain.cdplugin_helpers import spec_path

    assert not spec_path(node, ctx["uid"]).exists()


# -- vfio ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def pci_node(_directory: Path, *, persistenced: bool = False) -> Iterator[SandboxNode]:
    """A DGX H100 sandbox with its PCI tree served by the PCI bus stand-in (VFIO passthrough); with
    ``persistenced`` the ``nvidia-persistenced`` stand-in holds its GPUs."""
    with SandboxNode(profile="dgx-h100", pci_tree=True, persistenced=persistenced) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        yield node


VFIO_GPU = "0000:18:00.0"


async def _prepare_vfio(node: SandboxNode, plugin: GpuPlugin, kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    ref = ref_of(allocate(node, "vm", [result("gpu-vfio-0")], []))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    return ref, {}


def _vfio_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    assert node.pci_host().function(VFIO_GPU).driver == "vfio-pci"


def _vfio_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    function = node.pci_host().function(VFIO_GPU)
    assert (function.driver, function.driver_override) == ("nvidia", None)


def _persistenced_holds(node: SandboxNode, minor: int) -> bool:
    assert node.persistence_daemon is not None
    return node.persistence_daemon.pid in {h.pid for h in node.pci_host().holders(minor)}


def _vfio_persistenced_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    _vfio_held(node, plugin, ctx)
    assert not _persistenced_holds(node, 0)


def _vfio_persistenced_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    _vfio_undone(node, plugin, ctx)
    assert _persistenced_holds(node, 0)  # persistence on again, as the record's "persistence" fact says


# -- fm-partition -------------------------------------------------------------------------------------------

async def _prepare_partition(node: SandboxNode, plugin: GpuPlugin,
                             kubelet: PluginConnection) -> tuple[ClaimRef, Context]:
    ref = ref_of(allocate(node, "pair", [result("gpu-0"), result("gpu-2")], []))
    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
    return ref, {}


def _partition_held(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    from tests.fabricmanager.nodes import active_partitions

    assert active_partitions(node) == {3}


def _partition_undone(node: SandboxNode, plugin: GpuPlugin, ctx: Context) -> None:
    from tests.fabricmanager.nodes import active_partitions

    assert active_partitions(node) == set()


def _fm_node(directory: Path) -> contextlib.AbstractContextManager[SandboxNode]:
    from tests.fabricmanager.nodes import fm_node

    return fm_node(directory)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("gpu", h100_node, lambda n: n.config(), _prepare_gpu, _gpu_held, _gpu_undone),
    Scenario("timeslicing", h100_node, lambda n: _gates(n, **{fg.TIME_SLICING_SETTINGS: True}),
             _prepare_timeslicing, _timeslicing_held, _timeslicing_undone),
    Scenario("mps", h100_node, lambda n: n.mps_config(), _prepare_mps, _mps_held, _mps_undone),
    Scenario("mig", static_mig_node, lambda n: n.config(), _prepare_static_mig, _static_mig_held,
             _static_mig_undone),
    Scenario("dynamic-mig", lambda d: h100_node(d, mig_state=True),
             lambda n: n.config(feature_gates=n.config().feature_gates.with_gates(**{fg.DYNAMIC_MIG: True})),
             _prepare_dynamic_mig, _dynamic_mig_held, _dynamic_mig_undone),
    Scenario("gpu-share", shares_node, lambda n: n.shares_config(), _prepare_share, _share_held, _share_undone),
    Scenario("imex-channel", gb200_node, _cd_config, _prepare_channel, _channel_held, _channel_undone, _cd_running),
    Scenario("imex-daemon", gb200_node, _cd_config, _prepare_daemon, _daemon_held, _daemon_undone, _cd_running),
    Scenario("vfio", pci_node, lambda n: _plain_gates(n, fg.PASSTHROUGH_SUPPORT), _prepare_vfio, _vfio_held,
             _vfio_undone),
    Scenario("vfio-persistenced", lambda d: pci_node(d, persistenced=True),
             lambda n: _plain_gates(n, fg.PASSTHROUGH_SUPPORT), _prepare_vfio, _vfio_persistenced_held,
             _vfio_persistenced_undone),
    Scenario("fm-partition", _fm_node, lambda n: _plain_gates(n, fg.FABRIC_MANAGER_PARTITIONING),
             _prepare_partition, _partition_held, _partition_undone),
)
"""Every kind that writes an undo record: the GPU plugin's (``exclusive`` comes with each claim's config group)
and the compute-domain plugin's."""


def normalise(payload: str, node: SandboxNode, uid: str, marks: dict[str, str] | None = None) -> dict[str, Any]:
    """The stored payload as a fixture holds it (:data:`ROOT_MARK`, :data:`UID_MARK`, ``marks``)."""
    text = payload.replace(str(node.root), ROOT_MARK).replace(uid, UID_MARK)
    for value, mark in (marks or {}).items():
        text = text.replace(value, mark)
    doc: dict[str, Any] = json.loads(text)
    return doc


def materialise(doc: dict[str, Any], root: Path, uid: str, marks: dict[str, str] | None = None) -> str:
    """A fixture's payload as a plugin on the node at ``root`` would have stored it for claim ``uid`` (``marks``:
    this run's value of each other placeholder, as :func:`normalise` takes them)."""
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True).replace(ROOT_MARK, str(root)).replace(UID_MARK, uid)
    for value, mark in (marks or {}).items():
        text = text.replace(mark, value)
    return text


def fixture_files() -> list[Path]:
    """Every stored fixture, of every release, sorted."""
    return sorted(FIXTURES.glob("*/*.json"))


def scenario_of(kind: str) -> Scenario:
    """The scenario that prepares a claim of ``kind``."""
    [scenario] = [s for s in SCENARIOS if s.kind == kind]
    return scenario


def stored_payload(plugin: Any, uid: str) -> str:
    """The claim's payload in the claim state."""
    record = plugin.state.get(uid)
    assert record is not None
    payload = record.payload
    return payload.decode() if isinstance(payload, bytes) else payload


async def generate(scenario: Scenario, directory: Path) -> dict[str, Any]:
    """Run ``scenario`` on a fresh node; the fixture document of the payload this release stored."""
    with scenario.node(directory) as node:
        async with scenario.running(scenario.config(node)) as (plugin, kubelet):
            ref, ctx = await scenario.prepare(node, plugin, kubelet)
            payload = normalise(stored_payload(plugin, ref.uid), node, ref.uid, ctx.get("marks"))
            assert (await kubelet.unprepare([ref]))[ref.uid] == ""
    return {"kind": scenario.kind, "writtenBy": f"dradriver {dradriver.__version__}", "payload": payload}


def main(argv: list[str]) -> int:
    """Write this release's fixtures (``tests/plugin/fixtures/undo-records/<version>/``); existing files are
    kept unless ``--force``."""
    import tempfile

    out = FIXTURES / dradriver.__version__
    out.mkdir(parents=True, exist_ok=True)
    for scenario in SCENARIOS:
        path = out / f"{scenario.kind}.json"
        if path.exists() and "--force" not in argv:
            print(f"kept {path}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            doc = asyncio.run(generate(scenario, Path(tmp)))
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
