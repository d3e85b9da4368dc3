"""Checkpoint conventions of the PyTorch world (jax_fp4.io.conventions), against the real
libraries where they run on CPU (bitsandbytes, ModelOpt, compressed-tensors/llm-compressor
in tests/test_interop_minilm.py) and against re-implementations of the documented
unpack/dequantize code where they do not (AutoAWQ, GPTQModel: see each test)."""
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import io as jio
from jax_fp4.io import CheckpointError

torch = pytest.importorskip("torch")
stt = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.peers


def _bits(a):
    """Raw bits of a jax/numpy/torch float array as unsigned ints."""
    if isinstance(a, torch.Tensor):
        a = a.view({2: torch.int16, 4: torch.int32}[a.element_size()]).numpy()
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bnb_equal(ours, ref, packed):
    """ours == bitsandbytes' dequantize ``ref`` bit for bit, except that on a CPU without
    AVX-512 bitsandbytes decodes FP4 code 8 as -0 where its table (and we) give +0
    (docs/spec.md section 3; pinned in tests/test_peers.py): only those cells may differ,
    and only by that sign. ``packed``: bitsandbytes' uint8 codes (high nibble first)."""
    ours, ref = _bits(ours), _bits(ref)
    b = np.asarray(packed).reshape(-1)
    codes = np.stack([b >> 4, b & 15], -1).reshape(-1)[:ours.size].reshape(ours.shape)
    sign = ours.dtype.type(1 << (8 * ours.itemsize - 1))
    allowed = (codes == 8) & (ours == 0) & (ref == sign)
    np.testing.assert_array_equal(np.where(allowed, ref, ours), ref)


def _save_dir(d, sd, config=None, extra=None):
    os.makedirs(d, exist_ok=True)
    stt.save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
    for name, content in {"config.json": config or {}, **(extra or {})}.items():
        with open(os.path.join(d, name), "w") as fh:
            json.dump(content, fh)
    return d


def _weight(rng, out=64, k=256, dtype=torch.bfloat16):
    w = rng.standard_normal((out, k)).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero block
    w[1, 3] = 40.0  # an outlier
    return torch.from_numpy(w).to(dtype)


# ----------------------------------------------------------------------------- bitsandbytes
bnbf = pytest.importorskip("bitsandbytes.functional")


def _bnb_state_dict(w, qt, nested, blocksize, prefix="l"):
    # what transformers writes for a bnb Linear4bit: weight + QuantState.as_dict(packed=True)
    q, st = bnbf.quantize_4bit(w, blocksize=blocksize, quant_type=qt,
                               compress_statistics=nested)
    sd = {f"{prefix}.weight": q, f"{prefix}.bias": torch.arange(w.shape[0], dtype=w.dtype)}
    sd.update({f"{prefix}.weight.{k}": v for k, v in st.as_dict(packed=True).items()})
    return sd, bnbf.dequantize_4bit(q, st)


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 256])
def test_bnb_loads_bit_exact_and_back(tmp_path, rng, qt, nested, blocksize):
    w = _weight(rng)
    sd, ref = _bnb_state_dict(w, qt, nested, blocksize)
    cfg = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                   "bnb_4bit_quant_type": qt,
                                   "bnb_4bit_use_double_quant": nested}}
    d = _save_dir(tmp_path / "src", sd, cfg)
    assert jio.detect(d) == "bitsandbytes"
    t = jio.load(d)
    q = t["l.weight"]
    assert isinstance(q, jf.QArray) and q.format == {"nf4": "nf4", "fp4": "bnb_fp4"}[qt]
    assert (q.shape, q.axis, q.block_size, q.dtype) == ((64, 256), 1, blocksize,
                                                        np.dtype(ml_dtypes.bfloat16))
    _assert_bnb_equal(q.dequantize(), ref, sd["l.weight"])
    np.testing.assert_array_equal(np.asarray(t["l.bias"], np.float32), np.arange(64))
    # ours back into bitsandbytes: QuantState.from_dict + dequantize_4bit
    jio.save(tmp_path / "ours", t, convention="bitsandbytes")
    sd2 = stt.load_file(tmp_path / "ours" / "model.safetensors")
    qs = bnbf.QuantState.from_dict({k[len("l.weight."):]: v for k, v in sd2.items()
                                    if k.startswith("l.weight.")}, device="cpu")
    np.testing.assert_array_equal(_bits(bnbf.dequantize_4bit(sd2["l.weight"], qs)), _bits(ref))


