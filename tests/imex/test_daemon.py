"""``compute-domain-daemon run|check`` as subprocesses against the API emulator, with the IMEX stand-ins:
joining the clique with stable indexes, DNS names in each pod's hosts file, SIGUSR1 on membership change,
readiness through nvidia-imex-ctl, removal of the entry on SIGTERM, idling without a clique."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dradriver.computedomain.controller import ComputeDomainController
from dradriver.domain import computedomains as cd
from dradriver.domain import imex
from dradriver.domain.cdtemplates import ControllerSettings, owner_of
from dradriver.host import imexchannels
from dradriver.kube import computedomains as kcd
from dradriver.kube.client import open_client
from dradriver.kube.deployments import list_pods
from dradriver.sandbox.apiserver import ApiServerEmulator
from tests.factories import wait_until as _wait_until
from tests.imex.imexnodes import install_tools, loopback_prefix, template

CD_UID = "5b2f5a6e-3c1d-4d7e-9a4b-1234567890ab"
CLIQUE = "abc9829a-1111-2222-3333-444455556666.2"
NS = "default"
MAX_NODES = 4
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
WAIT_S = 60.0
"""Each daemon is a Python process importing the Kubernetes client: generous on a loaded machine."""


def wait(predicate: Callable[[], bool], what: str) -> None:
    _wait_until(predicate, what, timeout=WAIT_S)


class Daemon:
    """One daemon pod: its Pod object in the emulator, its /imexd and hosts file, its process."""

    def __init__(self, env: dict[str, str], root: Path, api: ApiServerEmulator, node: str, ip: str,
                 pod: str, clique: str = CLIQUE, cd_uid: str = CD_UID) -> None:
        self.api, self.node, self.ip, self.pod = api, node, ip, pod
        self.clique, self.cd_uid = clique, cd_uid
        self.dir = root / pod
        self.imexd = self.dir / "imexd"
        self.imexd.mkdir(parents=True)
        (self.imexd / imex.CONFIG_TEMPLATE_FILE).write_text(template())
        self.hosts = self.dir / "hosts"
        self.hosts.write_text("127.0.0.1\tlocalhost\n")
        self.log_path = self.dir / "daemon.log"
        created = api.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS, "labels": {cd.LABEL_COMPUTE_DOMAIN: cd_uid}},
            "spec": {"nodeName": node, "containers": [{"name": "imex", "image": "dradriver"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]}})
        self.uid = created["metadata"]["uid"]
        self.env = {**env, "CLIQUE_ID": clique, "COMPUTE_DOMAIN_UUID": cd_uid, "COMPUTE_DOMAIN_NAME": "cd",
                    "COMPUTE_DOMAIN_NAMESPACE": NS, "NODE_NAME": node, "POD_IP": ip, "POD_UID": self.uid,
                    "POD_NAME": pod, "POD_NAMESPACE": NS, "DRADRIVER_IMEXD_DIR": str(self.imexd),
                    "DRADRIVER_HOSTS_FILE": str(self.hosts)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(["compute-domain-daemon", "-v", "4", "run"],  # as NVIDIA's DaemonSet runs it
                                         env=self.env, stdout=log, stderr=log, start_new_session=True)

    def check(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["compute-domain-daemon", "check"], env=self.env,  # the pod's probes
                              capture_output=True, text=True, timeout=60, check=False)

    def imex_state(self) -> str:
        """What ``nvidia-imex-ctl -q`` prints (the stand-in is quick to ask; the probe is a whole Python start)."""
        return subprocess.run([shutil_which("nvidia-imex-ctl", self.env), "-c", str(self.imexd / imex.CONFIG_FILE),
                               "-q"], capture_output=True, text=True, timeout=20, check=False).stdout

    def members_known(self) -> bool:
        """Every daemon the domain's clique object lists has reached this daemon's hosts file (until then
        nvidia-imex may be READY with fewer peers, and turn WAITING_FOR_PEERS when it learns of the others)."""
        obj = self.api.get(cd.CLIQUE_KIND, cd.clique_object_name(self.cd_uid, self.clique), NS)
        hosts = self.hosts.read_text()
        return all(f"{e['ipAddress']}\t" in hosts for e in (obj or {}).get("daemons") or ()
                   if e.get("ipAddress"))  # an item without one is an index reservation, no member

    def wait_ready(self, what: str) -> None:
        """Wait until this daemon knows every member, nvidia-imex is READY and the probe
        ``compute-domain-daemon check`` passes."""
        wait(lambda: self.members_known() and self.imex_state() == "READY\n", what)
        wait(lambda: self.check().returncode == 0, f"{what}: compute-domain-daemon check")

    def set_ready(self, ready: bool = True) -> None:
        obj = self.api.get("Pod", self.pod, NS)
        assert obj is not None
        obj["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self.api.update(obj, subresource="status")

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL the pod's processes (daemon and nvidia-imex): a force-deleted pod."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def world(short_dir: Path) -> Iterator[tuple[ApiServerEmulator, dict[str, str], list[Daemon]]]:
    bin_dir = install_tools(short_dir / "bin")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["compute-domain-daemon"].partition(":")
    script = bin_dir / "compute-domain-daemon"  # the console script as pip generates it
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    script.chmod(0o755)
    with ApiServerEmulator() as api:
        api.install_crds()  # the clique's list-map keys: server-side apply merges daemons[] by nodeName
        env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "PYTHONPATH": str(REPO),
               "KUBECONFIG": api.kubeconfig_path(short_dir), "MAX_NODES_PER_IMEX_DOMAIN": str(MAX_NODES),
               "DRADRIVER_POLL_INTERVAL_SECONDS": "0.2", "HOME": str(short_dir)}
        daemons: list[Daemon] = []
        with _index_assigner(api, short_dir):
            yield api, env, daemons
        for daemon in daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                try:
                    os.killpg(daemon.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                daemon.proc.wait(timeout=30)


@contextlib.contextmanager
def _index_assigner(api: ApiServerEmulator, root: Path) -> Iterator[None]:
    """The controller's per-clique membership pass (:meth:`ComputeDomainController.reconcile_clique`: indexes,
    clean-up) every 0.1 s over the cliques of ``NS`` -- these daemons run without ComputeDomain objects, so the
    controller's domain loop has nothing to drive it."""
    client = open_client(api.kubeconfig_path(root))
    controller = ComputeDomainController(client, ControllerSettings(namespace=NS, image="dradriver",
                                                                    max_nodes_per_imex_domain=MAX_NODES))
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(Exception):  # a pass racing a daemon's write: the next pass retries
                pods = list_pods(client, NS, cd.LABEL_COMPUTE_DOMAIN)
                for clique in kcd.list_cliques(client, NS, cd.LABEL_COMPUTE_DOMAIN):
                    controller.reconcile_clique(clique, [p for p in pods if owner_of(p) == owner_of(clique)])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        client.close()


