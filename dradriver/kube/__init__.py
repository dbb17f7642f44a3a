"""The Kubernetes API boundary: the only package that imports the ``kubernetes`` client library.

Why a boundary: the driver needs a handful of API calls (read a ResourceClaim, read the Node, publish
this node's ResourceSlices, write an Event), and each of them has failure modes (404 for a deleted
claim, 409 for a stale ``resourceVersion``, 429 and 5xx under load, a lost connection) that the rest of
the driver must handle without knowing which HTTP library sits underneath. So:

* ``client``: :func:`client.open_client` builds a :class:`client.KubeClient` from a kubeconfig or the
  in-cluster service account, with per-request timeouts and bounded exponential-backoff retries for 429,
  5xx and connection errors. Every call returns the API's JSON as plain dicts (``resource.k8s.io/v1``
  field names), never the client's model classes, so fields the client does not know survive.
* ``errors``: :class:`errors.KubeAPIError` and one subclass per HTTP status the driver reacts to; the
  client library's exception is chained as ``__cause__``. Code outside this package catches only these.
* ``claims``: GET a ResourceClaim; the conversion to :class:`dradriver.domain.claims.Claim` (UID check,
  allocation check, driver/pool filtering) is pure and lives in :mod:`dradriver.domain.claims`.
* ``resourceslices``: :class:`resourceslices.SlicePublisher` reconciles this node's pool of
  ResourceSlices the way the Go ``resourceslice`` controller does (``resourceslice/resourceslicecontroller.go`` in
  k8s.io/dynamic-resource-allocation).
* ``nodes`` and ``events``: read the Node (UID, allocatable), record Events about objects.

Swapping the client library (for example for an asyncio one) touches this package only.
"""
