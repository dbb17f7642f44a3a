"""``dradriver rollback-check`` on claims the real plugins prepared (mock NVML, the API emulator over HTTP, the
kubelet emulator over gRPC): a plain GPU claim strands nothing (exit 0); a half-prepared claim, a claim missing from
the kept checkpoint, consumable MPS shares, an isolated IMEX channel and device-metadata files are each named with
their reason (exit 1); bad input is one line and exit 2. The command never writes to the node's directories."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from dradriver._native.claimstore_py import FORMAT_VERSION, encode_header
from dradriver.cli import main
from dradriver.config import PluginConfig
from dradriver.domain.identity import GPU_DRIVER
from dradriver.kubeletplugin.payload import held_devices
from dradriver.sandbox.node import SandboxNode
from dradriver.sandbox.profiles import h200_node
from tests.computedomain import cdplugin_helpers as cd
from tests.computedomain.test_isolation import IMEX_CTL_READY, _give_channel, _isolated, _namespace
from tests.factories import DEVICE_CLASS
from tests.plugin.conftest import claim_object, ref_of, result, running, set_allocation, wait_for
from tests.plugin.test_device_metadata import GATE_ON as METADATA_ON
from tests.plugin.test_shares import allocate as allocate_shares
from tests.plugin.test_shares import share_claim


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime in ns)."""
    out: dict[str, tuple[int, int]] = {}
    for base, _dirs, names in os.walk(root):
        for name in names:
            st = os.stat(os.path.join(base, name))
            out[os.path.relpath(os.path.join(base, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _check(config: PluginConfig, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    """Run the command against ``config``'s directories (as on the node); returns (exit code, JSON report) and
    asserts it wrote nothing there."""
    plugins = Path(config.kubelet_plugins_directory_path)
    before = _files(plugins)
    code = main(["rollback-check", "-o", "json", "--kubelet-plugins-directory-path", str(plugins),
                 "--proc-root", str(config.proc_root), "--node-name", config.node_name, *extra])
    assert _files(plugins) == before, "rollback-check must never write"
    return code, json.loads(capsys.readouterr().out)


def _claims(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["uid"]: c for d in report["drivers"] for c in d["claims"]}


def _features(claim: dict[str, Any]) -> list[str]:
    return [f["feature"] for f in claim["findings"]]


def test_a_plain_gpu_claim_is_held_by_nvidia_and_nothing_is_stranded(sandbox: SandboxNode,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    api = sandbox.api
    assert api is not None
    config = sandbox.config()

    async def body() -> str:
        async with running(config) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("plain")), [result("gpu-2")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            return ref.uid

    uid = asyncio.run(body())
    code, report = _check(config, capsys)
    assert code == 0 and report["stranded"] is False
    claim = _claims(report)[uid]
    assert (claim["driver"], claim["name"], claim["state"], claim["verdict"], claim["findings"]) == (
        "gpu.nvidia.com", "plain", "PREPARE_COMPLETED", "held", [])
    assert main(["rollback-check", "--kubelet-plugins-directory-path", str(config.kubelet_plugins_directory_path),
                 "--proc-root", str(config.proc_root), "--node-name", config.node_name]) == 0
    table = capsys.readouterr().out
    assert "strands nothing" in table
    [row] = [line for line in table.splitlines() if uid in line]
    assert row.split()[:6] == ["gpu.nvidia.com", "default/plain", uid, "PREPARE_COMPLETED", "held", "-"]


def test_a_half_prepared_claim_is_named_as_stranded_with_its_reason(sandbox: SandboxNode,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    api = sandbox.api
    assert api is not None
    config = sandbox.config()

    async def body() -> tuple[str, str]:
        async with running(config) as (plugin, kubelet):
            done = ref_of(set_allocation(sandbox, api.create(claim_object("done")), [result("gpu-0")]))
            cut = ref_of(set_allocation(sandbox, api.create(claim_object("cut")), [result("gpu-1")]))
            assert all(a.error == "" for a in (await kubelet.prepare([done, cut])).values())
            # A crash in the middle of the second claim's prepare leaves its record PREPARE_STARTED (undo records
            # stored), as the runner writes it before any side effect.
            record = plugin.state.get(cut.uid)
            assert record is not None
            plugin.state.prepare_started(cut.uid, namespace="default", name="cut", devices=held_devices(record),
                                         payload=record.payload)
            return done.uid, cut.uid

    done, cut = asyncio.run(body())
    code, report = _check(config, capsys)
    assert code == 1 and report["stranded"] is True
    claims = _claims(report)
    assert claims[done]["verdict"] == "held"
    assert claims[cut]["state"] == "PREPARE_STARTED" and claims[cut]["verdict"] == "stranded"
    assert _features(claims[cut]) == ["half-prepared"]
    assert "dradriver rolls it back at its next start" in claims[cut]["findings"][0]["reason"]


def test_claims_missing_from_the_checkpoint_are_stranded(sandbox: SandboxNode,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    api = sandbox.api
    assert api is not None
    config = sandbox.config(nvidia_checkpoint=False)

    async def body() -> str:
        async with running(config) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("unkept")), [result("gpu-4")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            return ref.uid

    uid = asyncio.run(body())
    code, report = _check(config, capsys, "--driver", "gpu.nvidia.com")
    assert code == 1
    [claim] = _claims(report).values()
    assert claim["uid"] == uid and _features(claim) == ["not-in-checkpoint"]
    assert "--nvidia-checkpoint=false" in claim["findings"][0]["reason"]


def test_device_metadata_files_nvidia_would_not_remove_are_named(sandbox: SandboxNode,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    api = sandbox.api
    assert api is not None
    config = sandbox.config(feature_gates=METADATA_ON)

    async def body() -> str:
        async with running(config) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("meta")), [result("gpu-5")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            return ref.uid

    uid = asyncio.run(body())
    code, report = _check(config, capsys)
    assert code == 1
    claim = _claims(report)[uid]
    assert _features(claim) == ["device-metadata"]
    assert f"dra-device-metadata/{uid}" in claim["findings"][0]["reason"]


def test_consumable_mps_shares_are_stranded_with_their_daemon_named(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with SandboxNode(profile=h200_node(tmp_path, gpus=2)) as node:
        assert node.api is not None
        node.api.create(DEVICE_CLASS)
        node.run_workloads()
        config = node.shares_config()

        async def body() -> list[str]:
            async with running(config) as (_plugin, kubelet):
                await wait_for(lambda: bool(node.api and node.api.objects("ResourceSlice")))
                refs = [ref_of(c) for c in allocate_shares(node, share_claim("share-a"), share_claim("share-b"))]
                for ref in refs:
                    assert (await kubelet.prepare([ref]))[ref.uid].error == ""
                return [r.uid for r in refs]

        uids = asyncio.run(body())
        code, report = _check(config, capsys)
    assert code == 1
    claims = _claims(report)
    for uid in uids:
        assert claims[uid]["state"] == "PREPARE_COMPLETED" and _features(claims[uid]) == ["consumable-share-mps"]
        assert "MPS control daemon share-" in claims[uid]["findings"][0]["reason"]


def test_an_isolated_imex_channel_is_stranded_and_needs_nvidias_host_managed_gate(
        capsys: pytest.CaptureFixture[str]) -> None:
    with SandboxNode(profile="gb200-nvl72-node") as node:
        cd.write_imex_proc(node)
        ctl = node.driver_root / "usr" / "bin" / "nvidia-imex-ctl"
        ctl.write_text(IMEX_CTL_READY)
        ctl.chmod(0o755)
        api = node.api
        assert api is not None
        _namespace(api, "team-a")
        domain = cd.seed_domain(api, "job-a", "team-a")
        _give_channel(api, "job-a", "team-a", 3)
        claim = cd.seed_claim(api, "wl-a", domain, namespace="team-a", device="channel-3")
        config = _isolated(node)

        async def body() -> None:
            async with cd.running(config) as (_plugin, conn):
                got = await conn.prepare([claim])
                assert got[claim.uid].ok, got[claim.uid].error

        asyncio.run(body())
        code, report = _check(config, capsys, "--driver", "compute-domain.nvidia.com")
    assert code == 1
    [verdict] = _claims(report).values()
    assert (verdict["driver"], verdict["uid"], verdict["verdict"]) == ("compute-domain.nvidia.com", claim.uid,
                                                                      "stranded")
    assert _features(verdict) == ["channel-isolation"]
    assert f"IMEX channel 3 isolated for ComputeDomain {domain}" in verdict["findings"][0]["reason"]
    assert verdict["needs"] == ["HostManagedIMEXDaemon"]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-dir"
    assert main(["rollback-check", "--kubelet-plugins-directory-path", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"dradriver rollback-check: error: --kubelet-plugins-directory-path (env KUBELET_PLUGINS_DIRECTORY_PATH) "
        f"{missing} is not a directory"]
    state = tmp_path / "gpu.nvidia.com" / "claims.state"
    state.parent.mkdir()
    state.write_bytes(encode_header("boot", FORMAT_VERSION + 1))  # written by a newer release
    assert main(["rollback-check", "--kubelet-plugins-directory-path", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"dradriver rollback-check: error: gpu.nvidia.com: cannot read the claim state: claim "
                           f"state {state}: ")


def test_a_json_spec_an_older_release_wrote_is_named_until_a_restart_renames_it(
        sandbox: SandboxNode, capsys: pytest.CaptureFixture[str]) -> None:
    api = sandbox.api
    assert api is not None
    config = sandbox.config()

    async def prepare() -> str:
        async with running(config) as (_plugin, kubelet):
            ref = ref_of(set_allocation(sandbox, api.create(claim_object("old")), [result("gpu-6")]))
            assert (await kubelet.prepare([ref]))[ref.uid].error == ""
            return ref.uid

    async def restart() -> None:
        async with running(config):
            pass

    uid = asyncio.run(prepare())
    spec = GPU_DRIVER.cdi.spec_path(sandbox.cdi_root, uid)
    legacy = spec.with_suffix(".json")
    spec.rename(legacy)  # the name releases before 2026-12 gave it
    code, report = _check(config, capsys)
    assert code == 1
    claim = _claims(report)[uid]
    assert _features(claim) == ["json-spec"] and str(legacy) in claim["findings"][0]["reason"]
    asyncio.run(restart())
    assert spec.exists() and not legacy.exists()
    assert _check(config, capsys)[0] == 0