def shutil_which(name: str, env: dict[str, str]) -> str:
    found = shutil.which(name, path=env["PATH"])
    assert found is not None, name
    return found


def _entries(api: ApiServerEmulator) -> dict[str, dict[str, Any]]:
    obj = api.get(cd.CLIQUE_KIND, cd.clique_object_name(CD_UID, CLIQUE), NS)
    return {e["nodeName"]: e for e in (obj or {}).get("daemons") or ()}


def _imex_log_count(daemon: Daemon, text: str) -> int:
    return daemon.log().count(text)


def test_daemons_join_with_indexes_get_ready_restart_keeps_index_and_sigterm_leaves(
        short_dir: Path, world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]) -> None:
    api, env, daemons = world
    prefix = loopback_prefix()
    for i in range(3):
        daemon = Daemon(env, short_dir, api, f"node-{i}", f"{prefix}.{i + 1}", f"cd-daemon-{i}")
        daemons.append(daemon)
        daemon.start()
        wait(lambda d=daemon: "index" in _entries(api).get(d.node, {}), f"{daemon.node}'s clique entry and index")
    entries = _entries(api)
    assert {n: (e["index"], e["ipAddress"], e["status"]) for n, e in entries.items()} == {
        f"node-{i}": (i, f"{prefix}.{i + 1}", cd.STATUS_NOT_READY) for i in range(3)}
    clique = api.get(cd.CLIQUE_KIND, cd.clique_object_name(CD_UID, CLIQUE), NS)
    assert clique is not None
    assert clique["metadata"]["labels"] == {cd.LABEL_COMPUTE_DOMAIN: CD_UID, cd.LABEL_CLIQUE_ID: CLIQUE}
    assert {o["uid"] for o in clique["metadata"]["ownerReferences"]} == {d.uid for d in daemons}
    for daemon in daemons:
        pod = api.get("Pod", daemon.pod, NS)
        assert pod is not None and pod["metadata"]["labels"][cd.LABEL_CLIQUE_ID] == CLIQUE

    names = cd.dns_names(CD_UID, MAX_NODES)
    expected_hosts = [f"{prefix}.{i + 1}\t{names[i]}" for i in range(3)] + [f"{cd.UNUSED_SLOT_IP}\t{names[3]}"]
    for daemon in daemons:
        wait(lambda d=daemon: all(line in d.hosts.read_text() for line in expected_hosts),
                   f"{daemon.pod}'s hosts file")
        assert (daemon.imexd / imex.NODES_FILE).read_text() == "".join(f"{n}\n" for n in names)
        config = (daemon.imexd / imex.CONFIG_FILE).read_text()
        assert f"IMEX_CMD_BIND_INTERFACE_IP={daemon.ip}\n" in config
        assert f"IMEX_NODE_CONFIG_FILE={daemon.imexd / imex.NODES_FILE}\n" in config
        assert "localhost" in daemon.hosts.read_text()
    for daemon in daemons:
        record = imexchannels.read_readiness(daemon.imexd)  # written at the start, before nvidia-imex runs
        assert record is not None and (record.node_name, record.pod_uid, record.pod_ip) == (
            daemon.node, daemon.uid, daemon.ip)
        daemon.wait_ready(f"{daemon.pod} check READY")
        record = imexchannels.read_readiness(daemon.imexd)  # the check that passed wrote it
        assert record is not None and record.ready and record.pod_uid == daemon.uid and record.detail == "READY"
        assert imexchannels.daemon_alive(daemon.imexd)  # run holds its liveness lock
        daemon.set_ready()
    wait(lambda: all(e["status"] == cd.STATUS_READY for e in _entries(api).values()), "entries Ready")

    # node-1's pod is force-deleted (SIGKILL, its entry stays) and comes back with a new pod IP
    before = [_imex_log_count(d, "SIGUSR1 received") for d in daemons]
    daemons[1].kill()
    record = imexchannels.read_readiness(daemons[1].imexd)
    assert record is not None and record.ready  # its last probe's record, young: it alone would say ready...
    wait(lambda: not imexchannels.daemon_alive(daemons[1].imexd), "the killed daemon's liveness lock gone")  # ...not
    api.delete("Pod", daemons[1].pod, NS)
    again = Daemon(env, short_dir, api, "node-1", f"{prefix}.11", "cd-daemon-1b")
    daemons.append(again)
    again.start()
    wait(lambda: _entries(api).get("node-1", {}).get("ipAddress") == f"{prefix}.11", "node-1's entry with the new IP")
    assert {n: e["index"] for n, e in _entries(api).items()} == {"node-0": 0, "node-1": 1, "node-2": 2}
    for i in (0, 2):
        wait(lambda d=daemons[i], b=before[i]: _imex_log_count(d, "SIGUSR1 received") > b,
                   f"{daemons[i].pod}'s nvidia-imex got SIGUSR1")
        wait(lambda d=daemons[i]: f"{prefix}.11\t{names[1]}" in d.hosts.read_text(),
                   "the moved name in the hosts file")
    assert "SIGUSR1 received" not in again.log()  # a fresh start reads the files; no signal
    for daemon in (daemons[0], daemons[2], again):
        daemon.wait_ready(f"{daemon.pod} READY again")

    # SIGTERM: node-2 withdraws its fields, the controller's index reservation stays; the others drop its name
    assert daemons[2].terminate() == 0
    record = imexchannels.read_readiness(daemons[2].imexd)
    assert record is not None and not record.ready and record.detail == "stopped"  # not Ready for 30 s after it
    assert not imexchannels.daemon_alive(daemons[2].imexd) and imexchannels.daemon_alive(daemons[0].imexd)
    assert not _entries(api)["node-2"].get("ipAddress") and _entries(api)["node-2"]["index"] == 2
    wait(lambda: f"{cd.UNUSED_SLOT_IP}\t{names[2]}" in daemons[0].hosts.read_text(), "node-2's name freed")
    daemons[0].wait_ready("node-0 READY with two members")


