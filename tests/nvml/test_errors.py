"""Every ``nvmlReturn_t`` code has one exception class; the generated table is current."""

from __future__ import annotations

import sys
from pathlib import Path

import pynvml
import pytest

from dradriver.errors import DradriverError
from dradriver.nvml import errors
from dradriver.nvml.errors import (
    CLASS_BY_CODE,
    NvmlError,
    NvmlGpuIsLost,
    NvmlLibraryNotFound,
    NvmlNotSupported,
    NvmlUninitialized,
    NvmlUnknownError,
    error_for_code,
    from_pynvml,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools import gen_nvml_errors  # noqa: E402


def _header_codes() -> list[gen_nvml_errors.ReturnCode]:
    header = gen_nvml_errors.find_header()
    return gen_nvml_errors.parse_return_codes(header.read_text(encoding="utf-8", errors="replace"))


def test_generated_table_is_current() -> None:
    assert gen_nvml_errors.main(["--check"]) == 0


def test_every_header_code_maps_to_exactly_one_class() -> None:
    codes = _header_codes()
    error_codes = [c for c in codes if c.name != "NVML_SUCCESS"]
    assert len(error_codes) >= 31
    assert {c.value for c in error_codes} == set(CLASS_BY_CODE)
    classes = list(CLASS_BY_CODE.values())
    assert len(set(classes)) == len(classes)
    for code in error_codes:
        cls = CLASS_BY_CODE[code.value]
        assert cls.__name__ == code.class_name
        assert cls.code == code.value and cls.c_name == code.name
        assert issubclass(cls, NvmlError) and issubclass(cls, DradriverError)
        exc = error_for_code(code.value, "ctx")
        assert type(exc) is cls and exc.code == code.value and str(exc) == "ctx"


def test_every_pynvml_code_converts_to_our_class() -> None:
    for name in dir(pynvml):
        if not name.startswith("NVML_ERROR_"):
            continue
        value = getattr(pynvml, name)
        ours = from_pynvml(pynvml.NVMLError(value), "nvmlDoThing(gpu 0)")
        assert ours.code == value
        assert str(ours).startswith("nvmlDoThing(gpu 0): ")
        if value in CLASS_BY_CODE:
            assert type(ours) is CLASS_BY_CODE[value]
            assert ours.c_name == name


def test_named_classes() -> None:
    assert NvmlNotSupported.code == 3
    assert NvmlUninitialized.code == 1
    assert NvmlGpuIsLost.code == 15
    assert NvmlLibraryNotFound.code == 12
    assert NvmlUnknownError.code == 999


def test_unknown_code_keeps_its_number() -> None:
    exc = error_for_code(4242)
    assert type(exc) is NvmlUnknownError
    assert exc.code == 4242
    assert NvmlUnknownError.code == 999  # the class default is untouched


def test_success_is_not_an_error() -> None:
    with pytest.raises(ValueError):
        error_for_code(errors.NVML_SUCCESS)


def test_registry_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already mapped"):

        @errors._register(15, "NVML_ERROR_GPU_IS_LOST")
        class Again(NvmlError):
            pass

    assert CLASS_BY_CODE[15] is NvmlGpuIsLost


def test_conversion_is_chained() -> None:
    original = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(NvmlGpuIsLost) as info:
        try:
            raise original
        except pynvml.NVMLError as exc:
            raise from_pynvml(exc, "nvmlDeviceGetUUID") from exc
    assert info.value.__cause__ is original


def test_parser_reads_a_header_fragment() -> None:
    text = """
    typedef enum nvmlReturn_enum
    {
        NVML_SUCCESS = 0,                 //!< ok
        NVML_ERROR_UNINITIALIZED = 1,     //!< not initialised
        NVML_ERROR_NEW_THING = 31,        //!< something new
        NVML_ERROR_UNKNOWN = 999          //!< An internal driver error occurred
    } nvmlReturn_t;
    """
    codes = gen_nvml_errors.parse_return_codes(text)
    assert [(c.name, c.value, c.class_name) for c in codes] == [
        ("NVML_SUCCESS", 0, "NvmlSuccess"),
        ("NVML_ERROR_UNINITIALIZED", 1, "NvmlUninitialized"),
        ("NVML_ERROR_NEW_THING", 31, "NvmlNewThing"),
        ("NVML_ERROR_UNKNOWN", 999, "NvmlUnknownError"),
    ]
    table = gen_nvml_errors.render_table(codes)
    assert "class NvmlNewThing(NvmlError):" in table
    assert "NvmlSuccess" not in table
