"""Checkpoint integrity and safe saving (docs/checkpoints.md): every single-byte
corruption of a saved file is refused with CheckpointError, malformed headers and
metadata name the file and the tensor, old (version "1") files still load, and saving
never loses the old file, never leaves a file behind and honours the umask."""
import json
import os
import struct
import threading

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax_fp4 as jf  # noqa: E402
from jax_fp4 import io  # noqa: E402
from jax_fp4.cli import main  # noqa: E402
from jax_fp4.io import CheckpointError, atomic_write  # noqa: E402
from jax_fp4.io import safetensors as jst  # noqa: E402


def _tree():
    x = jnp.asarray(np.linspace(-3, 3, 16 * 32, dtype=np.float32).reshape(16, 32))
    return {"w": jf.quantize(x, "nvfp4", tensor_scale="auto"),
            "i": jf.quantize(x[:2], "int4", block_size=32, scale_dtype=jnp.bfloat16),
            "b": jnp.asarray([1.0, -2.0, 3.5], jnp.bfloat16)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    p = tmp_path_factory.mktemp("ck") / "small.safetensors"
    io.save(p, _tree(), metadata={"note": "hello"})
    return p, p.read_bytes()


def _split(blob):
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(hdr, data):
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _as_v1(blob, mutate=None):
    """The same file as jax-fp4 wrote it before checksums (version "1"), optionally with
    its header changed by ``mutate(header)``."""
    hdr, data = _split(blob)
    meta = hdr["__metadata__"]
    del meta[jst.CHECKSUMS_KEY], meta[jst.HEADER_CHECKSUM_KEY]
    meta["jax_fp4.version"] = "1"
    if mutate:
        mutate(hdr)
    return _join(hdr, data)


def _load_bytes(tmp_path, blob, **kw):
    p = tmp_path / "x.safetensors"
    p.write_bytes(blob)
    return io.load(p, **kw)


def test_roundtrip_and_checksums_recorded(saved, tmp_path):
    p, blob = saved
    hdr, _ = _split(blob)
    sums = json.loads(hdr["__metadata__"][jst.CHECKSUMS_KEY])
    assert sums["algorithm"] == "blake2b-128"
    assert set(sums["tensors"]) == {k for k in hdr if k != "__metadata__"}
    got = io.load(p, target=_tree())
    for k, v in _tree().items():
        a = v.dequantize() if isinstance(v, jf.QArray) else v
        b = got[k].dequantize() if isinstance(got[k], jf.QArray) else got[k]
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert io.verify(p) == {"file": str(p), "version": "2", "tensors": 7, "checksummed": 7}


def test_every_single_byte_corruption_is_detected(saved, tmp_path):
    """Each byte of the file flipped (xor 0x01 and xor 0xFF) and, in the header's space
    padding, replaced by a JSON whitespace that leaves the parsed header unchanged."""
    _, blob = saved
    p = tmp_path / "c.safetensors"
    n = struct.unpack("<Q", blob[:8])[0]
    cases = [(i, blob[i] ^ m) for i in range(len(blob)) for m in (0x01, 0xFF)]
    cases += [(i, ord(c)) for i in range(8, 8 + n) if blob[i] == 0x20 for c in "\t\n"]
    missed = []
    for i, v in cases:
        b = bytearray(blob)
        b[i] = v
        p.write_bytes(bytes(b))
        try:
            io.load(p)
        except CheckpointError as e:
            assert str(p) in str(e)
        else:
            missed.append((i, v))
    assert not missed, f"{len(missed)} of {len(cases)} corruptions loaded: {missed[:10]}"


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_single_byte_corruption(saved, tmp_path_factory, data):
    _, blob = saved
    i = data.draw(st.integers(0, len(blob) - 1), label="offset")
    v = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]), label="value")
    b = bytearray(blob)
    b[i] = v
    p = tmp_path_factory.mktemp("r") / "c.safetensors"
    p.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match=str(p)):
        io.load(p)
    assert main(["inspect", str(p), "--verify"]) == 2


