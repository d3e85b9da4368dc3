"""safetensors checkpoints of QArray trees: bit-exact round trips and clear errors."""
import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4 as jf

pytest.importorskip("safetensors")
from jax_fp4 import io as jio  # noqa: E402
from jax_fp4.io import CheckpointError  # noqa: E402


def _x(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


def assert_trees_bit_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: isinstance(x, jf.QArray))
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: isinstance(x, jf.QArray))
    assert ta == tb
    for x, y in zip(la, lb):
        if isinstance(x, jf.QArray):
            assert isinstance(y, jf.QArray)
            assert x.tree_flatten()[1] == y.tree_flatten()[1]  # format, axis, shape, ...
            x, y = x.tree_flatten()[0], y.tree_flatten()[0]
            for u, v in zip(x, y):
                assert (u is None) == (v is None)
                if u is not None:
                    assert _bits(u) == _bits(v)
        else:
            assert _bits(x) == _bits(y)


def _sample_tree():
    w = _x((128, 64), 1)
    return {
        "fmt": {f: jf.quantize(w, f, axis=0) for f in jf.FORMAT_NAMES},
        "two_level": jf.quantize(w, "nvfp4", axis=1, tensor_scale="auto"),
        "swizzled": jf.quantize(w, "mxfp8_e4m3", scale_layout="swizzled"),
        "bf16": jf.quantize(w.astype(jnp.bfloat16), "int4", axis=0, block_size=64),
        "int4_f32_scales": jf.quantize(w.astype(jnp.float16), "int4", axis=1, block_size=32,
                                       scale_dtype=jnp.float32),
        "nonfinite": jf.quantize(w.at[0, 0].set(jnp.nan), "mxfp4", axis=1),
        "layers": [{"bias": _x((64,), 2, jnp.bfloat16)}, {"bias": _x((64,), 3, jnp.float16)}],
        "step": jnp.int32(7),
        "empty": jnp.zeros((0, 4)),
        "f8": _x((4, 4)).astype(jnp.float8_e4m3fn),
    }


def test_round_trip_bit_exact(tmp_path):
    tree = _sample_tree()
    path = tmp_path / "t.safetensors"
    jio.save(path, tree, metadata={"note": "hello"})
    flat = jio.load(path)
    assert isinstance(flat["fmt.nvfp4"], jf.QArray) and "fmt.nvfp4.qdata" not in flat
    assert flat["two_level"].tensor_scale.shape == ()
    back = jio.load(path, target=tree)
    assert_trees_bit_equal(back, tree)
    # abstract target (no data needed to describe what to load)
    abstract = jax.eval_shape(lambda: tree)
    assert_trees_bit_equal(jio.load(path, target=abstract), tree)
    # any safetensors reader opens it; our metadata lives in the header
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as fh:
        meta = fh.metadata()
        assert fh.get_tensor("fmt.nf4.scales").dtype == np.float32
    assert meta["note"] == "hello" and meta["jax_fp4.version"] == jio.safetensors.VERSION == "2"
    q = json.loads(meta["jax_fp4.qarrays"])["two_level"]
    assert q == {"format": "nvfp4", "shape": [128, 64], "axis": 1, "dtype": "float32",
                 "block_size": 16, "scale_layout": "linear", "tensor_scale": True,
                 "zeros": False, "scale_dtype": None}
    header, _, _ = jio.read_header(path)
    assert header["fmt.nvfp4.scales"]["st_dtype"] == "F8_E4M3"
    assert header["fmt.mxfp4.scales"]["st_dtype"] == "F8_E8M0"
    assert header["fmt.mxfp8_e5m2.qdata"]["st_dtype"] == "F8_E5M2"
    assert header["layers.0.bias"]["st_dtype"] == "BF16"


def test_describe(tmp_path):
    path = tmp_path / "d.safetensors"
    q = jf.quantize(_x((256, 64)), "nvfp4", axis=0, tensor_scale="auto")
    jio.save(path, {"w": q, "b": jnp.zeros(64)}, metadata={"src": "x"})
    d = jio.describe(path)
    assert d["metadata"] == {"src": "x"} and d["jax_fp4_version"] == "2"
    assert d["qarrays"][0]["name"] == "w" and d["qarrays"][0]["nbytes"] == q.nbytes
    assert d["qarrays"][0]["bf16_bytes"] == 2 * 256 * 64
    assert d["tensors"] == [{"name": "b", "dtype": "F32", "shape": [64], "nbytes": 256}]
    assert d["total_bytes"] == q.nbytes + 256


