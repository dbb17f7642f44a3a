"""A fleet dump for the simulator: the ResourceSlices of N copies of one mock node, as ``kubectl get
resourceslices -o json`` prints them (one ``List``), with node names, pools, slice names and GPU UUIDs varied
per node so no two devices are the same device.

The node's slices come from ``dradriver inspect --mock-profile PROFILE -o json`` (what the plugin would publish);
each copy ``node-<i>`` replaces the node name everywhere and the last 8 hex digits of every ``GPU-``/``MIG-``
UUID with ``i``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

_UUID = re.compile(r'"((?:GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4})[0-9a-f]{8}"')


def node_slices(profile: str, node: str = "node-0") -> list[dict[str, object]]:
    """The ResourceSlices ``dradriver inspect`` prints for mock profile ``profile`` on ``node``."""
    out = subprocess.run([sys.executable, "-m", "dradriver", "inspect", "--mock-profile", profile, "-o", "json",
                          "--node-name", node], check=True, capture_output=True, text=True).stdout
    slices: list[dict[str, object]] = json.loads(out)
    for index, item in enumerate(slices):
        item["metadata"] = {"name": f"{node}-gpu.nvidia.com-{index}"}
    return slices


def fleet_json(profile: str, nodes: int) -> str:
    """One JSON ``List`` of the slices of ``nodes`` copies of ``profile``'s node (``node-0`` .. ``node-<n-1>``)."""
    template = json.dumps(node_slices(profile))[1:-1]
    parts = []
    for i in range(nodes):
        text = template.replace('"node-0', f'"node-{i}')
        parts.append(_UUID.sub(rf'"\g<1>{i:08x}"', text))
    return '{"apiVersion": "v1", "kind": "List", "items": [' + ", ".join(parts) + "]}"
