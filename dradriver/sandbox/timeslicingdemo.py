"""``dradriver demo --scenario time-slicing``: one GPU time-sliced between two claims, settings read via NVML.

The plugin runs with the sharing gates on (:data:`SHARING_GATES`). Steps after the ResourceSlice (steps 1-2 of
:mod:`dradriver.sandbox.demo`):

3. one GPU time-sliced between two claims (:func:`time_slicing_scene`): two ResourceClaims with a ``GpuConfig``
   ``TimeSlicing`` config, both allocated the same GPU by the scheduler emulator (admin-access requests, which
   may share a device; consumable shares allocate one GPU to several claims the same way); each prepare is
   followed by the GPU's compute mode and time-slice read back through NVML; unprepare of the first claim keeps
   the second's interval, unprepare of the last resets it to Default;
4. tear down and check that nothing is left.

:func:`show_time_slicing` is the reusable part: given claims already allocated to one GPU, it prepares them,
shows what NVML reports, unprepares them and checks the reset, raising :class:`~dradriver.sandbox.demo.DemoError`
when the node does not do what the driver promises.
"""

from __future__ import annotations

from typing import Any

from dradriver.domain.configs import TIME_SLICE_INTERVALS
from dradriver.domain.devices import GpuDevice
from dradriver.domain.featuregates import TIME_SLICING_SETTINGS, FeatureGates
from dradriver.nvml import settings
from dradriver.sandbox import scheduler
from dradriver.sandbox.demo import DemoError, DemoRun, Narrator, _manifests, _prepare, _ref

SHARING_GATES = FeatureGates({TIME_SLICING_SETTINGS: True})
"""The gates the sharing scenario runs the plugin with."""

def time_sliced_claim(name: str, uuid: str, interval: str, *, namespace: str = "default") -> dict[str, Any]:
    """A ResourceClaim for the GPU with ``uuid`` (CEL on the published ``uuid`` attribute), admin access, and a
    ``GpuConfig`` asking for ``TimeSlicing`` with ``interval`` (``Default|Short|Medium|Long``)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com", "adminAccess": True,
                "selectors": [{"cel": {"expression": f'device.attributes["gpu.nvidia.com"].uuid == "{uuid}"'}}],
            }}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
            }}}],
        }},
    }


def _settings(run: DemoRun, uuid: str) -> tuple[settings.ComputeMode, int]:
    session = run.plugin.session
    if session is None:
        raise DemoError("the plugin has no NVML session")
    return settings.compute_mode(session, uuid), settings.compute_timeslice(session, uuid)


async def show_time_slicing(run: DemoRun, narrator: Narrator, claims: list[dict[str, Any]], gpu: GpuDevice) -> None:
    """Prepare ``claims`` (allocated to ``gpu``, each with a TimeSlicing config) one by one, show the GPU's
    compute mode and time-slice after each, then unprepare them in order and show the settings again.

    :raises DemoError: a prepare or unprepare failed, or NVML does not report what the claims asked for.
    """
    names = {0: "Default", 1: "Short", 2: "Medium", 3: "Long"}
    wanted: list[int] = []
    for claim in claims:
        interval = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["timeSlicingConfig"][
            "interval"]
        await _prepare(run.connection, claim)
        wanted.append(TIME_SLICE_INTERVALS[interval])
        mode, slice_ = _settings(run, gpu.uuid)
        narrator.say(f"prepared {claim['metadata']['name']} ({interval}): NVML reports {gpu.name} compute mode "
                     f"{mode.name}, time-slice {names[slice_]} ({slice_})",
                     claim=claim["metadata"]["name"], compute_mode=mode.name, timeslice=slice_)
        if mode is not settings.ComputeMode.DEFAULT or slice_ != wanted[-1]:
            raise DemoError(f"after preparing {claim['metadata']['name']}, {gpu.name} reports compute mode "
                            f"{mode.name} and time-slice {slice_}, expected DEFAULT and {wanted[-1]}")
    for k, claim in enumerate(claims):
        errors = await run.connection.unprepare([_ref(claim)])
        if any(errors.values()):
            raise DemoError(f"NodeUnprepareResources failed: {errors}")
        _, slice_ = _settings(run, gpu.uuid)
        left = len(claims) - k - 1
        expected = wanted[-1] if left else 0
        narrator.say(f"unprepared {claim['metadata']['name']}: time-slice {names[slice_]} ({slice_})"
                     + (f", kept for the {left} claim(s) still on {gpu.name}" if left else ", reset: no claim left"),
                     claim=claim["metadata"]["name"], timeslice=slice_)
        if slice_ != expected:
            raise DemoError(f"after unpreparing {claim['metadata']['name']}, {gpu.name} reports time-slice "
                            f"{slice_}, expected {expected}")


async def time_slicing_scene(run: DemoRun, narrator: Narrator, number: int) -> list[dict[str, Any]]:
    """Step ``number``: one GPU time-sliced between two claims (module docstring); returns the claims, for the
    teardown."""
    api = run.sandbox.api
    assert api is not None
    gpu = next((g for g in run.plugin.inventory.gpus if not g.mig_enabled), None)
    if gpu is None:
        raise DemoError("the profile has no GPU without MIG to time-slice")
    narrator.step(number, f"One GPU ({gpu.name}) time-sliced between two claims")
    for obj in _manifests("deviceclasses.yaml"):
        if api.get(obj["kind"], obj["metadata"]["name"], None) is None:
            api.create(obj)
    created = [api.create(time_sliced_claim(name, gpu.uuid, interval))
               for name, interval in (("time-sliced-a", "Short"), ("time-sliced-b", "Long"))]
    allocated = scheduler.allocate(api, [("default", c["metadata"]["name"]) for c in created],
                                   node_name=run.sandbox.node_name)
    devices = {r["device"] for c in allocated for r in c["status"]["allocation"]["devices"]["results"]}
    if devices != {gpu.name}:
        raise DemoError(f"the two claims were allocated {sorted(devices)}, expected {gpu.name} for both")
    narrator.say(f"claims {', '.join(c['metadata']['name'] for c in allocated)} allocated {gpu.name} "
                 f"({gpu.uuid}), each with a GpuConfig TimeSlicing config")
    await show_time_slicing(run, narrator, allocated, gpu)
    narrator.done()
    return allocated


async def run_sharing(run: DemoRun, narrator: Narrator) -> None:
    """Steps 3 and 4 of the sharing scenario."""
    api = run.sandbox.api
    assert api is not None
    claims = await time_slicing_scene(run, narrator, 3)
    narrator.step(4, "Tear down and check that nothing is left behind")
    for claim in claims:
        api.delete("ResourceClaim", claim["metadata"]["name"], claim["metadata"]["namespace"])
    leftovers = run.sandbox.cdi_specs()
    if leftovers or len(run.plugin.state):
        raise DemoError(f"left behind: CDI specs {[p.name for p in leftovers]}, "
                        f"{len(run.plugin.state)} claim(s) in state")
    narrator.say(f"deleted {len(claims)} claims; CDI specs: 0, prepared claims: 0")
    narrator.done()
