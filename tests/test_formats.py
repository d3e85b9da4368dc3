"""jax_fp4.formats is the one description of the formats: the compiled extension's format
ids, element bits, families and element code values (csrc/codecs.h) are checked against it
at load (jax_fp4._ext), and Format's properties carry each family's behaviour."""
import copy

import numpy as np
import pytest

from jax_fp4 import _ext, formats


def _native_table():
    if not _ext.has_kernels("cpu"):
        pytest.fail(f"the CPU extension should be built for the tests: {_ext.load_error()}")
    from jax_fp4 import _native

    return _native.format_table()


def test_extension_formats_agree_with_formats_py():
    table = _native_table()
    assert _ext.format_table_problems(table) == []
    assert sorted(r["fid"] for r in table) == sorted(
        formats.get_format(n).fid for n in formats.FORMAT_NAMES)
    assert _ext.load_error() is None


@pytest.mark.parametrize("change,message", [
    (lambda t: t[6].update(fid=9), "exists only"),
    (lambda t: t[0].update(name="mxfp4"), "in the extension"),
    (lambda t: t[2].update(bits=8), "8-bit elements in the extension, 6"),
    (lambda t: t[7].update(mx=True), "family"),
    (lambda t: t[6]["values"].__setitem__(3, t[6]["values"][3] + 1e-6), "values differ"),
    (lambda t: t[4]["values"].__setitem__(0, -0.0), "values differ"),  # +0 vs -0
    (lambda t: t.pop(), "exists only"),
])
def test_a_disagreeing_table_is_named(change, message):
    """Each kind of disagreement (id, name, bits, family, one code value, a signed zero,
    a missing format) is reported with the format named."""
    table = copy.deepcopy(_native_table())
    table.sort(key=lambda r: r["fid"])
    change(table)
    problems = _ext.format_table_problems(table)
    assert problems and any(message in p for p in problems), problems


def test_format_properties():
    """The family behaviours as Format properties (what the former string switches said)."""
    f = {n: formats.get_format(n) for n in formats.FORMAT_NAMES}
    assert [n for n, v in f.items() if v.has_zeros] == ["int4"]
    assert [n for n, v in f.items() if v.has_tensor_scale] == ["nvfp4"]
    assert [n for n, v in f.items() if v.scale_dtype_per_call] == ["int4"]
    assert [n for n, v in f.items() if not v.minifloat_scales] == ["nf4", "bnb_fp4", "int4"]
    assert [n for n, v in f.items() if v.has_scale_rounding] == [
        "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]
    assert f["nvfp4"].scale_buffer_dtype() == f["mxfp4"].scale_buffer_dtype() == np.uint8
    assert f["nf4"].scale_buffer_dtype() == np.float32
    assert f["int4"].scale_buffer_dtype(np.float16) == np.float16
    with pytest.raises(ValueError, match="scale_dtype"):
        f["int4"].scale_buffer_dtype()
    assert f["int4"].default_scale_dtype(np.float16) == np.float16
    assert f["nvfp4"].default_scale_dtype(np.float16) is None
    assert f["nvfp4"].nan_scale == 0x7F and f["mxfp8_e5m2"].nan_scale == 0xFF
    assert np.isnan(f["nf4"].nan_scale) and np.isnan(f["int4"].nan_scale)
    assert np.dtype(f["nvfp4"].scale_bits_dtype).name == "float8_e4m3fn"
    assert np.dtype(f["mxfp6_e3m2"].scale_bits_dtype).name == "float8_e8m0fnu"
    assert f["bnb_fp4"].scale_bits_dtype is None