def test_save_errors(tmp_path):
    p = tmp_path / "e.safetensors"
    with pytest.raises(TypeError, match="leaf 'a' is a str"):
        jio.save(p, {"a": "text"})
    with pytest.raises(ValueError, match="reserved prefix"):
        jio.save(p, {"a": jnp.ones(2)}, metadata={"jax_fp4.x": "1"})
    with pytest.raises(TypeError, match="metadata"):
        jio.save(p, {"a": jnp.ones(2)}, metadata={"a": 1})
    with pytest.raises(ValueError, match="two leaves map to the tensor name 'w.scales'"):
        jio.save(p, {"w": jf.quantize(_x((4, 32)), "mxfp4"), "w.scales": jnp.ones(2)})
    with pytest.raises(ValueError, match="bare leaf"):
        jio.save(p, jnp.ones(3))
    assert not p.exists() and not (tmp_path / "e.safetensors.tmp").exists()


# ----------------------------------------------------------------------------- corrupt files
def _write_raw(path, tensors, metadata):
    """A safetensors file from {name: (st_dtype, shape, bytes)}, written by hand.

    jax-fp4 metadata is written as version "1" (no checksums), so that each structural
    check is reached instead of the header checksum (tests/test_checkpoint_integrity.py
    covers the checksums)."""
    metadata = dict(metadata)
    if metadata.pop("jax_fp4.checksums", None) is not None:
        metadata.pop("jax_fp4.header_checksum", None)
        metadata["jax_fp4.version"] = "1"
    header, blobs, off = {}, [], 0
    for name, (dt, shape, data) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "m.safetensors"
    tree = {"w": jf.quantize(_x((64, 32)), "nvfp4", axis=0, tensor_scale="auto"),
            "b": _x((32,), 4)}
    jio.save(path, tree)
    return path, tree