def test_bnb_blocks_across_rows_load_dense(tmp_path, rng):
    w = _weight(rng, out=6, k=96)  # 96 % 64 != 0: blocks of the flat tensor straddle rows
    sd, _ = _bnb_state_dict(w, "nf4", False, 64)
    path = str(tmp_path / "w.safetensors")
    stt.save_file(sd, path)
    t = jio.load(path)
    assert not isinstance(t["l.weight"], jf.QArray)
    # bitsandbytes' own flat-block decode (backends/default/ops.py, as CUDA does). Its CPU
    # C++ kernel (backends/cpu/ops.py) blocks each row instead, which disagrees with its own
    # quantize_4bit whenever in % blocksize != 0, so it is not the reference here.
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    ref = _dequantize_4bit_compute(sd["l.weight"].reshape(-1), sd["l.weight.absmax"],
                                   sd["l.weight.quant_map"], 64, (6, 96), torch.bfloat16)
    np.testing.assert_array_equal(_bits(t["l.weight"]), _bits(ref))


def test_bnb_ours_quantized_in_jax(tmp_path, rng):
    x = rng.standard_normal((32, 128)).astype(np.float32)
    q = jf.quantize(jnp.asarray(x, jnp.float16), "nf4", axis=1, block_size=64)
    jio.save(tmp_path / "m", {"a": {"weight": q}}, convention="bitsandbytes")
    sd = stt.load_file(tmp_path / "m" / "model.safetensors")
    qs = bnbf.QuantState.from_dict({k[len("a.weight."):]: v for k, v in sd.items()
                                    if k.startswith("a.weight.")}, device="cpu")
    np.testing.assert_array_equal(_bits(bnbf.dequantize_4bit(sd["a.weight"], qs)),
                                  _bits(q.dequantize()))


# ----------------------------------------------------------------------------- ModelOpt
def _modelopt():
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor


def _hf_quant():
    return {"producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16}}


def _assert_equal_but_code8(ours, theirs, data):
    """Bits equal, except that ModelOpt decodes E2M1 code 8 (-0) as +0 (its value table
    has +0.0 there), where jax-fp4, compressed-tensors and vLLM give -0."""
    o, t = _bits(ours), _bits(theirs)
    diff = o != t
    codes = np.asarray(jf.layout.unpack(jnp.asarray(data), 4))
    assert (codes[diff] == 8).all() and (t[diff] == 0).all()
    assert (o[diff] == {2: 0x8000, 4: 0x80000000}[o.dtype.itemsize]).all()


def test_modelopt_loads_bit_exact_and_back(tmp_path, rng):
    NVFP4QTensor = _modelopt()
    w = _weight(rng)
    qt, s, s2 = NVFP4QTensor.quantize(w, 16)
    sd = {"m.weight": qt._quantized_data, "m.weight_scale": s, "m.weight_scale_2": s2,
          "m.input_scale": torch.tensor(0.25)}
    d = _save_dir(tmp_path / "src", sd, {"torch_dtype": "bfloat16"}, {"hf_quant_config.json": _hf_quant()})
    assert jio.detect(d) == "modelopt"
    t = jio.load(d)
    q = t["m.weight"]
    assert q.format == "nvfp4" and q.tensor_scale is not None and q.shape == (64, 256)
    ref = qt.dequantize(dtype=torch.bfloat16, scale=s, double_scale=s2, block_sizes={-1: 16})
    _assert_equal_but_code8(q.dequantize(), ref, qt._quantized_data.numpy())
    assert float(t["m.input_scale"]) == 0.25
    # ours in ModelOpt: its dequantize of our tensors
    jio.save(tmp_path / "ours", t, convention="modelopt")
    assert json.load(open(tmp_path / "ours" / "hf_quant_config.json"))["quantization"][
        "quant_algo"] == "NVFP4"
    sd2 = stt.load_file(tmp_path / "ours" / "model.safetensors")
    for k in ("m.weight", "m.weight_scale", "m.weight_scale_2"):
        assert torch.equal(sd2[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)), k
    qt2 = NVFP4QTensor(w.shape, torch.bfloat16, sd2["m.weight"])
    back = qt2.dequantize(dtype=torch.bfloat16, scale=sd2["m.weight_scale"],
                          double_scale=sd2["m.weight_scale_2"], block_sizes={-1: 16})
    np.testing.assert_array_equal(_bits(back), _bits(ref))


# ----------------------------------------------------------------------------- AutoAWQ
# AutoAWQ is not installable next to torch 2.13 / transformers 5 (archived, imports removed
# transformers APIs), so its documented packing and dequantization are re-implemented here
# from casper-hansen/AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear: nibble i
# of word j holds column 8j + [0,2,4,6,1,3,5,7][i]) and awq/utils/packing_utils.py
# (unpack_awq, reverse_awq_order, dequantize_gemm: (iweight - izeros) * scales in fp16).
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_quantize(w, group):
    """AutoAWQ's pseudo_quantize_tensor (zero point, w_bit 4) -> int (in, out) codes,
    zeros (in/g, out), fp16 scales (in/g, out)."""
    out, k = w.shape
    g = w.float().reshape(-1, group)
    mx, mn = g.amax(1, keepdim=True), g.amin(1, keepdim=True)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(mn / scales)).clamp(0, 15)
    iw = (torch.round(g / scales) + zeros).clamp(0, 15).to(torch.int32)
    return (iw.reshape(out, k).t().contiguous(), zeros.reshape(out, -1).t().to(torch.int32),
            scales.reshape(out, -1).t().half().contiguous())


