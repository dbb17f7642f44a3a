"""The ``webhook`` executable over real HTTPS, called by the API emulator as kube-apiserver calls a validating
webhook: the ValidatingWebhookConfiguration is the one in ``deploy/kustomize/components/webhook`` (its Service
routed to the process, its ``caBundle`` the test's certificate), claims and templates are written with the
official client, and a refusal comes back as ``admission webhook "gpu.nvidia.com" denied the request: ...``.
The ``v1beta1``/``v1beta2`` reviews (the emulator serves ``resource.k8s.io/v1`` only) are built by the
emulator's own review builder from the stored object in that version's shape and POSTed to the webhook."""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from dradriver.domain import configs
from dradriver.domain.computedomains import ComputeDomainError, parse_channel_config
from dradriver.domain.featuregates import parse_feature_gates
from dradriver.sandbox.apiserver import ApiServerEmulator
from dradriver.sandbox.apiserver.webhooks import review_for

from .tls import (
    REPO,
    Certificate,
    free_port,
    make_certificate,
    readyz,
    running_webhook,
    webhook_argv,
    webhook_env,
)

MANIFEST = REPO / "deploy" / "kustomize" / "components" / "webhook" / "webhook.yaml"
GATES = "TimeSlicingSettings=true,"
PATH = "/validate-resource-claim-parameters"
DENIED = 'admission webhook "gpu.nvidia.com" denied the request: '
NS = "default"


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", **fields}


def time_slicing(interval: str = "Long") -> dict[str, Any]:
    return gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})


def opaque(parameters: Any, driver: str = "gpu.nvidia.com", requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def claim_spec(*config: dict[str, Any], admin: bool = False) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if admin:
        exactly["adminAccess"] = True
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}], "config": list(config)}}


def claim(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def template(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec}}


def prepare_error(parameters: Any, index: int = 0) -> str:
    """The error Prepare's config functions give for ``parameters`` at ``status.allocation...config[index]``."""
    where = f"status.allocation.devices.config[{index}].opaque.parameters"
    gates = parse_feature_gates(GATES)
    try:
        configs.validate(configs.normalize(configs.decode(parameters, where), gates), gates, where)
    except configs.DeviceConfigError as exc:
        return str(exc)
    raise AssertionError(f"{parameters!r} passes Prepare's checks")


