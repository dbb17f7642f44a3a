"""The API emulator's garbage collector with several owners: a ComputeDomainClique owned by every daemon Pod
stays while one of them exists (the dangling reference is dropped) and goes with the last."""

from __future__ import annotations

from dradriver.domain import computedomains as cd
from dradriver.sandbox.apiserver import ApiServerEmulator


def _pod(api: ApiServerEmulator, name: str) -> dict[str, str]:
    obj = api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                      "spec": {"containers": [{"name": "c", "image": "i"}]}})
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": obj["metadata"]["uid"]}


def test_a_dependent_with_a_live_owner_survives_and_goes_with_the_last() -> None:
    api = ApiServerEmulator()
    owners = [_pod(api, "a"), _pod(api, "b")]
    api.create({"apiVersion": cd.API_GROUP_VERSION, "kind": cd.CLIQUE_KIND,
                "metadata": {"name": "uid.1", "namespace": "default", "ownerReferences": owners}, "daemons": []})
    api.delete("Pod", "a", "default")
    kept = api.get(cd.CLIQUE_KIND, "uid.1", "default")
    assert kept is not None and kept["metadata"]["ownerReferences"] == [owners[1]]
    api.delete("Pod", "b", "default")
    assert api.get(cd.CLIQUE_KIND, "uid.1", "default") is None
