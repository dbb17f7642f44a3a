"""Types of the compiled NVML poller ``ext/nvmlpoll.pyx`` (twin: ``dradriver/_native/nvmlpoll_py.py``)."""

from collections.abc import Sequence

from dradriver._native.nvmlfields import Sample

class Poller:
    """Samples ``fields`` for every device in ``uuids`` on each :meth:`poll`.

    :param library: the ``libnvidia-ml.so.1`` file to use (the NVML session's); ``None``: the one the dynamic
        loader finds by that name.
    :raises PollerError: the library cannot be opened or is not the one given, NVML cannot be initialised, or a
        UUID is unknown.
    :raises ValueError: an unknown field name.
    """

    @property
    def library(self) -> str:
        """The NVML library the poller samples through (the file given, or ``libnvidia-ml.so.1``)."""

    @property
    def devices(self) -> tuple[str, ...]:
        """Device UUIDs in sample row order."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Field names in sample column order."""

    def __init__(
        self, uuids: Sequence[str], fields: Sequence[str] | None = None, library: str | None = None
    ) -> None: ...
    def close(self) -> None:
        """Release the NVML reference taken at construction. Idempotent."""

    def __enter__(self) -> Poller: ...
    def __exit__(self, *exc: object) -> None: ...
    def poll(self) -> Sample:
        """Sample every device and field once.

        :raises PollerError: the poller is closed.
        """