@dataclass
class Setup:
    api: ApiServerEmulator
    client: Any
    cert: Certificate
    port: int
    tmp: Path

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj`` over HTTP with the official client; the created object."""
        body = copy.deepcopy(obj)
        if obj["kind"] == "ResourceClaim":
            made = kubernetes.client.ResourceV1Api(self.client).create_namespaced_resource_claim(NS, body)
        else:
            made = kubernetes.client.ResourceV1Api(self.client).create_namespaced_resource_claim_template(NS, body)
        return dict(self.client.sanitize_for_serialization(made))

    def refused(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj`` and return the Status the API answered with (the create must fail)."""
        with pytest.raises(kubernetes.client.ApiException) as caught:
            self.create(obj)
        status: dict[str, Any] = json.loads(caught.value.body)
        status["httpCode"] = caught.value.status
        return status

    def post(self, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        request = urllib.request.Request(f"https://localhost:{self.port}{PATH}", data=body, method="POST",
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, context=self.cert.context(), timeout=10) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("webhook")
    cert = make_certificate(tmp / "cert")
    port = free_port()
    env = webhook_env(FEATURE_GATES=GATES)
    with running_webhook(webhook_argv(cert, port), env, port, cert.context(), tmp / "webhook.log"), \
            ApiServerEmulator() as api:
        [configuration] = [o for o in yaml.safe_load_all(MANIFEST.read_text())
                           if o["kind"] == "ValidatingWebhookConfiguration"]
        configuration["webhooks"][0]["clientConfig"]["caBundle"] = base64.b64encode(cert.cert.read_bytes()).decode()
        service = configuration["webhooks"][0]["clientConfig"]["service"]
        api.route_service(service["namespace"], service["name"], "127.0.0.1", port)
        client = kubernetes.config.new_client_from_config_dict(api.kubeconfig())
        kubernetes.client.AdmissionregistrationV1Api(client).create_validating_webhook_configuration(configuration)
        yield Setup(api, client, cert, port, tmp)


# --- through the API emulator (resource.k8s.io/v1) ---------------------------------------------------------------


def test_readyz_answers_ok_over_https_on_ipv4_and_ipv6(setup: Setup) -> None:
    """Without --bind-address the webhook listens on every address of both families, as NVIDIA's ``:<port>``
    (an IPv6-only cluster reaches it at the pod's IPv6 address)."""
    for host in ("127.0.0.1", "[::1]"):
        assert readyz(setup.port, setup.cert.context(), host) == "ok"


def test_a_claim_and_a_template_with_valid_gpu_configs_are_created(setup: Setup) -> None:
    made = setup.create(claim("valid", claim_spec(opaque(time_slicing()), opaque(gpu_config()))))
    assert made["metadata"]["uid"]
    assert setup.create(template("valid", claim_spec(opaque(time_slicing("Short")))))["metadata"]["uid"]
    assert setup.api.get("ResourceClaim", "valid", NS) is not None


def test_an_invalid_gpu_config_is_refused_with_the_message_prepare_gives(setup: Setup) -> None:
    bad = gpu_config(sharing={"strategy": "MPS"})  # MPSSupport is off
    status = setup.refused(claim("mps", claim_spec(opaque(gpu_config()), opaque(bad))))
    expected = prepare_error(bad, 1).replace("status.allocation.devices", "spec.devices")
    assert status["message"] == f"{DENIED}1 configs failed to validate: {expected}"
    assert expected.startswith("spec.devices.config[1].opaque.parameters.sharing.strategy: ")
    assert (status["httpCode"], status["code"], status["reason"]) == (400, 400, "Invalid")
    assert setup.api.get("ResourceClaim", "mps", NS) is None


def test_a_template_config_is_refused_at_its_spec_spec_path(setup: Setup) -> None:
    bad = time_slicing("Sometimes")
    status = setup.refused(template("interval", claim_spec(opaque(bad))))
    expected = prepare_error(bad).replace("status.allocation.devices", "spec.spec.devices")
    assert status["message"] == f"{DENIED}1 configs failed to validate: {expected}"
    assert "unknown time-slice interval: Sometimes" in expected


def test_an_unknown_field_is_refused_naming_it(setup: Setup) -> None:
    status = setup.refused(claim("unknown", claim_spec(opaque(gpu_config(sharng={"strategy": "TimeSlicing"})))))
    assert status["message"] == (f"{DENIED}1 configs failed to validate: spec.devices.config[0].opaque.parameters."
                                 "sharng: unknown field (known fields: apiVersion, kind, sharing)")


def test_every_bad_config_is_named_in_one_message_in_config_order(setup: Setup) -> None:
    first = gpu_config(sharing={"strategy": "Sharing"})
    second = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"}
    third = {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}
    status = setup.refused(claim("three", claim_spec(opaque(first), opaque(gpu_config()), opaque(second),
                                                     opaque(third))))
    errors = [prepare_error(p, i).replace("status.allocation.devices", "spec.devices")
              for i, p in ((0, first), (2, second), (3, third))]
    assert status["message"] == f"{DENIED}3 configs failed to validate: {'; '.join(errors)}"


def test_compute_domain_configs_are_decoded_as_the_compute_domain_plugin_does(setup: Setup) -> None:
    good = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
            "domainID": "4f1d3c5e-0000-4000-8000-000000000001", "allocationMode": "All"}
    setup.create(claim("cd-good", claim_spec(opaque(good, "compute-domain.nvidia.com"))))
    bad = {**good, "allocationMode": "Every"}
    status = setup.refused(claim("cd-bad", claim_spec(opaque(bad, "compute-domain.nvidia.com"))))
    where = "spec.devices.config[0].opaque.parameters"
    with pytest.raises(ComputeDomainError) as plugin:
        parse_channel_config(bad, where)
    assert status["message"] == f"{DENIED}1 configs failed to validate: {plugin.value}"
    wrong_kind = {**good, "kind": "GpuConfig"}
    status = setup.refused(claim("cd-kind", claim_spec(opaque(wrong_kind, "compute-domain.nvidia.com"))))
    assert status["message"] == (f"{DENIED}1 configs failed to validate: {where}.kind: 'GpuConfig' is not one of "
                                 "'ComputeDomainChannelConfig', 'ComputeDomainDaemonConfig'")


