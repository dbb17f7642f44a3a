"""The sandbox DaemonSet controller's update rules (:mod:`dradriver.sandbox.daemonsets`), pass by pass: what
kube-controller-manager's daemonset controller deletes and creates during a rolling update (kubernetes.io "Perform a
Rolling Update on a DaemonSet"; kubernetes ``pkg/controller/daemon/update.go``)."""

from __future__ import annotations

from typing import Any

import pytest

from dradriver.sandbox import daemonsets
from dradriver.sandbox.daemonsets import (
    LABEL_REVISION_HASH,
    LABEL_TEMPLATE_GENERATION,
    ON_DELETE,
    UpdateStrategy,
    is_updated,
    revision_hash,
    rolling_update,
    update_strategy,
)

TEMPLATE = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "img:2"}]}}
OLD_TEMPLATE = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "img:1"}]}}


def _ds(strategy: dict[str, Any] | None = None, generation: int = 2) -> dict[str, Any]:
    spec: dict[str, Any] = {"template": TEMPLATE}
    if strategy is not None:
        spec["updateStrategy"] = strategy
    return {"metadata": {"name": "d", "generation": generation}, "spec": spec}


def _pod(name: str, template: dict[str, Any], generation: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {LABEL_REVISION_HASH: revision_hash(template),
                                                 LABEL_TEMPLATE_GENERATION: str(generation)}}}


def _old(node: str) -> dict[str, Any]:
    return _pod(f"old-{node}", OLD_TEMPLATE, 1)


def _new(node: str) -> dict[str, Any]:
    return _pod(f"new-{node}", TEMPLATE, 2)


def _plan(ds: dict[str, Any], by_node: dict[str, list[dict[str, Any]]], down: set[str] = frozenset(),
          ) -> daemonsets.RollingPlan:
    names = [str(p["metadata"]["name"]) for pods in by_node.values() for p in pods]
    up = {n: n not in down for n in names}
    return rolling_update(ds, by_node, strategy=update_strategy(ds, len(by_node)), ready=up, available=up)


def test_the_revision_hash_follows_the_template_in_kubes_alphabet() -> None:
    first, second = revision_hash(TEMPLATE), revision_hash(OLD_TEMPLATE)
    assert first != second and first == revision_hash({"spec": TEMPLATE["spec"], "metadata": TEMPLATE["metadata"]})
    assert set(first) <= set("bcdfghjklmnpqrstvwxz2456789")
    assert is_updated(_new("a"), _ds(), first) and not is_updated(_old("a"), _ds(), first)
    by_generation = {"metadata": {"labels": {LABEL_TEMPLATE_GENERATION: "2"}}}
    assert is_updated(by_generation, _ds(), first)  # IsPodUpdated: the generation label alone is enough


def test_the_strategy_defaults_to_a_rolling_update_of_one_node_and_rounds_percentages_up() -> None:
    assert update_strategy(_ds(), 18) == UpdateStrategy("RollingUpdate", 1, 0, 0.0)
    rolling = update_strategy(_ds({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%",
                                                                              "maxSurge": "25%"}}), 18)
    assert (rolling.max_unavailable, rolling.max_surge) == (2, 5)
    zero = update_strategy(_ds({"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 0}}), 18)
    assert zero.max_unavailable == 1  # both 0 would never move: kube counts maxUnavailable 1
    assert update_strategy({"spec": {"minReadySeconds": 5}}, 3).min_ready_s == 5.0
    with pytest.raises(ValueError, match=r"rollingUpdate\.maxUnavailable: 'many'"):
        update_strategy(_ds({"rollingUpdate": {"maxUnavailable": "many"}}), 3)
    with pytest.raises(ValueError, match=r"spec\.updateStrategy\.type: 'Recreate'"):
        update_strategy(_ds({"type": "Recreate"}), 3)


def test_a_rolling_update_replaces_one_node_at_a_time_and_waits_for_the_new_pod() -> None:
    ds = _ds()
    plan = _plan(ds, {n: [_old(n)] for n in "abc"})
    assert plan.delete == ["old-a"] and not plan.surge  # one old Pod, the first node
    assert (len(plan.updated), len(plan.ready)) == (0, 3)
    waiting = _plan(ds, {"a": [], "b": [_old("b")], "c": [_old("c")]})
    assert waiting.delete == []  # node a has no Pod yet: the budget of one is spent
    starting = _plan(ds, {"a": [_new("a")], "b": [_old("b")], "c": [_old("c")]}, down={"new-a"})
    assert starting.delete == []  # the new Pod is not available yet
    next_one = _plan(ds, {"a": [_new("a")], "b": [_old("b")], "c": [_old("c")]})
    assert next_one.delete == ["old-b"] and next_one.updated == {"a"}
    done = _plan(ds, {n: [_new(n)] for n in "abc"})
    assert done.delete == [] and done.updated == done.available == done.scheduled == {"a", "b", "c"}


def test_an_old_pod_that_is_not_available_is_replaced_outside_the_budget() -> None:
    plan = _plan(_ds(), {n: [_old(n)] for n in "abc"}, down={"old-c"})
    assert plan.delete == ["old-c"]  # c is unavailable already: replacing it costs nothing, and spends the budget
    wider = _plan(_ds({"rollingUpdate": {"maxUnavailable": 2}}), {n: [_old(n)] for n in "abcd"}, down={"old-d"})
    assert wider.delete == ["old-d", "old-a"]


def test_with_max_surge_the_new_pod_starts_beside_the_old_one_which_goes_once_it_is_available() -> None:
    ds = _ds({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}})
    first = _plan(ds, {n: [_old(n)] for n in "ab"})
    assert first.surge == ["a"] and first.delete == []
    starting = _plan(ds, {"a": [_old("a"), _new("a")], "b": [_old("b")]}, down={"new-a"})
    assert starting.surge == [] and starting.delete == [] and starting.updated == set()
    ready = _plan(ds, {"a": [_old("a"), _new("a")], "b": [_old("b")]})
    assert ready.delete == ["old-a"] and ready.surge == ["b"]  # a's new Pod is available: its surge slot is free
    assert ready.updated == set()  # status counts each node's oldest Pod: a's old one until it is gone


def test_on_delete_replaces_nothing_and_still_counts() -> None:
    plan = _plan(_ds({"type": ON_DELETE}), {"a": [_old("a")], "b": [_new("b")]})
    assert plan.delete == [] and plan.surge == [] and plan.updated == {"b"} and plan.scheduled == {"a", "b"}
