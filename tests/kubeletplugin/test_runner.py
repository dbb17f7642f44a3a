"""The batch runner at its seam: fake device preparers with side effects, no NVML, no API server.

Each fake keeps a ledger of what exists "outside" (the side effects it applied and has not undone), so the tests
check exactly what was undone, not only what the runner answered. The claim state and CDI specs are real files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from dradriver.domain.cdi import CdiKind, ContainerEdits, DeviceNode
from dradriver.domain.claims import AllocationResult, Claim, ClaimError, ClaimRef, ClaimResult, base_request_name
from dradriver.domain.configs import ConfigGroup
from dradriver.domain.identity import DriverIdentity
from dradriver.domain.ports import DevicePlan, DevicePreparer, NotReadyYet, PartiallyApplied, UndoRecord
from dradriver.domain.registry import DeviceRegistry
from dradriver.errors import DradriverError
from dradriver.host.claimstate import ClaimPhase, ClaimState
from dradriver.kubeletplugin.payload import StoredPayload, read_payload
from dradriver.kubeletplugin.runner import BatchRunner

IDENTITY = DriverIdentity(driver_name="fake.example.com", cdi=CdiKind("k8s.fake.example.com"),
                          taint_domain="fake.example.com", user_agent="dradriver-test")
POOL = "node-a"


@dataclass(frozen=True)
class FakeDevice:
    name: str
    kind: str
    uuid: str = ""


class FakeFailure(DradriverError):
    """A side effect that failed."""


class FakePreparer:
    """A device kind whose apply creates a thing (``<claim>/<device>``) in :attr:`live` and undo removes it.

    :param fail_apply: device names whose apply raises after nothing was created.
    :param fail_undo_once: device names whose first undo raises (the thing stays).
    :param gate: apply waits on this barrier (to prove applies of one batch run concurrently).
    """

    side_effects = True

    def __init__(self, kind: str, *, fail_apply: Sequence[str] = (), fail_undo_once: Sequence[str] = (),
                 gate: threading.Barrier | None = None) -> None:
        self.kind = kind
        self.fail_apply = set(fail_apply)
        self.fail_undo_once = set(fail_undo_once)
        self.gate = gate
        self.live: set[str] = set()
        self.undone: list[str] = []
        self.lock = threading.Lock()

    def handles(self, device: object) -> bool:
        return isinstance(device, FakeDevice) and device.kind == self.kind

    def plan(self, claim: Claim, device: object, results: Sequence[AllocationResult],
             group: ConfigGroup | None) -> DevicePlan:
        assert isinstance(device, FakeDevice)
        return DevicePlan(self.kind, device.name, device,
                          tuple(dict.fromkeys(base_request_name(r.request) for r in results)),
                          all(r.admin_access for r in results), tuple(results), group, {"slot": device.name})

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        if self.gate is not None:
            self.gate.wait(timeout=20)
        if plan.device in self.fail_apply:
            raise FakeFailure(f"claim {claim}: creating {plan.device} failed")
        thing = f"{claim.uid}/{plan.device}"
        with self.lock:
            self.live.add(thing)
        return UndoRecord(self.kind, 1, plan.device, {"thing": thing})

    def edits(self, claim: ClaimRef, plan: DevicePlan, record: UndoRecord) -> ContainerEdits:
        return ContainerEdits(env=(f"FAKE_THING={record.data['thing']}",),
                              device_nodes=(DeviceNode(f"/dev/fake-{plan.device}"),))

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        thing = str(record.data["thing"])
        if record.target in self.fail_undo_once:
            self.fail_undo_once.discard(record.target)
            raise FakeFailure(f"claim {claim}: destroying {thing} failed")
        with self.lock:
            self.live.discard(thing)  # idempotent: undoing what is gone succeeds
            self.undone.append(thing)

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        keep = {str(r.data["thing"]) for r in known}
        with self.lock:
            orphans = sorted(self.live - keep)
            self.live -= set(orphans)
        return orphans


def _registry(*devices: FakeDevice) -> DeviceRegistry[tuple[FakeDevice, ...]]:
    return DeviceRegistry(tuple(devices), lambda devs: {d.name: d for d in devs})


def _claim(uid: str, *devices: str) -> Claim:
    return Claim(ClaimRef("team-a", f"claim-{uid}", uid),
                 tuple(AllocationResult("req", IDENTITY.driver_name, POOL, d) for d in devices))


class Node:
    """A runner over fake preparers ``alpha`` (devices a0..a3) and ``beta`` (b0..b3), files under tmp_path."""

    def __init__(self, tmp_path: Path, alpha: FakePreparer, beta: FakePreparer) -> None:
        self.tmp_path = tmp_path
        self.alpha, self.beta = alpha, beta
        self.claims: dict[str, Claim] = {}
        self.cdi_root = tmp_path / "cdi"
        self.cdi_root.mkdir()
        (tmp_path / "boot_id").write_text("boot-1\n")
        self.registry = _registry(*(FakeDevice(f"a{i}", "alpha") for i in range(4)),
                                  *(FakeDevice(f"b{i}", "beta") for i in range(4)))
        self.state = self.open_state()
        self.runner = self.make_runner()

    def open_state(self) -> ClaimState:
        return ClaimState.open(self.tmp_path / "claims.state", lock_path=self.tmp_path / "lock",
                               boot_id_path=self.tmp_path / "boot_id")

    def make_runner(self) -> BatchRunner:
        def fetch(ref: ClaimRef, timeout_s: float) -> Claim:
            if ref.uid not in self.claims:
                raise ClaimError(ref, "not found")
            return self.claims[ref.uid]

        return BatchRunner(identity=IDENTITY, registry=self.registry, state=self.state, fetch_claim=fetch,
                           cdi_root=self.cdi_root, pool=POOL, preparers=(self.alpha, self.beta))

    def add(self, claim: Claim) -> ClaimRef:
        self.claims[claim.ref.uid] = claim
        return claim.ref

    def restart(self) -> None:
        """A new process: state reopened from disk, a new runner, then start-up recovery."""
        self.state.close()
        self.state = self.open_state()
        self.runner = self.make_runner()

    def spec(self, uid: str) -> Path:
        return IDENTITY.cdi.spec_path(self.cdi_root, uid)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta", fail_apply=["b1"], fail_undo_once=["b2"]))
    yield n
    n.state.close()


def _prepare(node: Node, *refs: ClaimRef) -> dict[str, object]:
    return dict(node.runner.prepare_claims(list(refs)))


def test_fake_preparers_satisfy_the_port() -> None:
    assert isinstance(FakePreparer("alpha"), DevicePreparer)


def test_one_failed_apply_undoes_exactly_what_that_claim_applied(node: Node) -> None:
    good = node.add(_claim("u-good", "a0", "b0"))
    bad = node.add(_claim("u-bad", "a1", "b1"))  # alpha applies a1, then beta fails on b1
    answers = _prepare(node, good, bad)
    assert answers[good.uid].error == ""  # type: ignore[attr-defined]
    assert "creating b1 failed" in answers[bad.uid].error  # type: ignore[attr-defined]
    assert "team-a/claim-u-bad" in answers[bad.uid].error  # type: ignore[attr-defined]
    # exactly the side effect of the failed claim was undone; the good claim's stay
    assert node.alpha.undone == ["u-bad/a1"]
    assert node.alpha.live == {"u-good/a0"} and node.beta.live == {"u-good/b0"}
    assert set(node.state.claims()) == {good.uid}
    assert not node.spec(bad.uid).exists()
    record = node.state.get(good.uid)
    assert record is not None and record.phase is ClaimPhase.PREPARE_COMPLETED
    stored_payload = read_payload(record.payload)
    spec_path, records = stored_payload.spec, stored_payload.undo
    assert spec_path == str(node.spec(good.uid))
    assert [(r.kind, r.target, r.data["thing"]) for r in records] == [("alpha", "a0", "u-good/a0"),
                                                                      ("beta", "b0", "u-good/b0")]
    spec = json.loads(node.spec(good.uid).read_bytes())
    assert spec["kind"] == "k8s.fake.example.com/claim"
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env", [])]
    assert env == ["FAKE_THING=u-good/a0", "FAKE_THING=u-good/b0"]


def test_unprepare_undoes_in_reverse_and_retries_a_failed_undo(node: Node) -> None:
    ref = node.add(_claim("u-1", "a2", "b2"))
    assert _prepare(node, ref)[ref.uid].error == ""  # type: ignore[attr-defined]
    first = node.runner.unprepare_claims([ref])
    assert "destroying u-1/b2 failed" in first[ref.uid]
    assert ref.uid in node.state.claims()  # kept, so the kubelet's retry undoes again
    assert node.beta.live == {"u-1/b2"} and node.alpha.live == {"u-1/a2"}  # reverse order: beta first, failed
    second = node.runner.unprepare_claims([ref])
    assert second == {ref.uid: ""}
    assert node.beta.live == set() and node.alpha.live == set()
    assert node.alpha.undone == ["u-1/a2"] and node.beta.undone == ["u-1/b2"]
    assert node.state.claims() == {}


def test_applies_of_one_batch_run_concurrently(tmp_path: Path) -> None:
    gate = threading.Barrier(3)  # three claims: only concurrent applies get past the barrier
    n = Node(tmp_path, FakePreparer("alpha", gate=gate), FakePreparer("beta"))
    try:
        refs = [n.add(_claim(f"u-{i}", f"a{i}")) for i in range(3)]
        answers = _prepare(n, *refs)
        assert all(a.error == "" for a in answers.values()), answers  # type: ignore[attr-defined]
        assert n.alpha.live == {f"u-{i}/a{i}" for i in range(3)}
    finally:
        n.state.close()


def test_start_up_undoes_half_prepared_claims_and_sweeps_orphans(node: Node) -> None:
    ref = node.add(_claim("u-crash", "a3"))
    crash = RuntimeError("SIGKILL")

    def die(*_args: object, **_kwargs: object) -> None:
        raise crash

    # The process "dies" after the side effect and its undo record were stored, before the CDI spec existed.
    node.runner._write_spec = die  # type: ignore[method-assign]
    node.runner._undo_applied = die  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        node.runner._prepare_all([(ref, node.claims[ref.uid])], node.state.monotonic_ns())
    stored = node.state.get(ref.uid)
    assert stored is not None and stored.phase is ClaimPhase.PREPARE_STARTED
    assert [r.data["thing"] for r in read_payload(stored.payload).undo] == ["u-crash/a3"]
    node.alpha.live.add("u-gone/a0")  # a side effect whose record never reached the claim state
    node.restart()
    report = node.runner.recover()
    assert report.rolled_back == (ref.uid,)
    assert report.swept == ("alpha:u-gone/a0",)
    assert node.alpha.live == set() and "u-crash/a3" in node.alpha.undone
    assert node.state.claims() == {}


def test_old_payload_without_undo_records_still_unprepares(node: Node) -> None:
    node.state.prepare_started("u-old", namespace="team-a", name="old", devices=[],
                               payload=str(node.spec("u-old")))
    node.state.prepare_completed("u-old")
    assert read_payload(node.state.get("u-old").payload) == StoredPayload(str(node.spec("u-old")))  # type: ignore[union-attr]
    ref = ClaimRef("team-a", "old", "u-old")
    assert node.runner.unprepare_claims([ref]) == {ref.uid: ""}
    assert node.state.claims() == {}


def test_a_device_no_preparer_handles_is_a_claim_error(node: Node) -> None:
    node.registry.replace((*node.registry.snapshot, FakeDevice("g0", "gamma")))
    ref = node.add(_claim("u-g", "g0"))
    error = _prepare(node, ref)[ref.uid].error  # type: ignore[attr-defined]
    assert "results[0]" in error and "'g0' is of a kind this plugin cannot prepare" in error
    assert node.state.claims() == {}


def test_registry_tells_subscribers_and_the_runner_sees_new_devices(node: Node) -> None:
    seen: list[int] = []
    unsubscribe = node.registry.subscribe(lambda snapshot: seen.append(len(snapshot)))
    node.registry.replace((*node.registry.snapshot, FakeDevice("a9", "alpha")))
    unsubscribe()
    node.registry.replace(node.registry.snapshot[:-1])
    assert seen == [9]
    ref = node.add(_claim("u-a9", "a9"))
    assert "does not exist in pool" in _prepare(node, ref)[ref.uid].error  # type: ignore[attr-defined]


def test_an_undo_that_fails_during_rollback_is_kept_and_finished_at_start(tmp_path: Path) -> None:
    n = Node(tmp_path, FakePreparer("alpha", fail_undo_once=["a1"]), FakePreparer("beta", fail_apply=["b1"]))
    try:
        ref = n.add(_claim("u-r", "a1", "b1"))
        assert "creating b1 failed" in _prepare(n, ref)[ref.uid].error  # type: ignore[attr-defined]
        assert n.alpha.live == {"u-r/a1"}  # its undo failed once: the side effect still exists ...
        stored = n.state.get(ref.uid)  # ... and so does the record of how to undo it
        assert stored is not None and stored.phase is ClaimPhase.PREPARE_STARTED
        assert [r.target for r in read_payload(stored.payload).undo] == ["a1"]
        n.restart()
        report = n.runner.recover()
        assert report.rolled_back == (ref.uid,) and report.undo_failed == ()
        assert n.alpha.live == set() and n.state.claims() == {}
    finally:
        n.state.close()


def test_a_device_name_that_now_resolves_to_another_gpu_is_refused_and_its_spec_withdrawn(node: Node) -> None:
    """The claim's spec named the device nodes of ``a7``, which are another GPU's now: the refusal also deletes the
    spec (a container created later cannot resolve the claim instead of getting that GPU), a restart does not write
    it back, and it is written again only once the name is the claim's GPU again."""
    node.registry.replace((*node.registry.snapshot, FakeDevice("a7", "alpha", uuid="GPU-1111")))
    ref = node.add(_claim("u-pin", "a7"))
    assert _prepare(node, ref)[ref.uid].error == ""  # type: ignore[attr-defined]
    assert read_payload(node.state.get(ref.uid).payload).pins == {"a7": "GPU-1111"}  # type: ignore[union-attr]
    before = node.spec(ref.uid).read_bytes()
    # a driver reload renumbered the GPUs: the name a7 is another physical GPU now
    node.registry.replace((*node.registry.snapshot[:-1], FakeDevice("a7", "alpha", uuid="GPU-2222")))
    error = _prepare(node, ref)[ref.uid].error  # type: ignore[attr-defined]
    assert "GPU-1111" in error and "GPU-2222" in error and "'a7'" in error
    assert not node.spec(ref.uid).exists()  # withdrawn, never rewritten for the other GPU
    node.restart()
    report = node.runner.recover()
    assert report.unusable == (ref.uid,) and report.rebuilt_specs == ()
    assert not node.spec(ref.uid).exists()
    node.registry.replace((*node.registry.snapshot[:-1], FakeDevice("a7", "alpha", uuid="GPU-1111")))
    assert _prepare(node, ref)[ref.uid].error == ""  # type: ignore[attr-defined]
    assert node.spec(ref.uid).read_bytes() == before  # the claim's GPU is back under its name
    node.registry.replace(node.registry.snapshot[:-1])  # ... or the GPU fell off the bus
    assert "is no longer on this node" in _prepare(node, ref)[ref.uid].error  # type: ignore[attr-defined]
    assert not node.spec(ref.uid).exists()