def test_admin_access_with_a_sharing_strategy_is_refused(setup: Setup) -> None:
    status = setup.refused(claim("admin", claim_spec(opaque(time_slicing()), admin=True)))
    assert status["message"].startswith(f"{DENIED}1 configs failed to validate: spec.devices.config[0].opaque."
                                        "parameters.sharing.strategy: \"TimeSlicing\" cannot apply to request "
                                        '"gpu": it has adminAccess')
    # a config naming the request without sharing wins over the general one below it: admitted
    spec = claim_spec(opaque(time_slicing()), opaque(gpu_config(), requests=["gpu"]), admin=True)
    assert setup.create(claim("admin-plain", spec))["metadata"]["uid"]


def test_other_drivers_configs_are_not_looked_at(setup: Setup) -> None:
    made = setup.create(claim("other", claim_spec(opaque({"anything": ["goes"]}, "example.com/driver"))))
    assert made["spec"]["devices"]["config"][0]["opaque"]["driver"] == "example.com/driver"


def test_a_webhook_that_cannot_be_reached_fails_the_write_unless_its_policy_is_ignore(setup: Setup) -> None:
    [configuration] = [o for o in yaml.safe_load_all(MANIFEST.read_text())
                       if o["kind"] == "ValidatingWebhookConfiguration"]
    hook = configuration["webhooks"][0]
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{free_port()}{PATH}",
                            "caBundle": base64.b64encode(setup.cert.cert.read_bytes()).decode()}
    configuration["metadata"]["name"] = "unreachable"
    admission = kubernetes.client.AdmissionregistrationV1Api(setup.client)
    admission.create_validating_webhook_configuration(configuration)
    try:
        status = setup.refused(claim("down", claim_spec()))
        assert status["httpCode"] == 500 and status["reason"] == "InternalError"
        assert 'failed calling webhook "gpu.nvidia.com"' in status["message"]
        hook["failurePolicy"] = "Ignore"
        current = admission.read_validating_webhook_configuration("unreachable")
        configuration["metadata"]["resourceVersion"] = current.metadata.resource_version
        admission.replace_validating_webhook_configuration("unreachable", configuration)
        assert setup.create(claim("down", claim_spec()))["metadata"]["uid"]
    finally:
        admission.delete_validating_webhook_configuration("unreachable")


def test_a_claim_stored_before_the_webhook_stays_writable_and_deletable(setup: Setup) -> None:
    """A claim whose config the webhook would refuse (stored before it ran, or before the gates changed) still
    takes metadata writes: the scheduler's finalizer, its removal at deletion."""
    bad = claim("before", claim_spec(opaque(gpu_config(sharing={"strategy": "MPS"}))))
    setup.api.create(bad | {"metadata": {"name": "before", "namespace": NS}})  # in-process: no admission
    resource = kubernetes.client.ResourceV1Api(setup.client)
    resource.patch_namespaced_resource_claim("before", NS, {"metadata": {"finalizers": ["example.com/hold"]}})
    resource.delete_namespaced_resource_claim("before", NS)
    resource.patch_namespaced_resource_claim("before", NS, {"metadata": {"finalizers": None}})
    assert setup.api.get("ResourceClaim", "before", NS) is None


