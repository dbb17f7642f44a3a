"""What every ``dradriver demo`` scenario shares: the narrator (numbered steps with their details, as text for
people or collected for ``--output json``), the step runner (a scenario is a list of named steps (:class:`Step`) that
:func:`run_steps` or :func:`run_steps_async` numbers, narrates and stops at the first failure), the error a failed
step raises, the running single-node demo's parts, and the small steps the scenarios repeat (bundled manifests, a
claim's reference, NodePrepareResources, the device table and what ``nvidia-smi -L`` would print)."""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TextIO

import yaml

from dradriver.app import GpuPlugin
from dradriver.domain.claims import ClaimRef
from dradriver.domain.devices import GpuDevice, MigDevice
from dradriver.errors import DradriverError
from dradriver.sandbox.kubelet import KubeletEmulator, PluginConnection
from dradriver.sandbox.node import SandboxNode


class DemoError(DradriverError):
    """A demo step did not produce what the driver promises; the message says which and why."""


@dataclass
class Narrator:
    """Prints progress for people (text, each line as it happens) or collects it for machines
    (``--output json``)."""

    output: str = "text"
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    steps: list[dict[str, Any]] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)

    def step(self, number: int, title: str) -> None:
        self.steps.append({"step": number, "title": title, "details": [], "seconds": 0.0})
        self._step_started = time.monotonic()
        if self.output == "text":
            print(f"\n== {number}. {title}", file=self.stream, flush=True)

    def done(self) -> None:
        seconds = time.monotonic() - self._step_started
        self.steps[-1]["seconds"] = round(seconds, 3)
        if self.output == "text":
            print(f"   ({seconds * 1000:.0f} ms)", file=self.stream, flush=True)

    def say(self, text: str, **data: Any) -> None:
        self.steps[-1]["details"].append({"text": text, **data})
        if self.output == "text":
            for line in text.splitlines():
                print(f"   {line}", file=self.stream)
            self.stream.flush()  # progress shows as it happens, also through a pipe (``dradriver demo | tee``)

    @property
    def total_seconds(self) -> float:
        return round(time.monotonic() - self._started, 3)



@dataclass(frozen=True)
class Step:
    """One step of a scenario: the title the narrator announces (or a callable that makes it when the step starts,
    from what earlier steps found) and the callable that runs it (no arguments; it tells its details through the
    narrator and raises :class:`DemoError` when the driver does not deliver). For :func:`run_steps_async` it may be
    a coroutine function."""

    title: str | Callable[[], str]
    run: Callable[[], Any]

    def announce(self, narrator: Narrator, number: int) -> None:
        """Start this step as step ``number`` of ``narrator``."""
        narrator.step(number, self.title if isinstance(self.title, str) else self.title())


def run_steps(narrator: Narrator, steps: Sequence[Step], *, first: int = 1,
              cleanup: Callable[[], Any] | None = None) -> None:
    """Run ``steps`` in order, numbered from ``first``: each is announced (:meth:`Narrator.step`), run and timed
    (:meth:`Narrator.done`). The first step that raises ends the run: ``cleanup`` runs, then the error propagates,
    the failed step left last in :attr:`Narrator.steps` without its time (``dradriver demo`` names it)."""
    try:
        for number, step in enumerate(steps, first):
            step.announce(narrator, number)
            step.run()
            narrator.done()
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise


async def run_steps_async(narrator: Narrator, steps: Sequence[Step], *, first: int = 1,
                          cleanup: Callable[[], Any] | None = None) -> None:
    """:func:`run_steps` for steps (and a ``cleanup``) that may be coroutine functions: each one's awaitable is
    awaited before the next step starts."""
    try:
        for number, step in enumerate(steps, first):
            step.announce(narrator, number)
            if inspect.isawaitable(result := step.run()):
                await result
            narrator.done()
    except BaseException:
        if cleanup is not None and inspect.isawaitable(result := cleanup()):
            await result
        raise


def manifests(name: str) -> list[dict[str, Any]]:
    """The objects of the bundled manifest ``name`` (``dradriver/sandbox/manifests/``), empty documents dropped."""
    text = resources.files("dradriver.sandbox").joinpath("manifests", name).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def device_table(slices: list[dict[str, Any]]) -> str:
    """A short table of the devices of ``slices``: name, type, product, memory, and what tells them apart."""
    rows = [("DEVICE", "TYPE", "PRODUCT", "MEMORY", "DETAILS")]
    for obj in slices:
        for dev in obj["spec"].get("devices") or []:
            attrs = dev.get("attributes", {})

            def val(key: str, attrs: dict[str, Any] = attrs) -> str:
                v = attrs.get(key) or {}
                return str(next(iter(v.values()), "")) if v else ""

            memory = (dev.get("capacity", {}).get("memory") or {}).get("value", "")
            details = val("profile") or f"cc {val('cudaComputeCapability')}, {val('architecture')}"
            rows.append((dev["name"], val("type"), val("productName"), memory, details))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def nvidia_smi_line(device: GpuDevice | MigDevice) -> str:
    """What ``nvidia-smi -L`` prints in a container that sees exactly ``device`` (NVIDIA's MIG User Guide)."""
    if isinstance(device, MigDevice):
        parent = device.parent
        return (f"GPU 0: {parent.product_name} (UUID: {parent.uuid})\n"
                f"  MIG {device.profile:<12} Device  0: (UUID: {device.uuid})")
    return f"GPU 0: {device.product_name} (UUID: {device.uuid})"


def claim_ref(claim: dict[str, Any]) -> ClaimRef:
    """The claim's namespace, name and UID, as the kubelet sends them."""
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


async def prepare_claim(kubelet: PluginConnection, claim: dict[str, Any]) -> Any:
    """NodePrepareResources for ``claim`` through ``kubelet``; the claim's result.

    :raises DemoError: the plugin answered with a per-claim error.
    """
    ref = claim_ref(claim)
    result = (await kubelet.prepare([ref]))[ref.uid]
    if result.error:
        raise DemoError(f"NodePrepareResources failed for claim {ref}: {result.error}")
    return result


@dataclass
class DemoRun:
    """The running demo's parts, for ``--serve`` and for tests."""

    sandbox: SandboxNode
    plugin: GpuPlugin
    kubelet: KubeletEmulator
    connection: PluginConnection
