"""``dradriver demo --scenario time-slicing``: a GPU time-sliced by its claim, watched by admin-access claims that
never change it; settings read via NVML.

The plugin runs with the sharing gates on (:data:`SHARING_GATES`). Steps after the ResourceSlice (steps 1-2 of
:mod:`dradriver.sandbox.demos.basic`):

3. one GPU time-sliced by a claim, and watched (:func:`time_slicing_scene`): a ResourceClaim with a ``GpuConfig``
   ``TimeSlicing`` config (``Long``) is prepared and the GPU's compute mode and time-slice are read back through
   NVML; an admin-access claim on the same GPU that carries a sharing config of its own is refused with the
   config's field path (an admin claim never changes a device another claim owns, NVIDIA's
   kubernetes-sigs/dra-driver-nvidia-gpu#1280); one without a sharing config is prepared and unprepared, and the
   owner's time-slice stays; unprepare of the owner resets it to Default;
4. tear down and check that nothing is left.

Several claims time-slicing one GPU are consumable shares (``dradriver demo --scenario sharing``).
"""

from __future__ import annotations

from typing import Any

from dradriver.domain.configs import TIME_SLICE_INTERVALS
from dradriver.domain.devices import GpuDevice
from dradriver.domain.featuregates import TIME_SLICING_SETTINGS, FeatureGates
from dradriver.nvml import settings
from dradriver.sandbox import scheduler
from dradriver.sandbox.demos.narrator import (
    DemoError,
    DemoRun,
    Narrator,
    Step,
    claim_ref,
    manifests,
    prepare_claim,
    run_steps_async,
)

SHARING_GATES = FeatureGates({TIME_SLICING_SETTINGS: True})
"""The gates the sharing scenario runs the plugin with."""


def time_sliced_claim(name: str, uuid: str, interval: str | None, *, admin: bool = False,
                      namespace: str = "default") -> dict[str, Any]:
    """A ResourceClaim for the GPU with ``uuid`` (CEL on the published ``uuid`` attribute) with a ``GpuConfig``
    asking for ``TimeSlicing`` with ``interval`` (``Default|Short|Medium|Long``; ``None``: no config), and with
    ``admin``, ``adminAccess``."""
    exactly: dict[str, Any] = {
        "deviceClassName": "gpu.nvidia.com",
        "selectors": [{"cel": {"expression": f'device.attributes["gpu.nvidia.com"].uuid == "{uuid}"'}}],
    }
    if admin:
        exactly["adminAccess"] = True
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if interval is not None:
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
        }}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"devices": devices}}


NAMES = {0: "Default", 1: "Short", 2: "Medium", 3: "Long"}


def _settings(run: DemoRun, uuid: str) -> tuple[settings.ComputeMode, int]:
    session = run.plugin.session
    if session is None:
        raise DemoError("the plugin has no NVML session")
    return settings.compute_mode(session, uuid), settings.compute_timeslice(session, uuid)


def _show(run: DemoRun, narrator: Narrator, gpu: GpuDevice, claim: dict[str, Any], what: str, want: int) -> None:
    """Say what NVML reports for ``gpu`` after ``what`` happened to ``claim``.

    :raises DemoError: the time-slice is not ``want``, or the compute mode not DEFAULT while it is set.
    """
    mode, slice_ = _settings(run, gpu.uuid)
    narrator.say(f"{what} {claim['metadata']['name']}: NVML reports {gpu.name} compute mode {mode.name}, "
                 f"time-slice {NAMES.get(slice_, slice_)} ({slice_})",
                 claim=claim["metadata"]["name"], compute_mode=mode.name, timeslice=slice_)
    if slice_ != want or (want and mode is not settings.ComputeMode.DEFAULT):
        raise DemoError(f"after {what} {claim['metadata']['name']}, {gpu.name} reports compute mode {mode.name} "
                        f"and time-slice {slice_}, expected {NAMES[want]} ({want})")


async def _unprepare(run: DemoRun, claim: dict[str, Any]) -> None:
    errors = await run.connection.unprepare([claim_ref(claim)])
    if any(errors.values()):
        raise DemoError(f"NodeUnprepareResources failed: {errors}")