# --- every served version, straight over HTTPS -------------------------------------------------------------------


def in_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
    """``obj`` (v1) in ``resource.k8s.io/<version>``'s shape: v1beta1 has the exact request's fields on the
    request itself; v1beta2 is v1's shape."""
    out = copy.deepcopy(obj)
    out["apiVersion"] = f"resource.k8s.io/{version}"
    spec = out["spec"]["spec"] if out["kind"] == "ResourceClaimTemplate" else out["spec"]
    if version == "v1beta1":
        for request in spec["devices"]["requests"]:
            request.update(request.pop("exactly", {}))
    return out


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
@pytest.mark.parametrize("kind", ["ResourceClaim", "ResourceClaimTemplate"])
def test_every_served_version_of_claims_and_templates_is_validated(setup: Setup, version: str, kind: str) -> None:
    api = setup.api
    make, spec_path = (claim, "spec") if kind == "ResourceClaim" else (template, "spec.spec")
    rt = replace(api.resource_type(kind, "resource.k8s.io/v1"), version=version)
    name = f"{version}-{kind.lower()}"
    stored = api.create(make(name, claim_spec(opaque(time_slicing()), admin=False)) | {"metadata": {
        "name": name, "namespace": NS}})
    review = review_for(rt, "CREATE", in_version(stored, version), None)
    status, body = setup.post(json.dumps(review).encode())
    answer = json.loads(body)
    assert status == 200 and answer["response"] == {"uid": review["request"]["uid"], "allowed": True}
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")

    bad = make(name, claim_spec(opaque(time_slicing("Sometimes")), admin=True))
    review = review_for(rt, "UPDATE", in_version(bad, version), in_version(stored, version))
    status, body = setup.post(json.dumps(review).encode())
    response = json.loads(body)["response"]
    assert status == 200 and response["allowed"] is False and response["status"]["reason"] == "Invalid"
    expected = prepare_error(time_slicing("Sometimes")).replace("status.allocation", spec_path)
    assert response["status"]["message"] == f"1 configs failed to validate: {expected}"
    # admin access is read from `exactly` (v1, v1beta2) and from the request itself (v1beta1)
    shared = make(name, claim_spec(opaque(time_slicing()), admin=True))
    review = review_for(rt, "CREATE", in_version(shared, version), None)
    response = json.loads(setup.post(json.dumps(review).encode())[1])["response"]
    assert '"gpu": it has adminAccess' in response["status"]["message"]


def test_another_content_type_is_415(setup: Setup) -> None:
    review = review_for(setup.api.resource_type("ResourceClaim"), "CREATE", claim("x", claim_spec()), None)
    status, body = setup.post(json.dumps(review).encode(), "text/plain")
    assert (status, body.decode().strip()) == (415, "contentType=text/plain, expected application/json")


@pytest.mark.parametrize(("body", "problem"), [
    (b"{not json", "request could not be decoded"),
    (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}',
     "unsupported group version kind: admission.k8s.io/v1beta1, Kind=AdmissionReview"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "has no request"),
])
def test_a_malformed_review_is_400(setup: Setup, body: bytes, problem: str) -> None:
    status, text = setup.post(body)
    assert status == 400 and text.decode().startswith("failed to read AdmissionReview from request body: ")
    assert problem in text.decode()


def test_a_review_of_another_resource_is_refused_as_a_bad_request(setup: Setup) -> None:
    review = review_for(setup.api.resource_type("ConfigMap"), "CREATE", {"metadata": {"name": "c"}}, None)
    response = json.loads(setup.post(json.dumps(review).encode())[1])["response"]
    assert response["allowed"] is False and response["status"]["reason"] == "BadRequest"
    assert response["status"]["message"] == ("expected resource to be one of the supported versions for "
                                             "resourceclaims or resourceclaimtemplates, got /v1, Resource=configmaps")


