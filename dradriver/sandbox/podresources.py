"""A kubelet's PodResources API, server side, for the sandbox and tests: ``v1.PodResourcesLister/List`` on a Unix
socket, answering with whatever ``provider`` returns (see :func:`dradriver.server.podresources.encode_response`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from dradriver._proto import podresources_v1_pb2_grpc


class _Lister(podresources_v1_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, provider: Callable[[], Any]) -> None:
        self.provider = provider
        self.calls = 0

    def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        return self.provider()


class PodResourcesServer:
    """Serves ``List`` on ``socket_path`` until :meth:`stop` (or the ``with`` block ends).

    :ivar calls: how many ``List`` calls were answered.
    """

    def __init__(self, socket_path: Path, provider: Callable[[], Any]) -> None:
        self.socket_path = socket_path
        self._lister = _Lister(provider)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        podresources_v1_pb2_grpc.add_PodResourcesListerServicer_to_server(self._lister, self._server)
        self._server.add_insecure_port(f"unix:{socket_path}")

    @property
    def calls(self) -> int:
        return self._lister.calls

    def start(self) -> PodResourcesServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> PodResourcesServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