def _awq_pack(iw):  # (rows, cols) int -> (rows, cols/8) int32, AWQ order
    q = torch.zeros(iw.shape[0], iw.shape[1] // 8, dtype=torch.int32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            q[:, col] |= iw[:, col * 8 + _AWQ_ORDER[i]] << (i * 4)
    return q


def _awq_dequantize(qweight, qzeros, scales, group):
    shifts = torch.arange(0, 32, 4)
    iw = (qweight[:, :, None] >> shifts).reshape(qweight.shape[0], -1)
    iz = (qzeros[:, :, None] >> shifts).reshape(qzeros.shape[0], -1)
    rev = torch.arange(iw.shape[-1]).view(-1, 8)[:, _AWQ_REVERSE].reshape(-1)
    iw, iz = iw[:, rev] & 15, iz[:, rev] & 15
    return (iw - iz.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)


def test_awq_loads_bit_exact_and_back(tmp_path, rng):
    w = _weight(rng, 64, 256, torch.float16)
    iw, iz, s = _awq_quantize(w, 128)
    sd = {"l.qweight": _awq_pack(iw), "l.qzeros": _awq_pack(iz), "l.scales": s}
    cfg = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                   "zero_point": True, "version": "gemm"}}
    d = _save_dir(tmp_path / "src", sd, cfg)
    assert jio.detect(d) == "awq"
    q = jio.load(d)["l.weight"]
    assert (q.format, q.shape, q.block_size, q.dtype) == ("int4", (64, 256), 128,
                                                          np.dtype(np.float16))
    ref = _awq_dequantize(sd["l.qweight"], sd["l.qzeros"], s, 128)
    assert ref.dtype == torch.float16
    np.testing.assert_array_equal(_bits(q.dequantize()), _bits(ref.t().contiguous()))
    jio.save(tmp_path / "ours", {"l": {"weight": q}}, convention="awq")
    sd2 = stt.load_file(tmp_path / "ours" / "model.safetensors")
    for k in sd:
        assert torch.equal(sd2[k], sd[k]), k


def test_awq_detected_from_names_alone(tmp_path, rng):
    iw, iz, s = _awq_quantize(_weight(rng, 16, 64, torch.float16), 32)
    path = str(tmp_path / "a.safetensors")
    stt.save_file({"l.qweight": _awq_pack(iw), "l.qzeros": _awq_pack(iz), "l.scales": s}, path)
    assert jio.detect(path) == "awq"