def test_no_clique_idles_and_check_succeeds(short_dir: Path,
                                             world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]) -> None:
    api, env, daemons = world
    daemon = Daemon(env, short_dir, api, "node-x", f"{loopback_prefix()}.1", "cd-daemon-x", clique="")
    daemons.append(daemon)
    daemon.start()
    wait(lambda: (api.get("Pod", daemon.pod, NS) or {})["metadata"].get("labels", {}).get(cd.LABEL_CLIQUE_ID)
               == "", "the empty clique label")
    assert daemon.check().returncode == 0
    assert not api.objects(cd.CLIQUE_KIND, NS)
    assert not (daemon.imexd / imex.CONFIG_FILE).exists()
    wait(lambda: "idle until terminated" in daemon.log(), "the idle log line")
    assert daemon.terminate() == 0


def test_missing_compute_domain_uuid_is_the_cdi_error(short_dir: Path,
                                                      world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]
                                                      ) -> None:
    api, env, _ = world
    daemon = Daemon(env, short_dir, api, "node-y", f"{loopback_prefix()}.1", "cd-daemon-y")
    daemon.env["COMPUTE_DOMAIN_UUID"] = ""
    done = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-daemon", "run"], env=daemon.env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "is CDI enabled in your container runtime?" in done.stderr
    pod = api.get("Pod", daemon.pod, NS)
    assert pod is not None and cd.LABEL_CLIQUE_ID not in pod["metadata"].get("labels", {})  # failed before anything
    assert not api.objects(cd.CLIQUE_KIND, NS)


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    return sorted(int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                  for c in (task / "children").read_text().split())