def sliceable_gpu(run: DemoRun) -> GpuDevice:
    """The node's first GPU without MIG, the one the scene time-slices.

    :raises DemoError: the profile has none.
    """
    gpu = next((g for g in run.plugin.inventory.gpus if not g.mig_enabled), None)
    if gpu is None:
        raise DemoError("the profile has no GPU without MIG to time-slice")
    return gpu


def scene_title(run: DemoRun) -> str:
    """The title of :func:`time_slicing_scene`'s step.

    :raises DemoError: the profile has no GPU to time-slice (:func:`sliceable_gpu`).
    """
    return f"One GPU ({sliceable_gpu(run).name}) time-sliced by its claim; admin-access claims never change it"


async def time_slicing_scene(run: DemoRun, narrator: Narrator) -> list[dict[str, Any]]:
    """The step :func:`scene_title`: one GPU time-sliced by its claim and watched by admin-access claims (module
    docstring); returns the claims, for the teardown.

    :raises DemoError: an allocation, prepare or unprepare did not do what the driver promises.
    """
    api = run.sandbox.api
    assert api is not None
    gpu = sliceable_gpu(run)
    for obj in manifests("deviceclasses.yaml"):
        if api.get(obj["kind"], obj["metadata"]["name"], None) is None:
            api.create(obj)
    long = TIME_SLICE_INTERVALS["Long"]
    claims: list[dict[str, Any]] = []
    for name, interval, admin in (("time-sliced", "Long", False), ("monitor-with-sharing", "Short", True),
                                  ("monitor", None, True)):
        api.create(time_sliced_claim(name, gpu.uuid, interval, admin=admin))
        [allocated] = scheduler.allocate(api, [("default", name)], node_name=run.sandbox.node_name)
        devices = {r["device"] for r in allocated["status"]["allocation"]["devices"]["results"]}
        if devices != {gpu.name}:
            raise DemoError(f"claim {name} was allocated {sorted(devices)}, expected {gpu.name}")
        claims.append(allocated)
    owner, refused, monitor = claims
    await prepare_claim(run.connection, owner)
    _show(run, narrator, gpu, owner, "prepared", long)
    ref = claim_ref(refused)
    error = (await run.connection.prepare([ref]))[ref.uid].error
    if "adminAccess" not in error:
        raise DemoError(f"the admin-access claim with a sharing config was not refused: {error or 'prepared'}")
    narrator.say(f"refused {refused['metadata']['name']} (adminAccess, TimeSlicing Short): "
                 f"{error.split(': ', 1)[-1]}", claim=refused["metadata"]["name"], refused=True)
    _show(run, narrator, gpu, refused, "refused", long)
    await prepare_claim(run.connection, monitor)
    _show(run, narrator, gpu, monitor, "prepared", long)
    await _unprepare(run, monitor)
    _show(run, narrator, gpu, monitor, "unprepared", long)
    await _unprepare(run, owner)
    _show(run, narrator, gpu, owner, "unprepared", 0)
    return claims


async def run_sharing(run: DemoRun, narrator: Narrator) -> None:
    """Steps 3 and 4 of the sharing scenario."""
    claims: list[dict[str, Any]] = []

    async def scene() -> None:
        claims.extend(await time_slicing_scene(run, narrator))

    await run_steps_async(narrator, [
        Step(lambda: scene_title(run), scene),
        Step("Tear down and check that nothing is left behind", lambda: _tear_down(run, narrator, claims)),
    ], first=3)


def _tear_down(run: DemoRun, narrator: Narrator, claims: list[dict[str, Any]]) -> None:
    api = run.sandbox.api
    assert api is not None
    for claim in claims:
        api.delete("ResourceClaim", claim["metadata"]["name"], claim["metadata"]["namespace"])
    leftovers = run.sandbox.cdi_specs()
    if leftovers or len(run.plugin.state):
        raise DemoError(f"left behind: CDI specs {[p.name for p in leftovers]}, "
                        f"{len(run.plugin.state)} claim(s) in state")
    narrator.say(f"deleted {len(claims)} claims; CDI specs: 0, prepared claims: 0")
