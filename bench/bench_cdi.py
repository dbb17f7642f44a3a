"""CDI spec rendering, compiled extension vs pure-Python twin (issue 4, scenario 2; target: >= 5x at 2048;
``imex-2048-claim``: the compute-domain All claim, one device holding the 2048 channel nodes).

Run: ``python -m pytest bench/bench_cdi.py --benchmark-only`` (add ``--benchmark-group-by=param:scenario``
to line the two implementations up). Inputs are built once; each round renders the spec to bytes, the work
``write_claim_spec`` does per claim besides the file write.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from dradriver._native import cdispec_py

CLAIM_UID = "6c6ae1b3-1c6e-4a3b-9d0f-2b1f1c1f0a11"
KIND = "k8s.gpu.nvidia.com/claim"
COMMON = (
    ("NVIDIA_VISIBLE_DEVICES=void",),
    (
        ("/dev/nvidiactl", "", "c", 195, 255, 0o666, "rwm", None, None),
        ("/dev/nvidia-uvm", "", "c", 510, 0, 0o666, "rwm", None, None),
        ("/dev/nvidia-uvm-tools", "", "c", 510, 1, 0o666, "rwm", None, None),
    ),
    (),
    (),
    (),
    (),
)


def _gpu(minor: int) -> tuple[Any, ...]:
    node = (f"/dev/nvidia{minor}", "", "c", 195, minor, 0o666, "rwm", None, None)
    return (f"{CLAIM_UID}-gpu-{minor}", ((), (node,), (), (), (), ()))


def _impls() -> list[Any]:
    from dradriver._native import cdispec

    return [pytest.param(cdispec, id="ext"), pytest.param(cdispec_py, id="twin")]


def _inputs(scenario: str) -> tuple[str, tuple[Any, ...]]:
    if scenario == "claim-1gpu":
        return "render_spec", (KIND, [_gpu(0)], COMMON)
    if scenario == "claim-8gpu":
        return "render_spec", (KIND, [_gpu(i) for i in range(8)], COMMON)
    if scenario == "imex-2048-claim":  # the compute-domain All claim: one device with 2048 nodes
        return "render_channel_spec", (
            "k8s.compute-domain.nvidia.com/claim",
            tuple(range(2048)),
            234,
            "",
            0o666,
            "",
            (("NVIDIA_VISIBLE_DEVICES=void",), (), (), (), (), ()),
            None,
            f"{CLAIM_UID}-channel-0",
        )
    return "render_channel_spec", (
        "nvidia.com/imex-channel",
        tuple(range(2048)),
        234,
        "",
        0o666,
        "",
        (("NVIDIA_VISIBLE_DEVICES=void",), (), (), (), (), ()),
    )


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("scenario", ["claim-1gpu", "claim-8gpu", "imex-2048", "imex-2048-claim"])
def test_render(benchmark: Any, impl: ModuleType, scenario: str) -> None:
    func, args = _inputs(scenario)
    render = getattr(impl, func)
    benchmark.group = f"cdi {scenario}"
    benchmark.extra_info.update(
        scenario={"claim-1gpu": "cdi_1gpu", "claim-8gpu": "cdi_8gpu", "imex-2048": "cdi_2048_channels",
                  "imex-2048-claim": "cdi_2048_channels_one_device"}[scenario],
        variant="extension" if impl is not cdispec_py else "twin",
    )
    out = benchmark(render, *args)
    assert out == getattr(cdispec_py, func)(*args)
