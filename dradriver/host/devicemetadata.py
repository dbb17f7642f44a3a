"""KEP-5304 device metadata files on the host: written under the plugin directory before the claim's CDI spec
names them, bind-mounted read-only by that spec, removed with it (format and paths:
:mod:`dradriver.domain.devicemetadata`).

Layout: ``<plugin dir>/dra-device-metadata/<claim UID>/<request>/<driver>-metadata.json`` (the Kubernetes
kubelet-plugin library keeps its files under ``<plugin data dir>/dra-device-metadata`` too; dradriver names the
claim's directory by UID rather than ``<namespace>_<name>``, so that a claim deleted and re-created under the same
name never shares files with the old one, and the orphan sweep needs only the claim state's UIDs). Files are
written atomically (temp name, rename), mode 0644, directories 0755: the container runtime reads them to bind-mount
them.

Crash safety: the files of a claim are written before its CDI spec, so a spec never names a missing file; a crash
between the two leaves files no spec names, of a claim the claim state has as half-prepared, which start-up
recovery rolls back and :meth:`DeviceMetadataFiles.sweep` removes (every claim directory whose UID is not a
claim the state keeps).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dradriver.domain import devicemetadata as dm
from dradriver.domain.cdi import CdiSpecError, ContainerEdits, Mount, check_claim_uid
from dradriver.domain.claims import Claim, ClaimRef
from dradriver.host.cdifiles import write_file_atomically

log = logging.getLogger(__name__)

SUBDIR = "dra-device-metadata"
FILE_MODE = 0o644
DIR_MODE = 0o755
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


class DeviceMetadataFiles:
    """The metadata files of one kubelet plugin.

    :param plugin_dir: the plugin's directory (``/var/lib/kubelet/plugins/<driver>``); files go under
        ``<plugin_dir>/dra-device-metadata``. It must be the same path on the host and in the plugin's container
        (it is, in NVIDIA's chart and dradriver's), because the CDI spec names the host path.
    :param driver: the driver name (``gpu.nvidia.com``): file name and ``devices[].driver``.
    :param pool: this node's pool name (``devices[].pool``).
    :param published: the attributes of the devices the plugin publishes now, by device name
        (:func:`dradriver.domain.devicemetadata.published_attributes` of its desired ResourceSlices).
    """

    def __init__(self, plugin_dir: Path, driver: str, pool: str,
                 published: Callable[[], Mapping[str, dm.Attributes]]) -> None:
        self.root = Path(plugin_dir) / SUBDIR
        self.driver = driver
        self.pool = pool
        self.published = published

    def claim_dir(self, claim_uid: str) -> Path:
        """The claim's directory (``<root>/<claim UID>``)."""
        return self.root / check_claim_uid(claim_uid)

    def write(self, claim: Claim, attributes: Mapping[str, Sequence[dm.Attributes]]) -> dict[str, ContainerEdits]:
        """Write one file per request of ``claim`` and return the mount of each, by the device that carries it
        (the first device of the request, as the kubelet-plugin library attaches its metadata CDI device).

        :param attributes: device name -> what the device's preparer adds to its published attributes (in order
            of precedence, after the published ones and :func:`~dradriver.domain.devicemetadata.runtime_attributes`
            which the caller includes).
        :raises CdiSpecError: a file cannot be written (names the claim and the path).
        """
        published = self.published()
        out: dict[str, ContainerEdits] = {}
        base = self.claim_dir(claim.ref.uid)
        for request, names in dm.requests_of(claim.results):
            devices = tuple(dm.MetadataDevice(self.pool, name, dm.merge_attributes(published.get(name),
                                                                                   *attributes.get(name, ())))
                            for name in names)
            meta = dm.RequestMetadata(request, devices)
            path = base / meta.base_request / dm.file_name(self.driver)
            try:
                os.makedirs(path.parent, mode=DIR_MODE, exist_ok=True)
                write_file_atomically(path, dm.encode(claim, meta, self.driver), mode=FILE_MODE, sync_dir=False)
            except OSError as exc:
                raise CdiSpecError(f"claim {claim.ref}: request {request!r}: cannot write device metadata file "
                                   f"{path}: {exc}") from exc
            mount = Mount(str(path), dm.container_path(claim, request, self.driver), MOUNT_OPTIONS)
            out[names[0]] = out.get(names[0], ContainerEdits()) + ContainerEdits(mounts=(mount,))
        return out

    def mounts(self, claim_uid: str) -> dict[str, ContainerEdits]:
        """The mounts of the files already written for a claim, read back from them (for rebuilding a lost CDI
        spec); ``{}`` when there are none. A file that cannot be read is skipped with a warning."""
        out: dict[str, ContainerEdits] = {}
        for path, _doc, claim, meta in self._written(claim_uid):
            mount = Mount(str(path), dm.container_path(claim, meta.request, self.driver), MOUNT_OPTIONS)
            device = meta.devices[0].name
            out[device] = out.get(device, ContainerEdits()) + ContainerEdits(mounts=(mount,))
        return out

    def rewrite(self, claim_uid: str, attributes: Mapping[str, Sequence[dm.Attributes]]) -> list[Path]:
        """Write the claim's files again with the attributes of its devices now, keeping its requests and devices
        (a driver reload changed ``driverVersion``; the mounts and paths stay): each file whose content changes is
        replaced atomically with ``metadata.generation`` one higher; returns the files rewritten. A container
        started from now on reads the new content (running ones keep the file they bind-mounted: a rename makes a
        new file).

        :param attributes: as for :meth:`write` (device name -> what its preparer adds now).
        :raises CdiSpecError: a file cannot be written (names the claim and the path).
        """
        published = self.published()
        rewritten: list[Path] = []
        for path, doc, claim, meta in self._written(claim_uid):
            devices = tuple(dm.MetadataDevice(d.pool, d.name, dm.merge_attributes(published.get(d.name),
                                                                                   *attributes.get(d.name, ())))
                            for d in meta.devices)
            if devices == meta.devices:
                continue
            generation = int(doc["metadata"].get("generation") or 1) + 1
            data = dm.encode(claim, dm.RequestMetadata(meta.request, devices), self.driver, generation=generation)
            try:
                write_file_atomically(path, data, mode=FILE_MODE, sync_dir=False)
            except OSError as exc:
                raise CdiSpecError(f"claim {claim.ref}: request {meta.request!r}: cannot rewrite device metadata "
                                   f"file {path}: {exc}") from exc
            rewritten.append(path)
        return rewritten

    def _written(self, claim_uid: str) -> Iterator[tuple[Path, Mapping[str, Any], Claim, dm.RequestMetadata]]:
        """Each usable file of a claim: its path, its first known object, the claim and the request it names (a
        file that cannot be read is skipped with a warning)."""
        base = self.claim_dir(claim_uid)
        try:
            requests = sorted(os.listdir(base))
        except FileNotFoundError:
            return
        for request in requests:
            path = base / request / dm.file_name(self.driver)
            try:
                doc = dm.first_known(dm.decode(path.read_bytes()))
                if doc is None:
                    raise dm.MetadataFormatError("no DeviceMetadata object of a known version")
                meta = doc["metadata"]
                entry = doc["requests"][0]
                claim = Claim(ClaimRef(meta["namespace"], meta["name"], meta["uid"]), (),
                              pod_claim_name=doc.get("podClaimName"))
                devices = tuple(dm.MetadataDevice(str(d["pool"]), str(d["name"]), d.get("attributes") or {})
                                for d in entry["devices"])
                if not devices:
                    raise dm.MetadataFormatError("a request without devices")
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                log.warning("device metadata file %s unusable, not mounted: %s", path, exc)
                continue
            yield path, doc, claim, dm.RequestMetadata(str(entry["name"]), devices)

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's files; True when there were some. A missing directory is not an error.

        :raises CdiSpecError: the directory exists but cannot be removed.
        """
        path = self.claim_dir(claim_uid)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CdiSpecError(f"claim {claim_uid}: cannot remove device metadata {path}: {exc}") from exc
        return True

    def sweep(self, keep: Collection[str]) -> list[str]:
        """Remove the files of every claim UID not in ``keep`` (start-up: the claims the claim state keeps);
        returns the UIDs removed. A directory that cannot be removed is logged and left."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        removed: list[str] = []
        for name in names:
            if name in keep:
                continue
            try:
                shutil.rmtree(self.root / name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.error("cannot remove device metadata of claim %s: %s", name, exc)
                continue
            removed.append(name)
        return removed


def read_metadata(path: Path | str) -> Mapping[str, object]:
    """The first ``DeviceMetadata`` object of a known version in a metadata file (for ``inspect``/``demo``).

    :raises OSError: the file cannot be read. :raises ValueError: it holds no such object.
    """
    doc = dm.first_known(dm.decode(Path(path).read_bytes()))
    if doc is None:
        raise dm.MetadataFormatError(f"{path}: no DeviceMetadata object of a known version")
    return doc