def test_truncated_file(saved, tmp_path):
    path, tree = saved
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    cut = tmp_path / "cut.safetensors"
    # in the data section: the message names the first tensor that runs past the end
    cut.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError) as e:
        jio.load(cut)
    msg = str(e.value)
    assert str(cut) in msg and "truncated" in msg
    tensors, _, size = jio.read_header(path)
    first = min((kv for kv in tensors.items() if kv[1]["offsets"][1] > size - 10),
                key=lambda kv: kv[1]["offsets"][0])[0]
    assert repr(first) in msg and "has only" in msg
    # in the header
    cut.write_bytes(raw[:8 + header_len // 2])
    with pytest.raises(CheckpointError, match=r"truncated: the header says it is \d+ bytes"):
        jio.load(cut)
    # shorter than the length prefix
    cut.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=r"truncated: 5 bytes"):
        jio.load(cut)
    with pytest.raises(CheckpointError, match="truncated"):
        jio.describe(cut)
    cut.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated: 0 bytes"):
        jio.load(cut)
    with pytest.raises(FileNotFoundError):
        jio.load(tmp_path / "missing.safetensors")


def _parts(path):
    """{name: (st_dtype, shape, bytes)} and metadata of a saved file."""
    header, meta, _ = jio.read_header(path)
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    out = {n: (t["st_dtype"], t["shape"], raw[start + t["offsets"][0]:start + t["offsets"][1]])
           for n, t in header.items()}
    return out, meta


def test_wrong_dtype(saved, tmp_path):
    path, tree = saved
    parts, meta = _parts(path)
    bad = tmp_path / "dtype.safetensors"
    # the block scales stored as raw bytes instead of float8_e4m3fn: same size, wrong type
    dt, shape, data = parts["w.scales"]
    parts["w.scales"] = ("U8", shape, data)
    _write_raw(bad, parts, meta)
    with pytest.raises(CheckpointError) as e:
        jio.load(bad)
    assert str(e.value) == (f"{bad}: tensor 'w.scales': expected dtype float8_e4m3fn "
                            "(F8_E4M3), got uint8 (U8)")
    # a plain tensor checked against the target's dtype
    parts, meta = _parts(path)
    b = np.frombuffer(parts["b"][2], np.float32).astype(ml_dtypes.bfloat16)
    parts["b"] = ("BF16", (32,), b.tobytes())
    _write_raw(bad, parts, meta)
    with pytest.raises(CheckpointError, match=r"tensor 'b': expected dtype float32 \(F32\), "
                       r"got bfloat16 \(BF16\)"):
        jio.load(bad, target=tree)
    assert jio.load(bad)["b"].dtype == jnp.bfloat16  # without a target nothing to check


def test_wrong_shape(saved, tmp_path):
    path, tree = saved
    parts, meta = _parts(path)
    bad = tmp_path / "shape.safetensors"
    dt, shape, data = parts["w.qdata"]  # (32, 32) codes for a (64, 32) kernel
    parts["w.qdata"] = (dt, (64, 16), data)  # same bytes, wrong shape
    _write_raw(bad, parts, meta)
    with pytest.raises(CheckpointError) as e:
        jio.load(bad)
    assert str(e.value) == (f"{bad}: tensor 'w.qdata': expected shape (32, 32), got (64, 16)")
    # the target disagrees with the file
    target = dict(tree, b=jnp.zeros(16))
    with pytest.raises(CheckpointError, match=r"tensor 'b': expected shape \(16,\), got \(32,\)"):
        jio.load(path, target=target)
    target = dict(tree, w=jf.quantize(_x((32, 64)), "nvfp4", axis=0, tensor_scale="auto"))
    with pytest.raises(CheckpointError, match=r"QArray 'w': expected shape \(32, 64\), got "
                       r"\(64, 32\)"):
        jio.load(path, target=target)
    target = dict(tree, w=jf.quantize(_x((64, 32)), "mxfp4", axis=0))
    with pytest.raises(CheckpointError, match="QArray 'w': expected format 'mxfp4', got 'nvfp4'"):
        jio.load(path, target=target)
    # header bytes inconsistent with dtype x shape
    parts, meta = _parts(path)
    parts["b"] = ("F32", (33,), parts["b"][2])
    _write_raw(bad, parts, meta)
    with pytest.raises(CheckpointError, match=r"tensor 'b': 128 bytes stored, but dtype F32 "
                       r"and shape \(33,\) need 132"):
        jio.load(bad)


def test_mismatched_structure(saved, tmp_path):
    path, tree = saved
    with pytest.raises(CheckpointError, match="tensor 'c' is missing"):
        jio.load(path, target=dict(tree, c=jnp.zeros(3)))
    with pytest.raises(CheckpointError, match="1 tensor\\(s\\) not in the target: b"):
        jio.load(path, target={"w": tree["w"]})
    assert set(jio.load(path, target={"w": tree["w"]}, strict=False)) == {"w"}
    with pytest.raises(CheckpointError, match="expected a nvfp4 QArray"):
        jio.load(path, target={"w": tree["w"], "b": jf.quantize(_x((32, 16)), "nvfp4")})
    with pytest.raises(CheckpointError, match="expected a plain tensor"):
        jio.load(path, target={"w": jnp.zeros((64, 32)), "b": tree["b"]})
    parts, meta = _parts(path)
    bad = tmp_path / "missing.safetensors"
    del parts["w.tensor_scale"]
    _write_raw(bad, parts, meta)
    with pytest.raises(CheckpointError, match=r"tensor w.tensor_scale is missing \(part of the "
                       r"nvfp4 QArray 'w'\)"):
        jio.load(bad)
    parts, meta = _parts(path)
    _write_raw(bad, parts, dict(meta, **{"jax_fp4.qarrays": "{not json"}))
    with pytest.raises(CheckpointError, match="corrupt 'jax_fp4.qarrays' metadata"):
        jio.load(bad)
    raw = bytearray(path.read_bytes())
    raw[9] = ord("#")
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        jio.load(bad)


# ----------------------------------------------------------------------------- real model


def test_quantized_minilm_round_trip(encoder, tmp_path):
    fmt = "nvfp4"
    from flax import nnx

    from jax_fp4.nn.flax import quantize_model

    model = quantize_model(encoder.model, fmt)
    state = nnx.state(model)
    path = tmp_path / "minilm.safetensors"
    jio.save(path, state)
    assert os.path.getsize(path) < 60 * 2**20  # 4-bit dense weights (embeddings stay fp32)
    # load into an abstract copy of the quantized model: no weights needed beforehand
    abstract = nnx.eval_shape(lambda: quantize_model(encoder.model, fmt))
    graphdef, abstract_state = nnx.split(abstract)
    back = jio.load(path, target=abstract_state)
    assert_trees_bit_equal(back, state)
    restored = nnx.merge(graphdef, back)
    sents = ["Quantized checkpoints load bit for bit.", "The weather is nice today."]
    np.testing.assert_array_equal(encoder.encode(sents, model=restored),
                                  encoder.encode(sents, model=model))
