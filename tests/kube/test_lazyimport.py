"""The ``kubernetes`` package with its subpackages imported on first use (start-up time, issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import importlib.metadata, json, sys
from dradriver.kube.lazyimport import defer_kubernetes_subpackages, is_deferred
first = defer_kubernetes_subpackages()
again = defer_kubernetes_subpackages()
from dradriver.kube import client
loaded = sorted(m for m in ("kubernetes.dynamic", "kubernetes.watch", "jsonschema", "kubernetes_validate")
                if m in sys.modules)
import kubernetes
watch = kubernetes.watch.Watch  # attribute access imports the subpackage, as the eager package had it
print(json.dumps({"first": first, "again": again, "deferred": is_deferred(), "loaded_by_client": loaded,
                  "watch": watch.__module__, "version_ok": kubernetes.__version__ ==
                  importlib.metadata.version("kubernetes"), "has_api_client": hasattr(kubernetes.client, "ApiClient")}))
"""


def test_only_what_is_used_is_imported_and_the_rest_on_first_use() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen == {"first": True, "again": False, "deferred": True, "loaded_by_client": [],
                    "watch": "kubernetes.watch.watch", "version_ok": True, "has_api_client": True}


def test_a_process_that_imported_kubernetes_is_left_alone() -> None:
    import kubernetes  # noqa: F401  (the test process has it already)

    from dradriver.kube.lazyimport import defer_kubernetes_subpackages, is_deferred

    assert defer_kubernetes_subpackages() is False
    assert not is_deferred()


_CONFIG_PROBE = """
import json, sys
from dradriver.kube.lazyimport import defer_kubernetes_subpackages
defer_kubernetes_subpackages()
from dradriver.kube import client, errors
HEAVY = ("kubernetes.config.kube_config", "oauthlib", "requests_oauthlib", "requests")
try:
    client.open_client("")  # in-cluster: no KUBERNETES_SERVICE_HOST here, so the library's own error
    in_cluster = "opened"
except errors.KubeAPIError as exc:
    in_cluster = exc.reason
after_in_cluster = sorted(m for m in HEAVY if m in sys.modules)
opened = client.open_client(sys.argv[1])  # a kubeconfig file: kube_config is imported now, and works
import kubernetes
print(json.dumps({"in_cluster": in_cluster, "after_in_cluster": after_in_cluster, "host": opened.host,
                  "after_kubeconfig": sorted(m for m in HEAVY if m in sys.modules),
                  "load_config": kubernetes.config.load_config.__module__,
                  "exception": kubernetes.config.ConfigException.__module__}))
"""

_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:6443"}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_in_cluster_config_needs_no_kubeconfig_auth_libraries(tmp_path: Path) -> None:
    """The DaemonSet's in-cluster load imports ``incluster_config`` only; a kubeconfig file still loads (and
    brings ``kube_config`` with its OAuth libraries) through the same deferred ``kubernetes.config``."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(_KUBECONFIG)
    out = subprocess.run([sys.executable, "-c", _CONFIG_PROBE, str(kubeconfig)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen == {"in_cluster": "ConfigInvalid", "after_in_cluster": [], "host": "http://127.0.0.1:6443",
                    "after_kubeconfig": ["kubernetes.config.kube_config", "oauthlib", "requests",
                                         "requests_oauthlib"],
                    "load_config": "kubernetes.config", "exception": "kubernetes.config.config_exception"}
