"""A small Kubernetes API server emulator over real HTTP, for tests and ``dradriver demo``.

Why our own and not ``kmock``: kmock's ``KubernetesEmulator`` (0.8) stores objects as merged dicts with a
constant ``resourceVersion: '...'``, so it cannot answer an update with a stale ``resourceVersion`` with 409,
does not implement ``generateName``, field or label selectors, the ``status`` subresource, delete
preconditions, or watches that resume from a ``resourceVersion``. The driver's ResourceSlice reconciler and
claim reads depend on exactly those, so this module implements them on the standard library
(``http.server.ThreadingHTTPServer``; one thread per connection, chunked watch streams).

What it serves (paths and shapes as ``kube-apiserver`` 1.34 serves them):

* discovery: ``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/<group>``, ``/apis/<group>/<version>``,
  ``/healthz``, ``/livez``, ``/readyz``; OpenAPI ``/openapi/v2`` and ``/openapi/v3[/<group-version>]`` with
  Kubernetes 1.34's schemas, and the ``fieldValidation`` parameter on writes (``Strict``/``Warn``/``Ignore``),
  so ``kubectl apply`` validates as against kube-apiserver;
* server-side printing: ``meta.k8s.io/v1`` ``Table`` answers (``Accept: ...;as=Table``) with the columns
  ``kubectl get`` shows for ResourceSlices, ResourceClaims, Pods and Events;
* core ``v1``: ``namespaces``, ``nodes``, ``pods``, ``events``, ``configmaps``; ``events.k8s.io/v1``
  ``events``; ``resource.k8s.io/v1`` ``resourceslices``, ``deviceclasses``, ``resourceclaims``,
  ``resourceclaimtemplates``; ``admissionregistration.k8s.io/v1`` ``validatingwebhookconfigurations``, whose
  webhooks are called over HTTPS on every matching create and update (:mod:`.webhooks`);
* verbs: get, list (``labelSelector``, ``fieldSelector``), watch (``resourceVersion``, ``timeoutSeconds``;
  410 ``Expired`` when the history no longer reaches back), create (``generateName``), update (409 on a stale
  ``metadata.resourceVersion``), patch (JSON merge patch, strategic merge patch treated as merge patch, JSON
  patch), delete (``preconditions`` on uid and resourceVersion, finalizers, owner-reference cascade),
  deletecollection, and the ``status`` subresource (get/update/patch) where the real server has one;
* bodies: JSON, and Kubernetes protobuf (``application/vnd.kubernetes.protobuf``, as client-go sends it) for
  ResourceSlices, core and ``events.k8s.io`` Events, Nodes and ``Status`` errors; other kinds fall back to
  JSON or answer 415 / 406 like a CRD does (see :mod:`.protobuf` for the JSON mapping).

The server assigns ``metadata.uid``, ``resourceVersion`` (one counter for all objects, like etcd's revision),
``creationTimestamp`` and ``generation`` (bumped when anything outside ``metadata`` and ``status`` changes).
Errors are ``Status`` objects with the real server's ``reason``, ``code``, ``details`` and message wording.

Tests use it in process::

    with ApiServerEmulator() as api:
        kubeconfig = api.kubeconfig_path(tmp_path)
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
        api.fail_next(2, status=500, path="/apis/resource.k8s.io/v1/resourceslices")
        ...
        assert api.count("update", "resourceslices") == 1

No authentication or authorization is performed; every request is accepted as if from a cluster admin.

The package, by job:

* :mod:`.emulator` -- :class:`ApiServerEmulator`: lifecycle, kubeconfig, faults and records, in-process helpers;
* :mod:`.storage` -- objects, the resourceVersion counter, create/update/delete with their server fields;
* :mod:`.watch` -- the event log and watches (resumable, watch-list initial events);
* :mod:`.admission` -- metadata, ResourceSlice and ResourceClaim validation, the optional OpenAPI check;
* :mod:`.openapi` -- the OpenAPI documents and unknown-field validation; :mod:`.tables` -- ``Table`` answers;
* :mod:`.handler`, :mod:`.routes`, :mod:`.faults` -- HTTP: verb dispatch, paths and discovery, injected faults;
* :mod:`.media` and :mod:`.protobuf` -- content negotiation; JSON and Kubernetes protobuf bodies;
* :mod:`.resources` -- the resource types table and per-resource behaviour (status subresource, owners, Nodes);
* :mod:`.selectors` and :mod:`.patches` -- label/field selectors, merge patch and JSON patch;
* :mod:`.errors` -- ``Status`` errors.
"""

from dradriver.sandbox.apiserver.emulator import ApiServerEmulator
from dradriver.sandbox.apiserver.errors import ApiStatusError
from dradriver.sandbox.apiserver.handler import RequestRecord
from dradriver.sandbox.apiserver.resources import RESOURCE_TYPES, ResourceType
from dradriver.sandbox.apiserver.routes import SERVER_VERSION
from dradriver.sandbox.apiserver.selectors import Requirement, parse_field_selector, parse_label_selector

__all__ = [
    "RESOURCE_TYPES",
    "SERVER_VERSION",
    "ApiServerEmulator",
    "ApiStatusError",
    "RequestRecord",
    "Requirement",
    "ResourceType",
    "parse_field_selector",
    "parse_label_selector",
]