# ----------------------------------------------------------------------------- GPTQ
# GPTQModel needs torch 2.14 and CUDA wheels (it would replace the pinned torch), AutoGPTQ is
# archived: the packing and dequantization are re-implemented from ModelCloud/GPTQModel
# gptqmodel/nn_modules/qlinear/__init__.py (PackableQuantLinear.pack / dequantize_weight:
# qweight packs 8 input rows per int32, nibble i = row 8r + i; qzeros packs 8 output columns;
# checkpoint_format "gptq" stores zero - 1; weight = scales[g_idx] * (q - zeros[g_idx]) in
# fp16).
def _gptq_quantize(w, group, act_order, rng):
    out, k = w.shape
    perm = torch.from_numpy(rng.permutation(k)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)  # desc_act: groups follow perm
    wf = w.float()
    ng = k // group
    scales = torch.empty(ng, out)
    zeros = torch.empty(ng, out, dtype=torch.int32)
    for gi in range(ng):
        cols = wf[:, g_idx == gi]
        mx, mn = cols.amax(1).clamp(min=0), cols.amin(1).clamp(max=0)
        sc = ((mx - mn) / 15).clamp(min=1e-5).half().float()
        scales[gi], zeros[gi] = sc, torch.round(-mn / sc).clamp(1, 15).to(torch.int32)
    q = (torch.round(wf / scales[g_idx.long()].t()) + zeros[g_idx.long()].t()).clamp(0, 15)
    return q.to(torch.int32).t().contiguous(), zeros, scales.half(), g_idx


def _pack_rows(iw):  # (k, n) -> (k/8, n), nibble i = row 8r + i
    iw = iw.reshape(-1, 8, iw.shape[1])
    return sum((iw[:, i] << (4 * i)) for i in range(8)).to(torch.int32)


def _gptq_dequantize(qweight, qzeros, scales, g_idx):
    shifts = torch.arange(0, 32, 4)
    z = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1) + 1
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    return scales[g_idx.long()] * (q - z[g_idx.long()])


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_loads_bit_exact(tmp_path, rng, act_order):
    w = _weight(rng, 64, 256, torch.float16)
    iw, z, s, g_idx = _gptq_quantize(w, 64, act_order, rng)
    sd = {"l.qweight": _pack_rows(iw), "l.qzeros": _pack_cols(z - 1), "l.scales": s,
          "l.g_idx": g_idx}
    cfg = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                   "desc_act": act_order, "sym": False}}
    d = _save_dir(tmp_path / "src", sd, cfg)
    assert jio.detect(d) == "gptq"
    q = jio.load(d)["l.weight"]
    ref = _gptq_dequantize(sd["l.qweight"], sd["l.qzeros"], s, g_idx)
    assert ref.dtype == torch.float16
    np.testing.assert_array_equal(_bits(q.dequantize()), _bits(ref.t().contiguous()))
    if not act_order:
        assert q.block_size == 64
        jio.save(tmp_path / "ours", {"l": {"weight": q}}, convention="gptq")
        sd2 = stt.load_file(tmp_path / "ours" / "model.safetensors")
        for k in sd:
            assert torch.equal(sd2[k], sd[k]), k
    else:
        assert q.block_size < 64  # groups are not contiguous runs: finer blocks, same values


def _pack_cols(z):  # (groups, n) -> (groups, n/8), nibble i = column 8j + i
    z = z.reshape(z.shape[0], -1, 8)
    return sum((z[:, :, i] << (4 * i)) for i in range(8)).to(torch.int32)


