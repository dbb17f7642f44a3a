"""The Kubernetes CEL environment for device selectors: variables, libraries, error semantics."""

from __future__ import annotations

import pytest

from dradriver.allocator.expression import CelCompileError, Selector, device_variable
from dradriver.allocator.quantity import Quantity
from dradriver.allocator.semver import Semver

GPU = "gpu.nvidia.com"
K8S = "resource.kubernetes.io"


@pytest.fixture(scope="module")
def l4() -> object:
    return device_variable(
        GPU,
        {
            (GPU, "type"): "gpu",
            (GPU, "productName"): "NVIDIA L4",
            (GPU, "architecture"): "Ada Lovelace",
            (GPU, "driverVersion"): Semver.parse("535.183.1"),
            (GPU, "cudaComputeCapability"): Semver.parse("8.9.0"),
            (K8S, "numaNode"): 0,
            (K8S, "pcieRoot"): "pci0000:6f",
        },
        {(GPU, "memory"): Quantity.parse("23034Mi")},
    )


TRUE = [
    "device.driver == 'gpu.nvidia.com'",
    "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4'",
    "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA')",
    "device.attributes['gpu.nvidia.com'].productName.endsWith('L4')",
    "device.attributes['gpu.nvidia.com'].productName.contains('L4')",
    "device.attributes['gpu.nvidia.com'].productName.lowerAscii() == 'nvidia l4'",
    "device.attributes['gpu.nvidia.com'].productName.upperAscii() == 'NVIDIA L4'",
    "device.attributes['gpu.nvidia.com'].productName.split(' ') == ['NVIDIA', 'L4']",
    "device.attributes['gpu.nvidia.com'].productName.indexOf('L4') == 7",
    "device.attributes['gpu.nvidia.com'].productName.replace('NVIDIA ', '') == 'L4'",
    "'  x '.trim() == 'x'",
    "['a', 'b'].join('-') == 'a-b'",
    "device.attributes['gpu.nvidia.com'].architecture in ['Ada Lovelace', 'Hopper']",
    "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('550.0.0'))",
    "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('535.183.1')) == 0",
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('8.0.0'))",
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 8",
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.minor() == 9",
    "device.attributes['gpu.nvidia.com'].driverVersion.patch() == 1",
    "semver('v12.4', true) == semver('12.4.0') && isSemver('1.2.3') && !isSemver('1.2')",
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('20Gi')) > 0",
    "device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('24Gi'))",
    "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('22Gi'))",
    "device.capacity['gpu.nvidia.com'].memory == quantity('23034Mi')",
    "quantity('1Gi') == quantity('1024Mi')",
    "quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi')",
    "quantity('1Gi').add(1) == quantity('1073741825')",
    "quantity('1Gi').sub(quantity('512Mi')).compareTo(quantity('0.5Gi')) == 0",
    "quantity('1k').asInteger() == 1000 && quantity('1.5').asApproximateFloat() == 1.5",
    "quantity('-3').sign() == -1 && quantity('1').isInteger() && !quantity('1m').isInteger()",
    "isQuantity('40Gi') && !isQuantity('40GB')",
    "device.attributes['resource.kubernetes.io'].numaNode == 0",
    "device.attributes['resource.kubernetes.io'].numaNode < 0.5",
    "has(device.attributes['gpu.nvidia.com'].productName)",
    "!has(device.attributes['gpu.nvidia.com'].partition8)",
    "!('uuid' in device.attributes['gpu.nvidia.com'])",
    "device.attributes['example.com'].size() == 0",
    "sets.contains(['a', 'b', 'c'], ['a', 'c']) && !sets.contains(['a'], ['b'])",
    "sets.intersects(['a', 'b'], ['b', 'z']) && sets.equivalent(['a', 'b'], ['b', 'a', 'a'])",
    "[1, 2, 3].sum() == 6 && [3, 1, 2].min() == 1 && [3, 1, 2].max() == 3",
    "[quantity('1Gi'), quantity('3Gi')].max() == quantity('3Gi')",
    "[1, 2, 3].all(x, x > 0) && [1, 2].exists(x, x == 2) && [1, 2].map(x, x * 2) == [2, 4]",
    "cel.bind(name, device.attributes['gpu.nvidia.com'].productName, name.startsWith('NVIDIA') && name.size() > 6)",
    "false && device.attributes['gpu.nvidia.com'].missing == 1 || true",
    "device.allowMultipleAllocations == false",
]