def test_truncation_detected(saved, tmp_path):
    _, blob = saved
    for cut in (0, 4, 8, 100, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CheckpointError):
            _load_bytes(tmp_path, blob[:cut])
    with pytest.raises(CheckpointError, match="data section"):
        _load_bytes(tmp_path, blob + b"\0")


def test_version_1_files_still_load(saved, tmp_path):
    _, blob = saved
    got = _load_bytes(tmp_path, _as_v1(blob))
    np.testing.assert_array_equal(np.asarray(got["w"].dequantize()),
                                  np.asarray(_tree()["w"].dequantize()))
    assert io.verify(tmp_path / "x.safetensors")["checksummed"] == 0
    assert main(["inspect", str(tmp_path / "x.safetensors"), "--verify"]) == 0


def _set(path, value):
    def mutate(hdr):
        d = hdr
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return mutate


def _qmeta_set(name, field, value):
    def mutate(hdr):
        q = json.loads(hdr["__metadata__"][jst.METADATA_KEY])
        q[name][field] = value
        hdr["__metadata__"][jst.METADATA_KEY] = json.dumps(q)
    return mutate


MALFORMED = [
    ("metadata list", lambda h: h.__setitem__("__metadata__", [1]), "__metadata__"),
    ("metadata non-str", _set(("__metadata__", "note"), 5), "__metadata__"),
    ("shape str", _set(("b", "shape"), "3"), "'b'"),
    ("shape negative", _set(("b", "shape"), [-3]), "'b'"),
    ("offsets str", _set(("b", "data_offsets"), "0"), "'b'"),
    ("offsets reversed", _set(("b", "data_offsets"), [6, 0]), "'b'"),
    ("entry not object", _set(("b",), 7), "'b'"),
    ("dtype unknown", _set(("b", "dtype"), "F7"), "'b'"),
    ("part dtype", _set(("w.scales", "dtype"), "U8"), "w.scales"),
    ("qarrays not json", _set(("__metadata__", jst.METADATA_KEY), "{"), "jax_fp4.qarrays"),
    ("qarrays list", _set(("__metadata__", jst.METADATA_KEY), "[1]"), "jax_fp4.qarrays"),
    ("axis -2", _qmeta_set("w", "axis", -2), "'w'.*axis"),
    ("axis 5", _qmeta_set("w", "axis", 5), "'w'.*axis"),
    ("axis str", _qmeta_set("w", "axis", "1"), "'w'.*axis"),
    ("shape str meta", _qmeta_set("w", "shape", "32"), "'w'.*shape"),
    ("format unknown", _qmeta_set("w", "format", "fp3"), "'w'.*format"),
    ("format relabelled", _qmeta_set("w", "format", "mxfp4"), "w"),
    ("dtype int", _qmeta_set("w", "dtype", "int8"), "'w'.*dtype"),
    ("block 32", _qmeta_set("w", "block_size", 32), "'w'"),
    ("layout", _qmeta_set("w", "scale_layout", "banana"), "'w'"),
    ("tensor_scale flag", _qmeta_set("i", "tensor_scale", True), "'i'"),
    ("zeros flag", _qmeta_set("i", "zeros", "yes"), "'i'.*zeros"),
    ("scale_dtype", _qmeta_set("i", "scale_dtype", "float16"), "i.scales"),
    ("stray part", _qmeta_set("w", "tensor_scale", False), "w.tensor_scale"),
    ("missing part", lambda h: h.pop("w.tensor_scale"), "data section|w.tensor_scale"),
    ("version 3", _set(("__metadata__", "jax_fp4.version"), "3"), "version"),
    ("version gone", lambda h: h["__metadata__"].pop("jax_fp4.version"), "version"),
]