# --- TLS --------------------------------------------------------------------------------------------------------


def test_a_rotated_certificate_is_served_to_the_next_connection(tmp_path: Path) -> None:
    old = make_certificate(tmp_path / "old")
    live = Certificate(tmp_path / "live.crt", tmp_path / "live.key")
    shutil.copy(old.cert, live.cert)
    shutil.copy(old.key, live.key)
    port = free_port()
    with running_webhook(webhook_argv(live, port), webhook_env(), port, old.context(), tmp_path / "log"):
        new = make_certificate(tmp_path / "new")
        shutil.copy(new.key, live.key)  # cert-manager's Secret update: the key first, then the certificate
        assert readyz(port, old.context()) == "ok"  # a half-written pair keeps the old one
        shutil.copy(new.cert, live.cert)
        assert readyz(port, new.context()) == "ok"
        with pytest.raises(urllib.error.URLError):
            readyz(port, old.context())


@pytest.mark.parametrize(("args", "code", "problem"), [
    ([], 2, "webhook: --tls-cert-file (env TLS_CERT_FILE) is required"),
    (["--tls-cert-file=/c"], 2, "webhook: --tls-private-key-file (env TLS_PRIVATE_KEY_FILE) is required"),
    (["--tls-cert-file=/c", "--tls-private-key-file=/k", "--port=70000"], 2,
     "webhook: --port (env WEBHOOK_PORT) 70000 is not a TCP port"),
    (["--tls-cert-file=/nonexistent/tls.crt", "--tls-private-key-file=/nonexistent/tls.key"], 1,
     "cannot start the webhook: [Errno 2] No such file or directory: '/nonexistent/tls.crt'"),
])
def test_the_webhook_does_not_start_without_a_certificate_it_can_load(args: list[str], code: int, problem: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "dradriver", "webhook", *args], env=webhook_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == code and problem in proc.stderr, proc.stderr


def test_a_vfio_config_is_admitted_with_passthrough_support_and_refused_without(setup: Setup, tmp_path: Path) -> None:
    """NVIDIA's webhook refuses ``VfioDeviceConfig`` ("expected a recognized configuration type") though its plugin
    takes it; dradriver's admits it when ``PassthroughSupport`` is on and refuses it, naming the gate, when off."""
    vfio = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "PreferIommuFD", "enableAPIDevice": True}}
    obj = claim("vm", claim_spec(opaque(vfio)))
    rt = setup.api.resource_type("ResourceClaim", "resource.k8s.io/v1")
    review = review_for(rt, "CREATE", obj, None)
    status = setup.refused(obj)  # the module's webhook runs without the gate
    assert status["message"] == (f"{DENIED}1 configs failed to validate: spec.devices.config[0].opaque.parameters."
                                 'kind: VfioDeviceConfig needs the "PassthroughSupport" feature gate (VFIO '
                                 "passthrough devices exist only with it)")
    port = free_port()
    env = webhook_env(FEATURE_GATES="PassthroughSupport=true,")
    with running_webhook(webhook_argv(setup.cert, port), env, port, setup.cert.context(), tmp_path / "log"):
        on = Setup(setup.api, setup.client, setup.cert, port, tmp_path)
        code, body = on.post(json.dumps(review).encode())
        assert code == 200 and json.loads(body)["response"] == {"uid": review["request"]["uid"], "allowed": True}
        bad = claim("vm", claim_spec(opaque({**vfio, "iommu": {"backendPolicy": "IommuFDOnly"}})))
        code, body = on.post(json.dumps(review_for(rt, "CREATE", bad, None)).encode())
        response = json.loads(body)["response"]
        assert response["allowed"] is False
        assert response["status"]["message"].startswith(
            "1 configs failed to validate: spec.devices.config[0].opaque.parameters.iommu.backendPolicy: unknown")
