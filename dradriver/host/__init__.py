"""The host filesystem boundary: everything that reads or writes files of this node.

``claimstate`` (the crash-safe claim-state journal, flock and fsync), ``cdifiles`` (atomic CDI spec files),
``devicenodes`` (device numbers from ``/proc`` and ``/dev``), ``driverfiles`` (the driver's user space under the
driver root). The domain model stays pure; this package does its I/O.
"""
