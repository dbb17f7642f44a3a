"""``dradriver allocate``: allocate ResourceClaims the way kube-scheduler's structured allocator does.

Reads multi-document YAML (files, or stdin for ``-``/no file) holding ResourceSlices, DeviceClasses,
ResourceClaims, ResourceClaimTemplates (resource.k8s.io v1, v1beta2 or v1beta1), Pods, Nodes, Namespaces
and workloads (Deployments, ReplicaSets, StatefulSets, Jobs, kubeflow.org/v2beta1 MPIJobs become the Pods
their controllers would run). Pods that ask for an extended resource a DeviceClass maps (``nvidia.com/gpu: 1``)
get the claim kube-scheduler generates for them. Prints the claims with ``status.allocation`` filled in,
then the scheduled Pods (``spec.nodeName``, ``status.resourceClaimStatuses``,
``status.extendedResourceClaimStatus``), as a YAML stream or with ``-o json`` one ``v1``
``List``. Objects it does not use are named on stderr (``warning: ...``).
Exit code 0 when every claim is allocated and every Pod scheduled, 1 when some cannot be ("cannot allocate
claim ns/name: ..." or "cannot schedule pod ns/name: ..." on stderr), 2 on invalid input (a Pod the API server
would refuse, invalid CEL, with the file and the field) or nothing to allocate (no claim, template, Pod or
workload in the files).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``allocate`` subcommand."""
    parser = subparsers.add_parser(
        "allocate",
        help="allocate ResourceClaims against ResourceSlices like kube-scheduler (simulation)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="YAML files ('-' or none: stdin)")
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                        help="format of the allocated claims: a YAML stream (default) or a JSON List")
    parser.set_defaults(func=run)


def read_inputs(files: list[str]) -> tuple[list[str], list[str]]:
    """Texts of ``files`` and their names for messages (``-`` or an empty list reads stdin, ``<stdin>``).

    :raises OSError: unreadable file.
    """
    texts, names = [], []
    for name in files or ["-"]:
        if name == "-":
            texts.append(sys.stdin.read())
            names.append("<stdin>")
        else:
            with open(name, encoding="utf-8") as handle:
                texts.append(handle.read())
            names.append(name)
    return texts, names


def run(args: argparse.Namespace) -> int:
    """Allocate and print the claims as YAML; return the exit code."""
    from dradriver.allocator.simulation import dump, load, simulate
    from dradriver.errors import DradriverError

    try:
        inputs = load(*read_inputs(args.files))
        outcome = simulate(inputs)
    except OSError as exc:
        print(f"dradriver allocate: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except DradriverError as exc:
        print(f"dradriver allocate: {exc}", file=sys.stderr)
        return 2
    for warning in inputs.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if (outcome.claims or outcome.pods) and getattr(args, "output", "yaml") == "json":
        import json

        sys.stdout.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": outcome.claims + outcome.pods},
                                    indent=2) + "\n")
    elif outcome.claims or outcome.pods:
        sys.stdout.write(dump(outcome.claims + outcome.pods))
    for failure in outcome.failures:
        print(failure, file=sys.stderr)
    return 1 if outcome.failures else 0