# ----------------------------------------------------------------------------- LightX2V
def _swz(r, c, n_cols):  # SEEDS_API.md's SWZ(r, c), written out independently
    nkt = -(-n_cols // 4)
    return (r // 128) * nkt * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def test_lightx2v_layout_and_decode(tmp_path, rng):
    x = rng.standard_normal((130, 96)).astype(np.float32)
    q = jf.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4", axis=1, tensor_scale="auto")
    tree = {"blk.proj": {"weight": q, "input_global_scale": np.float32([2688 / 5.0])}}
    jio.save(tmp_path / "l.safetensors", tree, convention="lightx2v")
    sd = stt.load_file(tmp_path / "l.safetensors")
    sw = sd["blk.proj.weight_scale"]
    assert sw.dtype == torch.float8_e4m3fn and tuple(sw.shape) == (256, 8)
    lin = np.asarray(q.scales).view(np.uint8)
    flat = sw.view(torch.uint8).reshape(-1).numpy()
    r, c = np.meshgrid(np.arange(130), np.arange(6), indexing="ij")
    np.testing.assert_array_equal(flat[_swz(r, c, 6)], lin)
    assert flat.sum() == lin.astype(np.int64).sum()  # padding is 0
    gs = sd["blk.proj.weight_global_scale"]
    np.testing.assert_allclose(float(sd["blk.proj.alpha"]),
                               1 / (float(sd["blk.proj.input_global_scale"]) * float(gs)),
                               rtol=1e-7)
    # SEEDS_API.md 000 decode: f32(e2m1(code) * s / gs). Our load holds ts = f32(1 / gs)
    # and decodes f32(e2m1 * f32(s * ts)) exactly: three roundings of half an ulp against
    # the division's one, so the two decodes differ by at most 2 ulps (f32)
    e2m1 = np.float32([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    codes = np.asarray(jf.layout.unpack(jnp.asarray(sd["blk.proj.weight"].numpy()), 4))
    s = np.repeat(lin.view(ml_dtypes.float8_e4m3fn).astype(np.float32), 16, axis=1)
    want = (e2m1[codes] * s / gs.numpy()[0]).astype(np.float32)
    assert jio.detect(tmp_path / "l.safetensors") == "lightx2v"
    t = jio.load(tmp_path / "l.safetensors")
    got = np.asarray(t["blk.proj.weight"].dequantize(jnp.float32))
    ts = np.float32(1) / gs.numpy()[0]
    assert float(t["blk.proj.weight"].tensor_scale) == ts
    np.testing.assert_array_equal(got, e2m1[codes] * (s * ts))
    ulp = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulp.max() <= 2
    np.testing.assert_array_equal(np.asarray(t["blk.proj.weight"].data), np.asarray(q.data))


# ----------------------------------------------------------------------------- errors
def _bnb_dir(tmp_path, rng, mutate):
    sd, _ = _bnb_state_dict(_weight(rng), "nf4", True, 64)
    mutate(sd)
    return _save_dir(tmp_path / "bad", sd)


@pytest.mark.parametrize("mutate,needle", [
    (lambda sd: sd.pop("l.weight.nested_absmax"), "'l.weight.nested_absmax' is missing"),
    (lambda sd: sd.__setitem__("l.weight.absmax", sd["l.weight.absmax"][:-1]),
     "expected shape (256,), got (255,)"),
    (lambda sd: sd.__setitem__("l.weight.quant_map", sd["l.weight.quant_map"].double()),
     "expected dtype float32, got float64"),
    (lambda sd: sd.__setitem__("l.weight", sd["l.weight"][:-1]), "expected 8192 bytes"),
])
def test_corrupt_bnb_names_tensor(tmp_path, rng, mutate, needle):
    with pytest.raises(CheckpointError, match=None) as e:
        jio.load(_bnb_dir(tmp_path, rng, mutate))
    assert needle in str(e.value)


@pytest.mark.parametrize("conv,tensors,needle", [
    ("modelopt", {"m.weight": np.zeros((8, 16), np.uint8),
                  "m.weight_scale": np.zeros((8, 3), ml_dtypes.float8_e4m3fn),
                  "m.weight_scale_2": np.float32([1])},
     "'m.weight_scale': expected shape (8, 2), got (8, 3)"),
    ("modelopt", {"m.weight": np.zeros((8, 16), np.uint8),
                  "m.weight_scale": np.zeros((8, 2), np.float16),
                  "m.weight_scale_2": np.float32([1])},
     "'m.weight_scale': expected dtype float8_e4m3fn, got float16"),
    ("compressed-tensors", {"m.weight_packed": np.zeros((8, 16), np.uint8),
                            "m.weight_scale": np.zeros((8, 2), ml_dtypes.float8_e4m3fn)},
     "'m.weight_global_scale' is missing"),
    ("compressed-tensors", {"m.weight_packed": np.zeros((8, 2), np.int32),
                            "m.weight_shape": np.int64([8, 16]),
                            "m.weight_scale": np.zeros((8, 3), np.float32)},
     "'m.weight_scale': expected shape (8, in/group) with in = 16, got (8, 3)"),
    ("awq", {"m.qweight": np.zeros((32, 1), np.int32), "m.qzeros": np.zeros((2, 1), np.int32),
             "m.scales": np.zeros((2, 8), np.float32)},
     "'m.scales': expected dtype float16, got float32"),
    ("gptq", {"m.qweight": np.zeros((4, 8), np.int32), "m.qzeros": np.zeros((1, 1), np.int32),
              "m.scales": np.zeros((1, 8), np.float16), "m.g_idx": np.zeros(31, np.int32)},
     "'m.g_idx': expected shape (32,)"),
    ("lightx2v", {"m.weight": np.zeros((8, 16), np.uint8),
                  "m.weight_scale": np.zeros((8, 2), ml_dtypes.float8_e4m3fn),
                  "m.weight_global_scale": np.float32([1])},
     "'m.weight_scale': expected shape (128, 4), got (8, 2)"),
])
def test_mismatched_tensors_name_tensor(tmp_path, conv, tensors, needle):
    path = str(tmp_path / "x.safetensors")
    jio.save(path, {k: v for k, v in tensors.items()})
    with pytest.raises(CheckpointError) as e:
        jio.load(path, convention=conv)
    assert needle in str(e.value)


def test_unknown_quant_method_and_convention(tmp_path):
    d = _save_dir(tmp_path / "d", {"a": torch.zeros(2)},
                  {"quantization_config": {"quant_method": "hqq"}})
    with pytest.raises(CheckpointError, match="quant_method 'hqq' is not supported"):
        jio.load(d)
    with pytest.raises(ValueError, match="convention: expected one of"):
        jio.load(d, convention="tensorrt")


def test_sharded_directory(tmp_path, rng):
    sd, ref = _bnb_state_dict(_weight(rng), "fp4", False, 64)
    names = sorted(sd)
    d = tmp_path / "sh"
    d.mkdir()
    half = {n: ("model-00001-of-00002.safetensors" if i % 2 else
                "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    for f in set(half.values()):
        stt.save_file({n: sd[n] for n in names if half[n] == f}, str(d / f))
    json.dump({"weight_map": half}, open(d / "model.safetensors.index.json", "w"))
    q = jio.load(d)["l.weight"]
    _assert_bnb_equal(q.dequantize(), ref, sd["l.weight"])
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors'"):
        jio.load(d)


def test_default_convention_unchanged(tmp_path, rng):
    x = jnp.asarray(rng.standard_normal((16, 64)).astype(np.float32))
    tree = {"w": jf.quantize(x, "nvfp4", tensor_scale="auto"), "b": x[0]}
    jio.save(tmp_path / "n.safetensors", tree)
    assert jio.detect(tmp_path / "n.safetensors") == "jax_fp4"
    back = jio.load(tmp_path / "n.safetensors")
    np.testing.assert_array_equal(np.asarray(back["w"].data), np.asarray(tree["w"].data))
    with pytest.raises(ValueError, match="stores a 2-D .* nvfp4 QArray"):
        jio.save(tmp_path / "bad", {"w": jf.quantize(x, "mxfp4")}, convention="modelopt")


def test_cli_convert_between_conventions(tmp_path, rng, capsys):
    from jax_fp4.cli import main

    sd, ref = _bnb_state_dict(_weight(rng), "nf4", True, 64)
    src = _save_dir(tmp_path / "src", sd, {"model_type": "toy", "quantization_config": {
        "quant_method": "bitsandbytes", "bnb_4bit_quant_type": "nf4"}})
    assert main(["convert", str(src), str(tmp_path / "n.safetensors"), "--to", "jax_fp4"]) == 0
    assert "(bitsandbytes, 1 quantized of 2 tensors)" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "n.safetensors"), str(tmp_path / "b"),
                 "--to", "bitsandbytes"]) == 0
    cfg = json.load(open(tmp_path / "b" / "config.json"))
    assert cfg["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    np.testing.assert_array_equal(_bits(jio.load(tmp_path / "b")["l.weight"].dequantize()),
                                  _bits(ref))
    # nf4 is not a compressed-tensors scheme: a clear error, exit status 2
    assert main(["convert", str(src), str(tmp_path / "ct"), "--to", "compressed-tensors"]) == 2
    assert "compressed-tensors stores a 2-D (out, in) nvfp4/int4 QArray" in capsys.readouterr().err
