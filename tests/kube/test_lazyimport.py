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
