"""The thin gRPC layer between the kubelet and the batch runner (:mod:`dradriver.kubeletplugin.runner`).

Protobuf in, :class:`~dradriver.domain.claims.ClaimRef` out; :class:`~dradriver.domain.claims.ClaimResult`
in, protobuf out; no domain logic here. Modules: ``registration`` (pluginregistration.Registration),
``dra`` (DRAPlugin v1 and v1beta1), ``healthstream`` (DRA health stream), ``probe`` (grpc.health.v1), ``sockets``
(socket paths and the start/stop order); ``webhook`` (the admission webhook's HTTPS server, imported by the
``webhook`` command only). Entry point: :func:`start_servers`, then ``await servers.stop()``.
"""

from dradriver.server.sockets import Servers, SocketInUseError, SocketPathError, start_servers

__all__ = ["Servers", "SocketInUseError", "SocketPathError", "start_servers"]