def test_missing_or_invalid_specs_of_completed_claims_are_rebuilt(node: Node) -> None:
    refs = [node.add(_claim(f"u-s{i}", f"a{i}")) for i in range(3)]
    assert all(a.error == "" for a in _prepare(node, *refs).values())  # type: ignore[attr-defined]
    good = node.spec(refs[0].uid).read_bytes()
    # a re-sent Prepare finds a truncated spec and rewrites it
    node.spec(refs[0].uid).write_bytes(good[: len(good) // 2])
    assert _prepare(node, refs[0])[refs[0].uid].error == ""  # type: ignore[attr-defined]
    assert node.spec(refs[0].uid).read_bytes() == good
    # at start-up, a deleted spec and one naming other devices are rebuilt before any Prepare arrives
    node.spec(refs[1].uid).unlink()
    wrong = json.loads(node.spec(refs[2].uid).read_bytes())
    wrong["devices"][0]["name"] = f"{refs[2].uid}-a3"
    node.spec(refs[2].uid).write_text(json.dumps(wrong))
    node.restart()
    report = node.runner.recover()
    assert sorted(report.rebuilt_specs) == sorted([refs[1].uid, refs[2].uid])
    names = [d["name"] for d in json.loads(node.spec(refs[2].uid).read_bytes())["devices"]]
    assert names == [f"{refs[2].uid}-a2"] and node.spec(refs[1].uid).exists()


def test_a_one_claim_prepare_is_not_held_behind_a_large_batch(tmp_path: Path) -> None:
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta"))
    n.runner.chunk_size = 16
    try:
        big = [n.add(Claim(ClaimRef("team-a", f"big-{i}", f"u-big-{i}"),
                           (AllocationResult("req", IDENTITY.driver_name, POOL, "a0", admin_access=True),)))
               for i in range(1500)]
        small = n.add(_claim("u-small", "b0"))

        with concurrent.futures.ThreadPoolExecutor(1) as other_call:  # a second DRA server thread
            batch = other_call.submit(n.runner.prepare_claims, big)
            while len(n.state) == 0:  # the large batch is under way
                time.sleep(0.005)
            answer = n.runner.prepare_claims([small])
            assert answer[small.uid].error == ""
            assert not batch.done()  # answered between two chunks of the large batch
            answers = batch.result(60)
            assert all(a.error == "" for a in answers.values()) and len(n.state) == 1501
            unprepare = other_call.submit(n.runner.unprepare_claims, big)
            while len(n.state) == 1501:
                time.sleep(0.005)
            assert n.runner.unprepare_claims([small]) == {small.uid: ""}
            assert not unprepare.done()
            unprepare.result(60)
            assert len(n.state) == 0
    finally:
        n.runner.close()
        n.state.close()


class HalfwayPreparer(FakePreparer):
    """Creates two things per device (``.../first``, ``.../second``); the second fails for ``fail_apply``
    devices, after the first exists, and the apply reports the first through ``PartiallyApplied``."""

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        first = f"{claim.uid}/{plan.device}/first"
        with self.lock:
            self.live.add(first)
        if plan.device in self.fail_apply:
            raise PartiallyApplied(claim, f"devices[{plan.device}]: creating the second thing failed",
                                   UndoRecord(self.kind, 1, plan.device, {"thing": first}))
        return UndoRecord(self.kind, 1, plan.device, {"thing": first})


def test_partial_side_effects_of_a_failed_apply_are_undone_with_the_rest(tmp_path: Path) -> None:
    n = Node(tmp_path, FakePreparer("alpha"), HalfwayPreparer("beta", fail_apply=["b3"]))
    try:
        ref = n.add(_claim("u-half", "a3", "b3"))
        answer = _prepare(n, ref)[ref.uid]
        assert answer.error == (f"claim {ref}: devices[b3]: "  # type: ignore[attr-defined]
                                "creating the second thing failed")
        # the half-made side effect of b3 and the complete one of a3 are both undone, newest first
        assert n.beta.undone == ["u-half/b3/first"] and n.alpha.undone == ["u-half/a3"]
        assert n.alpha.live == set() and n.beta.live == set()
        assert n.state.get(ref.uid) is None and not n.spec(ref.uid).exists()
    finally:
        n.state.close()


class WaitingPreparer(FakePreparer):
    """Raises NotReadyYet until :attr:`ready`; its error's ready hint turns it ready at the hint's third poll.
    :attr:`events` logs attempts and hint polls in order."""

    def __init__(self, kind: str, *, hinted: bool) -> None:
        super().__init__(kind)
        self.hinted = hinted
        self.ready = False
        self.events: list[str] = []

    def hint(self) -> bool:
        polls = sum(1 for e in self.events if e.startswith("hint"))
        self.ready = polls >= 2
        self.events.append(f"hint {self.ready}")
        return self.ready

    def apply(self, claim: ClaimRef, plan: DevicePlan) -> UndoRecord:
        self.events.append("attempt")
        if not self.ready:
            raise NotReadyYet(claim, f"devices[{plan.device}]: what it waits for is not there yet",
                              ready_hint=self.hint if self.hinted else None)
        return super().apply(claim, plan)


@pytest.mark.parametrize("hinted", [True, False])
def test_a_ready_hint_ends_the_retry_pause_early(tmp_path: Path, hinted: bool) -> None:
    """A not-ready claim whose error carries a ready hint is tried again as soon as the hint says so (polled
    during the pause), not when the pause ends; without a hint the pause is waited out and nothing is polled."""
    waiting = WaitingPreparer("alpha", hinted=hinted)
    n = Node(tmp_path, waiting, FakePreparer("beta"))
    n.runner.retry_pause_s = (1.0, 1.0) if hinted else (0.05, 0.05)
    try:
        ref = n.add(_claim("u-wait", "a0"))
        if not hinted:
            waiting.ready = False

            def later() -> None:
                waiting.ready = True

            threading.Timer(0.2, later).start()
        answer = _prepare(n, ref)
        assert answer[ref.uid].error == ""  # type: ignore[attr-defined]
        if hinted:
            assert waiting.events == ["attempt", "hint False", "hint False", "hint True", "attempt"]
        else:
            assert set(waiting.events) == {"attempt"} and len(waiting.events) >= 2
        assert waiting.live == {"u-wait/a0"}
    finally:
        n.runner.close()
        n.state.close()



class ThreadNotingPreparer(FakePreparer):
    """Notes the thread each undo ran on."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.undo_threads: list[int] = []

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        self.undo_threads.append(threading.get_ident())
        super().undo(claim, record)


def test_an_unprepare_runs_in_the_calling_thread_and_waits_for_another_instances_lock(tmp_path: Path) -> None:
    """Issue 17: the DRA server's worker thread does the unprepare itself (no hop to another thread and back). When
    another plugin instance (a rolling update) holds the node's claim-state lock, that thread waits for it, then
    unprepares."""
    noting = ThreadNotingPreparer("alpha")
    n = Node(tmp_path, noting, FakePreparer("beta"))
    other = n.open_state()
    try:
        first, second = n.add(_claim("u-1", "a0")), n.add(_claim("u-2", "a1"))
        assert all(r.error == "" for r in _prepare(n, first, second).values())  # type: ignore[attr-defined]
        assert n.runner.unprepare_claims([first]) == {first.uid: ""}
        assert noting.undo_threads == [threading.get_ident()]

        released = threading.Event()
        holding = threading.Event()

        def hold() -> None:
            with other.locked():
                holding.set()
                released.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(5)
        threading.Timer(0.3, released.set).start()
        began = time.monotonic()
        assert n.runner.unprepare_claims([second]) == {second.uid: ""}
        assert time.monotonic() - began >= 0.25  # it waited for the other instance
        holder.join()
        assert n.state.get(second.uid) is None and not n.spec(second.uid).exists()
        assert n.runner.prepared_devices() == {}
    finally:
        other.close()
        n.state.close()
        n.runner.close()


def test_concurrent_calls_of_one_claim_count_in_flight_per_call(tmp_path: Path) -> None:
    """Several DRA server threads prepare the same claim at once (the kubelet retried before the first answer):
    both answer the same devices, and the claim counts as in flight until the last call ends, so an unprepare
    afterwards is not taken for one that aborted a prepare."""
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta"))
    ref = n.add(_claim("u-twice", "a0"))
    original = n.runner.fetch_claim
    both = threading.Barrier(2)

    def fetch_together(r: ClaimRef, timeout_s: float) -> Claim:
        both.wait(timeout=10)  # each call's GET waits for the other's: the two prepares overlap
        return original(r, timeout_s)

    n.runner.fetch_claim = fetch_together
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: n.runner.prepare_claims([ref]), range(2)))
        assert [a[ref.uid].error for a in answers] == ["", ""]
        assert answers[0][ref.uid].devices == answers[1][ref.uid].devices
        assert n.runner._in_flight == {} and n.runner.preparations == 1
        assert n.runner.unprepare_claims([ref]) == {ref.uid: ""}
        assert n.state.get(ref.uid) is None
    finally:
        n.runner.close()
        n.state.close()


@contextlib.contextmanager
def _waiting_prepare(runner: BatchRunner, waiting: WaitingPreparer, ref: ClaimRef, *,
                     deadline_s: float) -> Iterator[concurrent.futures.Future[Mapping[str, ClaimResult]]]:
    """A prepare call of ``ref`` in another thread, yielded once its first attempt found ``waiting`` not ready (the
    call then pauses before its next attempt)."""
    with concurrent.futures.ThreadPoolExecutor(1) as call:
        answer = call.submit(runner.prepare_claims, [ref], deadline_s=deadline_s)
        while "attempt" not in waiting.events:
            time.sleep(0.01)
        yield answer


def test_closing_the_runner_ends_a_not_ready_prepare_at_once(tmp_path: Path) -> None:
    """A prepare waiting between attempts for a not-ready preparer holds a DRA server thread; when the plugin stops
    (:meth:`BatchRunner.close`) the wait ends and the claim is answered with its last error, long before its
    deadline, instead of retrying until the deadline."""
    waiting = WaitingPreparer("alpha", hinted=False)
    n = Node(tmp_path, waiting, FakePreparer("beta"))
    n.runner.retry_pause_s = (5.0, 5.0)
    try:
        ref = n.add(_claim("u-stop", "a0"))
        with _waiting_prepare(n.runner, waiting, ref, deadline_s=30.0) as answer:
            began = time.monotonic()
            n.runner.close()
            error = answer.result(10)[ref.uid].error
        assert time.monotonic() - began < 2.0
        assert "not there yet" in error and "the plugin is stopping" in error
        assert waiting.events == ["attempt"] and n.state.get(ref.uid) is None
    finally:
        n.runner.close()
        n.state.close()


def _second_instance(n: Node, *preparers: FakePreparer) -> BatchRunner:
    """Another plugin instance on the node of ``n`` (a rolling update): its own claim-state object on the same files
    and lock, its own runner."""
    return BatchRunner(identity=IDENTITY, registry=n.registry, state=n.open_state(),
                       fetch_claim=lambda ref, _timeout: n.claims[ref.uid], cdi_root=n.cdi_root, pool=POOL,
                       preparers=preparers)


def test_an_unprepare_by_another_instance_between_a_waiting_prepares_attempts_wins(tmp_path: Path) -> None:
    """Issue 32: instance A's prepare waits between attempts of a not-ready preparer (no claim record exists then)
    when instance B answers the kubelet's unprepare of that claim. A's next attempt, ready now, must refuse: nothing
    applied, no record, no spec, the device free for the next claim; a Prepare the kubelet sends after the
    Unprepare (same claim UID) is served as usual."""
    waiting = WaitingPreparer("alpha", hinted=False)
    a = Node(tmp_path, waiting, FakePreparer("beta"))
    a.runner.retry_pause_s = (0.2, 0.2)
    b = _second_instance(a, FakePreparer("alpha"), FakePreparer("beta"))
    try:
        ref = a.add(_claim("u-wait", "a0"))
        with _waiting_prepare(a.runner, waiting, ref, deadline_s=20.0) as answer:
            assert a.state.get(ref.uid) is None  # between attempts
            assert b.unprepare_claims([ref]) == {ref.uid: ""}
            waiting.ready = True
            error = answer.result(10)[ref.uid].error
        assert "unprepared while this prepare was in flight" in error
        assert waiting.events == ["attempt"]  # the next attempt refused before applying anything
        assert waiting.live == set() and a.state.get(ref.uid) is None and not a.spec(ref.uid).exists()
        b.state.refresh()
        assert b.state.holder(POOL, "a0") is None
        # the kubelet prepares the same claim UID again after the unprepare: a new call, served
        assert a.runner.prepare_claims([ref])[ref.uid].error == ""
        assert waiting.live == {"u-wait/a0"} and a.spec(ref.uid).exists()
        assert a.runner.unprepare_claims([ref]) == {ref.uid: ""}
        nxt = a.add(_claim("u-next", "a0"))
        assert b.prepare_claims([nxt])[nxt.uid].error == ""
    finally:
        a.runner.close()
        b.close()
        b.state.close()
        a.state.close()


def test_a_prepare_whose_claim_get_outlasts_an_unprepare_by_another_instance_is_refused(tmp_path: Path) -> None:
    """Instance A's prepare call is still reading its ResourceClaim when instance B answers the unprepare of that
    claim (no record exists in either): A must not prepare it afterwards."""
    a = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta"))
    b = _second_instance(a, FakePreparer("alpha"), FakePreparer("beta"))
    ref = a.add(_claim("u-get", "a1"))
    unprepared = threading.Event()
    original = a.runner.fetch_claim

    def slow_get(r: ClaimRef, timeout_s: float) -> Claim:
        assert unprepared.wait(10)
        return original(r, timeout_s)

    a.runner.fetch_claim = slow_get
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as call:
            answer = call.submit(a.runner.prepare_claims, [ref])
            time.sleep(0.05)
            assert b.unprepare_claims([ref]) == {ref.uid: ""}
            unprepared.set()
            error = answer.result(10)[ref.uid].error
        assert "unprepared while this prepare was in flight" in error
        assert a.alpha.live == set() and a.state.get(ref.uid) is None and not a.spec(ref.uid).exists()
    finally:
        a.runner.close()
        b.close()
        b.state.close()
        a.state.close()


def test_a_prepare_call_older_than_the_remembered_unprepares_is_refused(tmp_path: Path) -> None:
    """Unprepare tombstones are kept for a TTL; a prepare call that has run longer than that cannot tell whether it
    lost to an unprepare, and refuses (the kubelet gave up on it long before)."""
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta"))
    now = [10**12]
    n.state.close()
    n.state = ClaimState.open(tmp_path / "claims.state", lock_path=tmp_path / "lock", boot_id_path=tmp_path / "boot_id",
                              tombstone_ttl_s=60.0, clock_ns=lambda: now[0])
    n.runner = n.make_runner()
    ref = n.add(_claim("u-old", "a2"))
    original = n.runner.fetch_claim

    def get_for_a_minute(r: ClaimRef, timeout_s: float) -> Claim:
        now[0] += 61 * 10**9
        return original(r, timeout_s)

    n.runner.fetch_claim = get_for_a_minute
    try:
        error = n.runner.prepare_claims([ref])[ref.uid].error
        assert "this prepare call has run for 61 s" in error and n.state.get(ref.uid) is None
        n.runner.fetch_claim = original
        assert n.runner.prepare_claims([ref])[ref.uid].error == ""
    finally:
        n.runner.close()
        n.state.close()


def test_an_unprepare_whose_tombstones_cannot_be_written_answers_every_claim_and_keeps_it(node: Node) -> None:
    """The tombstones come before any side effect of an unprepare: when they cannot be written, every claim of the
    batch gets an error naming the file and stays prepared (spec, record, side effects), for the kubelet's retry."""
    refs = [node.add(_claim("u-keep-1", "a0")), node.add(_claim("u-keep-2", "a1"))]
    assert all(r.error == "" for r in _prepare(node, *refs).values())  # type: ignore[attr-defined]
    (node.tmp_path / "claims.state.unprepared").mkdir()  # no file can be opened there
    answers = node.runner.unprepare_claims(refs)
    assert set(answers) == {r.uid for r in refs}
    assert all("unprepare failed" in e and "claims.state.unprepared" in e for e in answers.values())
    for ref in refs:
        assert node.state.get(ref.uid) is not None and node.spec(ref.uid).exists()
    assert node.alpha.live == {"u-keep-1/a0", "u-keep-2/a1"}
    (node.tmp_path / "claims.state.unprepared").rmdir()
    assert node.runner.unprepare_claims(refs) == {r.uid: "" for r in refs}
    assert node.alpha.live == set() and node.state.claims() == {}


class FakeClaimStep:
    """A per-claim step (as the Fabric Manager partition): applies to claims with an ``alpha`` device, creates
    ``<claim>:<devices>`` in :attr:`live`; ``fail_for`` claim UIDs raise."""

    kind = "whole-claim"
    side_effects = True

    def __init__(self, fail_for: Sequence[str] = ()) -> None:
        self.fail_for = set(fail_for)
        self.live: set[str] = set()
        self.seen: list[tuple[str, ...]] = []
        self.stored: object = None

    def bind_records(self, stored: object) -> None:
        self.stored = stored

    def applies(self, devices: Sequence[object]) -> bool:
        return any(isinstance(d, FakeDevice) and d.kind == "alpha" for d in devices)

    def apply(self, claim: ClaimRef, devices: Sequence[object]) -> UndoRecord:
        names = tuple(sorted(d.name for d in devices if isinstance(d, FakeDevice)))
        self.seen.append(names)
        if claim.uid in self.fail_for:
            raise FakeFailure(f"claim {claim}: the whole-claim step failed")
        thing = f"{claim.uid}:{','.join(names)}"
        self.live.add(thing)
        return UndoRecord(self.kind, 1, ",".join(names), {"thing": thing})

    def undo(self, claim: ClaimRef, record: UndoRecord) -> None:
        self.live.discard(str(record.data["thing"]))

    def sweep(self, known: Sequence[UndoRecord]) -> list[str]:
        orphans = sorted(self.live - {str(r.data["thing"]) for r in known})
        self.live -= set(orphans)
        return orphans


def _claim_step_runner(n: Node, step: FakeClaimStep) -> BatchRunner:
    def fetch(ref: ClaimRef, timeout_s: float) -> Claim:
        return n.claims[ref.uid]

    return BatchRunner(identity=IDENTITY, registry=n.registry, state=n.state, fetch_claim=fetch,
                       cdi_root=n.cdi_root, pool=POOL, preparers=(n.alpha, n.beta), claim_steps=(step,))


def test_a_claim_step_runs_once_per_claim_over_its_devices_and_is_undone_and_swept(tmp_path: Path) -> None:
    n = Node(tmp_path, FakePreparer("alpha"), FakePreparer("beta"))
    step = FakeClaimStep(fail_for=["u-bad"])
    try:
        n.runner = _claim_step_runner(n, step)
        assert callable(step.stored)  # bind_records was handed the runner's stored_records
        good = n.add(_claim("u-good", "a0", "a1", "b0"))
        bad = n.add(_claim("u-bad", "a2"))
        betas = n.add(_claim("u-beta", "b1"))  # no alpha device: the step does not apply
        answers = _prepare(n, good, bad, betas)
        assert answers[good.uid].error == "" and answers[betas.uid].error == ""  # type: ignore[attr-defined]
        assert "whole-claim step failed" in answers[bad.uid].error  # type: ignore[attr-defined]
        assert sorted(step.seen) == [("a0", "a1", "b0"), ("a2",)]
        assert step.live == {"u-good:a0,a1,b0"}
        assert n.alpha.live == {"u-good/a0", "u-good/a1"}  # the failed claim's device apply was undone
        stored = read_payload(n.state.get(good.uid).payload).undo  # type: ignore[union-attr]
        assert [r.kind for r in stored][-1] == "whole-claim"
        step.live.add("u-crashed:a3")  # activated before a crash, its record never stored
        n.restart()
        n.runner = _claim_step_runner(n, step)
        assert n.runner.recover().swept == ("whole-claim:u-crashed:a3",)
        assert n.runner.unprepare_claims([good]) == {good.uid: ""}
        assert step.live == set()
    finally:
        n.state.close()
