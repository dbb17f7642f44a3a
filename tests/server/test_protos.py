"""The generated code is current and speaks the kubelet's wire contract (kubelet-dra-protocol.md 1-3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from dradriver._proto import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2
from dradriver.server import start_servers

from .conftest import TablePreparer, make_config, run

REPO_ROOT = Path(__file__).resolve().parents[2]

# (module, message) -> {field name: (number, label, type)} from the reference tables.
REPEATED, OPTIONAL = "repeated", "optional"
FIELDS = {
    (pluginregistration_v1_pb2, "PluginInfo"): {
        "type": (1, OPTIONAL, "string"),
        "name": (2, OPTIONAL, "string"),
        "endpoint": (3, OPTIONAL, "string"),
        "supported_versions": (4, REPEATED, "string"),
    },
    (pluginregistration_v1_pb2, "RegistrationStatus"): {
        "plugin_registered": (1, OPTIONAL, "bool"),
        "error": (2, OPTIONAL, "string"),
    },
    (pluginregistration_v1_pb2, "InfoRequest"): {},
    (pluginregistration_v1_pb2, "RegistrationStatusResponse"): {},
    (dra_health_v1alpha1_pb2, "NodeWatchResourcesRequest"): {},
    (dra_health_v1alpha1_pb2, "NodeWatchResourcesResponse"): {"devices": (1, REPEATED, "message")},
    (dra_health_v1alpha1_pb2, "DeviceHealth"): {
        "device": (1, OPTIONAL, "message"),
        "health": (2, OPTIONAL, "enum"),
        "last_updated_time": (3, OPTIONAL, "int64"),
        "health_check_timeout_seconds": (4, OPTIONAL, "int64"),
        "message": (5, OPTIONAL, "string"),
    },
    (dra_health_v1alpha1_pb2, "DeviceIdentifier"): {
        "pool_name": (1, OPTIONAL, "string"),
        "device_name": (2, OPTIONAL, "string"),
    },
}
for module in (dra_v1_pb2, dra_v1beta1_pb2):
    FIELDS[(module, "NodePrepareResourcesRequest")] = {"claims": (1, REPEATED, "message")}
    FIELDS[(module, "NodePrepareResourcesResponse")] = {"claims": (1, REPEATED, "message")}  # map
    FIELDS[(module, "NodePrepareResourceResponse")] = {
        "devices": (1, REPEATED, "message"),
        "error": (2, OPTIONAL, "string"),
    }
    FIELDS[(module, "NodeUnprepareResourcesRequest")] = {"claims": (1, REPEATED, "message")}
    FIELDS[(module, "NodeUnprepareResourcesResponse")] = {"claims": (1, REPEATED, "message")}
    FIELDS[(module, "NodeUnprepareResourceResponse")] = {"error": (1, OPTIONAL, "string")}
    FIELDS[(module, "Claim")] = {
        "namespace": (1, OPTIONAL, "string"),
        "uid": (2, OPTIONAL, "string"),
        "name": (3, OPTIONAL, "string"),
    }
    FIELDS[(module, "Device")] = {
        "request_names": (1, REPEATED, "string"),
        "pool_name": (2, OPTIONAL, "string"),
        "device_name": (3, OPTIONAL, "string"),
        "cdi_device_ids": (4, REPEATED, "string"),
    }
FIELDS[(dra_v1_pb2, "Device")]["share_id"] = (5, OPTIONAL, "string")


def _type_name(field: object) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    names = {
        FieldDescriptor.TYPE_STRING: "string",
        FieldDescriptor.TYPE_BOOL: "bool",
        FieldDescriptor.TYPE_INT64: "int64",
        FieldDescriptor.TYPE_MESSAGE: "message",
        FieldDescriptor.TYPE_ENUM: "enum",
    }
    return names[field.type]  # type: ignore[attr-defined]


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("key", list(FIELDS), ids=lambda k: f"{k[0].DESCRIPTOR.package}.{k[1]}")
def test_field_numbers_match_the_kubelet(key: tuple[ModuleType, str]) -> None:
    module, message = key
    descriptor = module.DESCRIPTOR.message_types_by_name[message]
    actual = {f.name: (f.number, REPEATED if f.is_repeated else OPTIONAL, _type_name(f)) for f in descriptor.fields}
    assert actual == FIELDS[key]


def test_packages_services_and_enum() -> None:
    assert pluginregistration_v1_pb2.DESCRIPTOR.package == "pluginregistration"
    assert dra_v1_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert dra_v1beta1_pb2.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert dra_health_v1alpha1_pb2.DESCRIPTOR.package == "v1alpha1"
    assert dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    stream = dra_health_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name[
        "NodeWatchResources"
    ]
    assert stream.server_streaming and not stream.client_streaming
    assert dict(dra_health_v1alpha1_pb2.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_raw_wire_calls_on_the_kubelet_method_paths(short_dir: Path) -> None:
    """Hand-encoded protobuf bytes on the literal method paths, independent of our generated stubs."""
    # Claim{namespace=1:"ns", uid=2:"u1", name=3:"c"} inside NodePrepareResourcesRequest.claims (field 1)
    claim = b"\x0a\x02ns" + b"\x12\x02u1" + b"\x1a\x01c"
    prepare_request = b"\x0a" + bytes([len(claim)]) + claim

    async def scenario() -> tuple[bytes, bytes, bytes]:
        config = make_config(short_dir)
        async with await start_servers(config, TablePreparer()):
            async with grpc.aio.insecure_channel(f"unix:{config.registration_socket}") as channel:
                get_info = channel.unary_unary(
                    "/pluginregistration.Registration/GetInfo",
                    request_serializer=None,
                    response_deserializer=None,
                )
                info = await get_info(b"", timeout=1)
            async with grpc.aio.insecure_channel(f"unix:{config.dra_socket}") as channel:
                calls = [
                    channel.unary_unary(
                        f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin/NodePrepareResources",
                        request_serializer=None,
                        response_deserializer=None,
                    )(prepare_request, timeout=5)
                    for version in ("v1", "v1beta1")
                ]
                v1, v1beta1 = [await call for call in calls]
            return info, v1, v1beta1

    info_bytes, v1_bytes, v1beta1_bytes = run(scenario())
    info = pluginregistration_v1_pb2.PluginInfo.FromString(info_bytes)
    assert info.type == "DRAPlugin" and info.name == "gpu.nvidia.com"
    assert b"\x0a\x09DRAPlugin" in info_bytes  # field 1, "DRAPlugin"
    for raw in (v1_bytes, v1beta1_bytes):
        response = dra_v1_pb2.NodePrepareResourcesResponse.FromString(raw)
        assert list(response.claims) == ["u1"]
        (device,) = response.claims["u1"].devices
        assert device.cdi_device_ids == ["k8s.gpu.nvidia.com/claim=u1-gpu-0"]
        assert b"\x1a\x05gpu-0" in raw  # Device.device_name is field 3