@pytest.mark.parametrize("name,mutate,match", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_header_is_a_checkpoint_error(saved, tmp_path, name, mutate, match):
    _, blob = saved
    with pytest.raises(CheckpointError, match=match) as e:
        _load_bytes(tmp_path, _as_v1(blob, mutate))
    assert str(tmp_path / "x.safetensors") in str(e.value)
    assert main(["inspect", str(tmp_path / "x.safetensors"), "--verify"]) == 2


def test_unknown_version_refused_even_with_valid_checksums(saved, tmp_path):
    _, blob = saved
    hdr, data = _split(blob)
    hdr["__metadata__"]["jax_fp4.version"] = "9"
    with pytest.raises(CheckpointError, match="version '9'"):
        _load_bytes(tmp_path, _join(hdr, data))


@pytest.mark.parametrize("change", ["dtype", "format", "shape", "block_size", "layout",
                                    "int4 scale dtype", "plain dtype", "plain shape"])
def test_target_checks_every_part(saved, change):
    p, _ = saved
    x = jnp.zeros((16, 32), jnp.float32)
    t = _tree()
    if change == "dtype":
        t["w"] = jf.quantize(x.astype(jnp.bfloat16), "nvfp4", tensor_scale="auto")
    elif change == "format":
        t["w"] = jf.quantize(x, "mxfp4")
    elif change == "shape":
        t["w"] = jf.quantize(jnp.zeros((16, 64)), "nvfp4", tensor_scale="auto")
    elif change == "block_size":
        t["i"] = jf.quantize(x[:2], "int4", block_size=16, scale_dtype=jnp.bfloat16)
    elif change == "layout":
        t["w"] = jf.quantize(x, "nvfp4", tensor_scale="auto", scale_layout="swizzled")
    elif change == "int4 scale dtype":
        t["i"] = jf.quantize(x[:2], "int4", block_size=32, scale_dtype=jnp.float32)
    elif change == "plain dtype":
        t["b"] = jnp.zeros((3,), jnp.float32)
    else:
        t["b"] = jnp.zeros((4,), jnp.bfloat16)
    with pytest.raises(CheckpointError, match=str(p)):
        io.load(p, target=t)


# ------------------------------------------------------------------------ safe saving
def _listing(d):
    return sorted(os.listdir(d))


def test_write_failure_keeps_old_file_and_leaves_nothing(tmp_path):
    p = tmp_path / "m.safetensors"
    io.save(p, {"a": jnp.ones(3)})
    old = p.read_bytes()
    (tmp_path / "m.safetensors.tmp").write_bytes(b"user file")  # the old fixed temp name
    before = _listing(tmp_path)
    for exc in (OSError(28, "No space left on device"), KeyboardInterrupt(), RuntimeError("x")):
        def boom(fh, exc=exc):
            fh.write(b"partial")
            raise exc
        with pytest.raises(type(exc)) as e:
            atomic_write(p, boom)
        if isinstance(exc, OSError):
            assert e.value.filename == str(p)
        assert p.read_bytes() == old and _listing(tmp_path) == before
    assert (tmp_path / "m.safetensors.tmp").read_bytes() == b"user file"
    with pytest.raises(TypeError):  # a bad leaf: nothing written at all
        io.save(p, {"a": object()})
    assert p.read_bytes() == old and _listing(tmp_path) == before


def test_missing_directory_is_an_oserror_with_the_path(tmp_path):
    p = tmp_path / "nope" / "m.safetensors"
    with pytest.raises(OSError) as e:
        io.save(p, {"a": jnp.ones(3)})
    assert e.value.filename == str(p)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_new_files_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        io.save(tmp_path / "u.safetensors", {"a": jnp.ones(3)})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "u.safetensors").st_mode & 0o777 == 0o666 & ~umask


def test_overwrite_keeps_mode_and_symlink(tmp_path):
    real = tmp_path / "real.safetensors"
    io.save(real, {"a": jnp.ones(3)})
    os.chmod(real, 0o640)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    old = os.umask(0o077)
    try:
        io.save(link, {"a": jnp.zeros(5)})
    finally:
        os.umask(old)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert os.stat(real).st_mode & 0o777 == 0o640
    assert io.load(real)["a"].shape == (5,)
    assert _listing(tmp_path) == ["link.safetensors", "real.safetensors"]


def test_concurrent_saves_to_one_path(tmp_path):
    p = tmp_path / "c.safetensors"
    errors = []

    def work(k):
        try:
            for _ in range(5):
                io.save(p, {"a": jnp.full((8,), k, jnp.float32)})
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert io.verify(p)["checksummed"] == 1
    assert _listing(tmp_path) == ["c.safetensors"]
