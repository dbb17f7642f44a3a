"""``deploy/kustomize/components/webhook`` (overlay ``overlays/webhook``): the admission webhook's Deployment,
Service and ValidatingWebhookConfiguration, against the ``webhook`` executable's flags and NVIDIA's
configuration (``nvidia-dra-driver.md`` 9.5). The overlay's objects are also validated against the Kubernetes
schemas by ``test_manifests.py`` (every overlay is)."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import yaml

from dradriver.commands import webhook
from dradriver.config import add_flags
from dradriver.domain.admission import SERVED_VERSIONS, VALIDATE_PATH, WEBHOOK_NAME
from dradriver.domain.featuregates import parse_feature_gates

from .manifests import KUSTOMIZE, Obj, container, env_of, kubectl, one, render

OVERLAY = "overlays/webhook"
NAME = "dradriver-webhook"


def _webhook_container(objs: tuple[Obj, ...]) -> Obj:
    return container(one(objs, "Deployment", NAME), "webhook")


def test_webhook_env_names_are_exactly_its_flag_twins_and_parse() -> None:
    ctr = _webhook_container(render(OVERLAY))
    env = env_of(ctr)
    assert set(env) == {flag.env for flag in webhook.FLAGS}
    parser = argparse.ArgumentParser()
    add_flags(parser, webhook.FLAGS, environ={name: entry["value"] for name, entry in env.items()})
    args = parser.parse_args([])
    assert (args.tls_cert_file, args.tls_private_key_file) == ("/cert/tls.crt", "/cert/tls.key")
    assert ctr["command"] == ["webhook"] and ctr["image"] == "dradriver:0.1.0"
    [port] = ctr["ports"]
    assert port["containerPort"] == args.port == 8443
    assert {m["mountPath"] for m in ctr["volumeMounts"]} == {"/cert"}
    for probe in (ctr["readinessProbe"], ctr["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/readyz", "port": "webhook", "scheme": "HTTPS"}


def test_the_configuration_is_nvidias_and_reaches_the_service() -> None:
    objs = render(OVERLAY)
    [hook] = one(objs, "ValidatingWebhookConfiguration", NAME)["webhooks"]
    assert hook["name"] == WEBHOOK_NAME and hook["sideEffects"] == "None" and hook["failurePolicy"] == "Fail"
    assert hook["admissionReviewVersions"] == ["v1"]
    [rule] = hook["rules"]
    assert rule["operations"] == ["CREATE", "UPDATE"] and rule["apiGroups"] == ["resource.k8s.io"]
    assert set(rule["apiVersions"]) == set(SERVED_VERSIONS)
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates"}
    service_ref = hook["clientConfig"]["service"]
    assert service_ref["path"] == VALIDATE_PATH
    service = one(objs, "Service", service_ref["name"])
    assert service["metadata"]["namespace"] == service_ref["namespace"]
    [port] = service["spec"]["ports"]
    assert port["port"] == service_ref["port"] and port["targetPort"] == "webhook"
    deployment = one(objs, "Deployment", NAME)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and deployment["spec"]["replicas"] >= 2


def test_the_webhook_judges_sharing_with_the_plugins_feature_gates(tmp_path: Path) -> None:
    """With the gpu-sharing component before it, the webhook gets the plugin's TimeSlicingSettings gate, so a
    time-slicing claim the plugin would prepare is not refused at admission."""
    here = Path(os.path.relpath(KUSTOMIZE, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(here / "base")],
        "components": [str(here / "components" / "gpu-sharing"), str(here / "components" / "webhook")]}))
    proc = subprocess.run([kubectl(), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    objs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    plugin = env_of(container(one(objs, "DaemonSet", "dradriver-kubelet-plugin"), "gpus"))["FEATURE_GATES"]
    gates = env_of(_webhook_container(objs))["FEATURE_GATES"]["value"]
    assert gates == plugin["value"] and parse_feature_gates(gates).time_slicing_settings