def test_concurrent_joins_get_distinct_indexes_and_a_crashed_imex_is_restarted(
        short_dir: Path, world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]) -> None:
    api, env, daemons = world
    prefix = loopback_prefix()
    daemons.extend(Daemon(env, short_dir, api, f"node-{i}", f"{prefix}.{i + 1}", f"cd-daemon-{i}") for i in range(3))
    for daemon in daemons:
        daemon.start()
    wait(lambda: len(_entries(api)) == 3 and all("index" in e for e in _entries(api).values()),
         "three clique entries with the controller's indexes")
    assert sorted(e["index"] for e in _entries(api).values()) == [0, 1, 2]
    indexes = {n: e["index"] for n, e in _entries(api).items()}
    for daemon in daemons:
        daemon.wait_ready(f"{daemon.pod} READY")
    assert daemons[0].proc is not None
    wait(lambda: len(_children(daemons[0].proc.pid)) == 1, "nvidia-imex under the daemon")
    (imex_pid,) = _children(daemons[0].proc.pid)
    os.kill(imex_pid, signal.SIGKILL)
    wait(lambda: f"nvidia-imex (pid {imex_pid}) was killed by SIGKILL" in daemons[0].log(), "the watchdog noticing")
    wait(lambda: _children(daemons[0].proc.pid) not in ([], [imex_pid]), "a new nvidia-imex")
    for daemon in daemons:
        daemon.wait_ready(f"{daemon.pod} READY after the restart")
    assert {n: e["index"] for n, e in _entries(api).items()} == indexes


