"""Kubernetes' RFC 1123 name rules in the API server's words (``k8s.io/apimachinery/pkg/util/validation``)."""

from __future__ import annotations

import pytest

from dradriver.domain.names import DNS_LABEL_RULE, DNS_SUBDOMAIN_RULE, dns_label_problems, dns_subdomain_problems


@pytest.mark.parametrize("name", ["gpu-node-1", "a", "0", "node.example.com", "a" * 253, "1-2.3-4"])
def test_a_subdomain_has_no_problems(name: str) -> None:
    assert dns_subdomain_problems(name) == []


@pytest.mark.parametrize("name", ["Bad_Name!", "", "-a", "a-", "a..b", ".a", "A", "a_b", "node 1"])
def test_a_name_outside_the_subdomain_rule_is_refused_with_the_api_servers_words(name: str) -> None:
    assert dns_subdomain_problems(name) == [DNS_SUBDOMAIN_RULE]
    assert DNS_SUBDOMAIN_RULE.startswith("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                         "characters, '-' or '.', and must start and end with an alphanumeric "
                                         "character (e.g. 'example.com', regex used for validation is ")


def test_a_subdomain_is_at_most_253_characters() -> None:
    assert dns_subdomain_problems("a" * 254) == ["must be no more than 253 characters"]


def test_a_label_has_no_dots_and_at_most_63_characters() -> None:
    assert dns_label_problems("gpu-0") == []
    assert dns_label_problems("gpu.0") == [DNS_LABEL_RULE]
    assert dns_label_problems("a" * 64) == ["must be no more than 63 characters"]