@pytest.mark.parametrize("expression", TRUE)
def test_expression_is_true(l4: object, expression: str) -> None:
    outcome = Selector(expression).evaluate(l4)  # type: ignore[arg-type]
    assert outcome.error is None
    assert outcome.matched


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("device.attributes['gpu.nvidia.com'].uuid == 'x'", "no attribute gpu.nvidia.com/uuid"),
        ("device.capacity['gpu.nvidia.com'].cores.isGreaterThan(quantity('1'))", "no capacity gpu.nvidia.com/cores"),
        ("device.attributes['example.com'].model == 'x'", "no attribute example.com/model"),
        ("device.driver", 'selector returned string "gpu.nvidia.com", not bool'),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi'))", "selector returned int -1, not bool"),
        ("quantity('40GB').sign() == 1", "quantity '40GB': unknown suffix"),
        ("semver('1.2').major() == 1", "version '1.2': not a semantic version"),
        ("quantity('1Gi') < quantity('2Gi')", "no such overload: _<_(Quantity, Quantity)"),
        ("device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(quantity('1'))", "no such overload"),
        ("quantity('1m').asInteger() == 0", "cannot convert value 1m to integer"),
    ],
)
def test_runtime_errors_make_the_device_not_match(l4: object, expression: str, error: str) -> None:
    outcome = Selector(expression).evaluate(l4)  # type: ignore[arg-type]
    assert not outcome.matched
    assert outcome.error is not None and error in outcome.error


def test_syntax_error_points_at_the_expression() -> None:
    with pytest.raises(CelCompileError) as info:
        Selector("device.attributes['gpu.nvidia.com'].type ==\n  && true")
    assert info.value.line == 2 and info.value.column == 3
    assert str(info.value) == ("syntax error at line 2, column 3\n  |   && true\n  |   ^")


def test_unknown_function_points_at_the_call() -> None:
    with pytest.raises(CelCompileError) as info:
        Selector("device.capacity['gpu.nvidia.com'].memory.greaterThan(quantity('1'))")
    assert str(info.value).splitlines() == [
        "undeclared reference to 'greaterThan' at line 1, column 42",
        "  | device.capacity['gpu.nvidia.com'].memory.greaterThan(quantity('1'))",
        "  |                                          ^",
    ]


@pytest.mark.parametrize(
    ("expression", "first_line"),
    [
        ("device.atributes['gpu.nvidia.com'].productName == 'x'",
         "undefined field 'atributes' (device has driver, attributes, capacity, allowMultipleAllocations) at line "
         "1, column 8"),
        ("devise.attributes['gpu.nvidia.com'].productName == 'x'",
         "undeclared reference to 'devise' (the variable is 'device') at line 1, column 1"),
        ("device.driver == 'gpu.nvidia.com' &&\n  device.capcity['gpu.nvidia.com'].memory.isGreaterThan(quantity('1'))",
         "undefined field 'capcity' (device has driver, attributes, capacity, allowMultipleAllocations) at line 2, "
         "column 10"),
    ],
)
def test_a_typo_in_the_device_variable_is_a_compile_error_at_its_position(expression: str, first_line: str) -> None:
    """What the API server's type check refuses when the claim is created, not a celpy overload error per device."""
    with pytest.raises(CelCompileError) as info:
        Selector(expression)
    lines = str(info.value).splitlines()
    assert lines[0] == first_line
    assert lines[2].index("^") - 4 == info.value.column - 1  # the caret under the misspelt name


@pytest.mark.parametrize("expression", [
    "[1, 2].exists(x, x > 1) && device.driver != ''",
    "device.attributes['gpu.nvidia.com'].exists(name, name != '')",
    "cel.bind(v, device.driver, v == 'gpu.nvidia.com')",
    "type(device.driver) == string && device.allowMultipleAllocations == false",
])
def test_declared_names_and_comprehension_variables_compile(l4: object, expression: str) -> None:
    assert Selector(expression).evaluate(l4).matched  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("device['atributes']['gpu.nvidia.com'].productName == 'x'", "no such key: atributes"),
        ("device.attributes['gpu.nvidia.com'].productName['x'] == 'y'", "no such overload: _[_](string, string)"),
    ],
)
def test_an_error_under_an_index_is_the_first_error_not_celpy_internals(l4: object, expression: str,
                                                                         error: str) -> None:
    outcome = Selector(expression).evaluate(l4)  # type: ignore[arg-type]
    assert (outcome.matched, outcome.error) == (False, error)


@pytest.mark.parametrize(
    ("expression", "reads"),
    [
        ("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
         {("driver",), ("attributes", "gpu.nvidia.com", "type")}),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
         {("capacity", "gpu.nvidia.com", "memory")}),
        ('has(device.attributes["d"].n) && device.attributes.x.y == 1',
         {("attributes", "d", "n"), ("attributes", "x", "y")}),
        ("'pcieRoot' in device.attributes['resource.kubernetes.io']", {("attributes", "resource.kubernetes.io")}),
        ("cel.bind(a, device.attributes['d'], a.x == 1)", {("attributes", "d")}),
        ("device.allowMultipleAllocations", {("allowMultipleAllocations",)}),
        ("device.attributes[device.driver].type == 'gpu'", None),
        ("device.attributes.size() > 0", None),
        ("[1].all(device, device > 0)", None),
        ("device.attributes['a\\\\.b'].c == 1", None),
    ],
)
def test_device_reads_names_every_value_a_selector_reads_or_none_when_unresolved(
        expression: str, reads: set[tuple[str, ...]] | None) -> None:
    found = Selector(expression).reads
    assert (None if found is None else set(found)) == reads