def test_a_pod_ip_reused_by_another_domain_fails_the_handshake_until_the_stale_entry_goes(
        short_dir: Path, world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]) -> None:
    """Two domains in one clique (NVIDIA #1447/#1448): domain X's daemon on node-1 is force-deleted (its entry
    stays) and domain Y's new daemon there gets the same pod IP. X's node-0 still maps X's name for slot 1 to
    that IP; Y's nvidia-imex refuses the handshake for X's name, so X's node-0 is not READY and Y's own state is
    unaffected. Once the stale entry is pruned (the controller's job), X's node-0 gets SIGUSR1 and is READY."""
    api, env, daemons = world
    other = "9f0e8d7c-6b5a-4c3d-8e2f-0123456789ab"
    prefix = loopback_prefix()
    x0 = Daemon(env, short_dir, api, "node-0", f"{prefix}.1", "x-daemon-0")
    x1 = Daemon(env, short_dir, api, "node-1", f"{prefix}.2", "x-daemon-1")
    daemons.extend((x0, x1))
    for daemon in (x0, x1):
        daemon.start()
        wait(lambda d=daemon: "index" in _entries(api).get(d.node, {}), f"{daemon.node}'s clique entry and index")
    for daemon in (x0, x1):
        daemon.wait_ready(f"{daemon.pod} READY")
    x1.kill()
    y1 = Daemon(env, short_dir, api, "node-1", f"{prefix}.2", "y-daemon-1", cd_uid=other)
    daemons.append(y1)
    y1.start()
    x_name, y_name = cd.dns_name(CD_UID, 1), cd.dns_name(other, 0)
    wait(lambda: f"asked for node '{x_name}', but this node is '{y_name}'" in y1.log(), "Y's refusal")
    wait(lambda: "refused by the peer" in x0.log(), "X's node-0 told why")
    assert x0.check().returncode == 1
    y1.wait_ready("Y's lone daemon READY")
    x_clique = api.get(cd.CLIQUE_KIND, cd.clique_object_name(CD_UID, CLIQUE), NS)
    y_clique = api.get(cd.CLIQUE_KIND, cd.clique_object_name(other, CLIQUE), NS)
    assert x_clique is not None and y_clique is not None
    assert [e["index"] for e in y_clique["daemons"]] == [0]
    x_clique["daemons"] = [e for e in x_clique["daemons"] if e["nodeName"] != "node-1"]  # the controller's prune
    api.update(x_clique)
    wait(lambda: "SIGUSR1 received" in x0.log(), "X's node-0 signalled")
    x0.wait_ready("X's node-0 READY alone")
    assert y_name not in x0.hosts.read_text() and x_name not in y1.hosts.read_text()


def test_a_daemon_claim_without_the_config_template_fails_clearly(
        short_dir: Path, world: tuple[ApiServerEmulator, dict[str, str], list[Daemon]]) -> None:
    api, env, _ = world
    daemon = Daemon(env, short_dir, api, "node-z", f"{loopback_prefix()}.1", "cd-daemon-z")
    (daemon.imexd / imex.CONFIG_TEMPLATE_FILE).unlink()
    done = subprocess.run([sys.executable, "-m", "dradriver", "compute-domain-daemon", "run"], env=daemon.env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert f"{daemon.imexd / imex.CONFIG_TEMPLATE_FILE} is missing" in done.stderr
    assert not api.objects(cd.CLIQUE_KIND, NS)
