"""The jax-fp4 command: demo (on a subset of the sentences), quantize, inspect."""
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4.cli import main
from jax_fp4.models import demo

pytest.importorskip("safetensors")
from jax_fp4 import io as jio  # noqa: E402


def _have_model():
    try:
        pytest.importorskip("flax")
        pytest.importorskip("tokenizers")
        from jax_fp4.models import minilm

        return minilm.default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def encoder():
    _have_model()
    from jax_fp4.models import minilm

    return minilm.load_sentence_encoder()


# ----------------------------------------------------------------------------- demo
def test_packaged_sentences():
    s = demo.load_sentences()
    assert len(s) >= 200 and len(set(s)) == len(s)
    assert demo.load_sentences(limit=5) == s[:5]
    with pytest.raises(ValueError, match="limit"):
        demo.load_sentences(limit=1)


def test_rank_correlation_numpy_matches_scipy(rng):
    from scipy.stats import rankdata, spearmanr

    x = rng.integers(0, 20, 300).astype(float)  # many ties
    y = x + rng.normal(0, 3, 300)
    np.testing.assert_array_equal(demo.rankdata(x), rankdata(x))
    r = demo.spearman(x, y)
    assert r == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    import builtins

    real_import = builtins.__import__

    def no_scipy(name, *a, **k):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    builtins.__import__ = no_scipy
    try:
        assert demo.spearman(x, y) == pytest.approx(r, abs=1e-12)
    finally:
        builtins.__import__ = real_import


def test_compare_embeddings():
    e = np.eye(4)[:, :3] + 0.1
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    m = demo.compare_embeddings(e, e)
    assert m == {"cos_mean": pytest.approx(1), "cos_min": pytest.approx(1),
                 "spearman": pytest.approx(1), "top1": 1.0}
    f = e[::-1].copy()
    assert demo.compare_embeddings(f, e)["cos_min"] < 0.9
    per = demo.compare_embeddings(f, e, per_sentence=True)
    assert np.mean(per["top1_hits"]) == per["top1"] and len(per["cos"]) == 4


def test_paired_bootstrap(rng):
    a = rng.random(400) < 0.9
    b = a.copy()
    b[:20] = ~b[:20]  # 20 sentences flipped: the difference is their net count / 400
    r = demo.paired_bootstrap(a, b, seed=3)
    assert r["diff"] == pytest.approx((2 * a[:20].sum() - 20) / 400)
    assert r["low"] < r["diff"] < r["high"]
    # a paired difference's interval shrinks with n: 4x the sentences, about half the width
    r4 = demo.paired_bootstrap(np.tile(a, 4), np.tile(b, 4), seed=3)
    assert 0.35 < (r4["high"] - r4["low"]) / (r["high"] - r["low"]) < 0.65
    assert demo.paired_bootstrap(a, a) == {"diff": 0.0, "low": 0.0, "high": 0.0}
    assert demo.paired_bootstrap(a, b, seed=3) == r
    with pytest.raises(ValueError, match="a, b"):
        demo.paired_bootstrap(a, b[:-1])
    with pytest.raises(ValueError, match="level"):
        demo.paired_bootstrap(a, b, level=95)


def test_best_vs_rtn_picks_by_cosine_not_top1():
    def row(method, cos, hits, act=None):
        return {"weights": "nf4", "method": method, "activations": act, "cos_mean": cos,
                "top1_hits": hits, "cos": [cos] * len(hits)}

    hits = [True] * 8 + [False] * 2
    rows = [{"variant": "float32", "weights": "float32", "method": None, "activations": None},
            row("rtn", 0.97, hits), row("mse", 0.975, [True] * 10),
            row("gptq", 0.99, [False] + hits[1:]), row("gptq", 0.999, hits, "nvfp4")]
    out = demo.best_vs_rtn({"rows": rows}, resamples=200)
    # GPTQ has the highest weight-only cosine mean; MSE's better top-1 does not decide
    assert list(out) == ["nf4"] and out["nf4"]["method"] == "gptq"
    assert out["nf4"]["diff"] == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="no RTN row"):
        demo.best_vs_rtn({"rows": rows[:1] + rows[2:]})
    with pytest.raises(ValueError, match="per_sentence"):
        demo.best_vs_rtn({"rows": [{k: v for k, v in r.items() if k != "top1_hits"}
                                   for r in rows]})


def test_parse_variant():
    v = demo.parse_variant("nvfp4:nvfp4")
    assert (v.weights, v.activations, v.act_mode) == ("nvfp4", "nvfp4", "scaled")
    assert demo.parse_variant("nf4:mxfp8_e4m3").act_mode == "fake"
    assert demo.parse_variant("int4").activations is None
    with pytest.raises(ValueError):
        demo.parse_variant("fp5")
    with pytest.raises(ValueError, match="act_format"):
        demo.parse_variant("nvfp4:nf4")


def test_demo_json_and_stability(encoder, capsys):
    variants = ["mxfp8_e4m3", "nvfp4", "nvfp4:nvfp4"]
    res = demo.run_demo(variants=variants, limit=24, batch_size=24, progress=False,
                        encoder=encoder)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["float32"] + variants and res["sentences"] == 24
    assert rows["float32"]["cos_min"] == pytest.approx(1.0)
    assert rows["mxfp8_e4m3"]["cos_mean"] > 0.99 and rows["mxfp8_e4m3"]["cos_min"] > 0.99
    assert rows["nvfp4"]["cos_mean"] > 0.9 and rows["nvfp4"]["cos_min"] > 0.85
    assert rows["nvfp4:nvfp4"]["cos_mean"] > 0.9
    assert rows["nvfp4:nvfp4"]["act_mode"] == "scaled"
    for r in rows.values():
        assert r["spearman"] > 0.9 and 0 <= r["top1"] <= 1 and r["seconds"] > 0
    # 36 dense kernels, 10.6M weights: codes + scales (+ one fp32 tensor scale for nvfp4)
    n = 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    assert rows["float32"]["weight_bytes"] == 4 * n
    assert rows["nvfp4"]["weight_bytes"] == n // 2 + n // 16 + 36 * 4
    assert rows["mxfp8_e4m3"]["weight_bytes"] == n + n // 32
    assert rows["nvfp4"]["compression"] == pytest.approx(2 * n / (n // 2 + n // 16 + 144))
    # the numbers are stable between runs (same XLA programs, same inputs)
    res2 = demo.run_demo(variants=variants, limit=24, batch_size=24, progress=False,
                         encoder=encoder)
    keys = ("cos_mean", "cos_min", "spearman", "top1", "weight_bytes")
    assert [{k: r[k] for k in keys} for r in res["rows"]] == \
        [{k: r[k] for k in keys} for r in res2["rows"]]
    table = demo.format_table(res)
    assert table.splitlines()[0].startswith("| weights | activations | dense weights")
    assert "| nvfp4 | nvfp4 (scaled) |" in table


def test_cli_demo_main(capsys, monkeypatch, encoder):
    from jax_fp4.models import minilm

    # reuse the loaded encoder (and its compiled float32 program): only loading differs
    monkeypatch.setattr(minilm, "load_sentence_encoder",
                        lambda d=None: encoder if d is None else pytest.fail(d))
    assert main(["demo", "--limit", "24", "--batch-size", "24", "--formats",
                 "mxfp8_e4m3:mxfp8_e4m3", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in res["rows"]] == ["float32", "mxfp8_e4m3:mxfp8_e4m3"]
    w8a8 = res["rows"][1]
    assert w8a8["act_mode"] == "scaled" and w8a8["cos_mean"] > 0.99 and w8a8["cos_min"] > 0.99
    # the text table, from the same results
    seen = {}

    def fake_run(model, variants, **kw):
        seen.update(kw, variants=[v.label for v in variants], model=model)
        return res

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert main(["demo", "--limit", "12", "--formats", "nf4", "int4,mxfp4", "--model", "/m",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| mxfp8_e4m3 | mxfp8_e4m3 (scaled) |" in out and "24 sentences" in out
    assert seen["variants"] == ["nf4", "int4", "mxfp4"] and seen["model"] == "/m"
    assert seen["limit"] == 12 and seen["progress"] is False
    assert main(["demo", "--formats", "fp5"]) == 2
    assert "fp5" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["demo", "--model", "/nonexistent/model-dir", "--no-progress"]) == 2
    assert "/nonexistent/model-dir: not a directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- quantize
def _torch_style_checkpoint(path):
    k = jax.random.key(0)
    tensors = {
        "embed_tokens.weight": jax.random.normal(k, (100, 64)),
        "layers.0.mlp.up_proj.weight": jax.random.normal(k, (128, 64)),    # (out, in)
        "layers.0.mlp.down_proj.weight": jax.random.normal(k, (64, 128)),
        "layers.0.mlp.down_proj.bias": jnp.zeros(64),
        "layers.0.norm.weight": jnp.ones(64),
        "flax_dense.kernel": jax.random.normal(k, (64, 32)),               # (in, out)
        "position_ids": jnp.arange(16, dtype=jnp.int32)[None],
    }
    jio.save(path, tensors, metadata={"format": "pt"})
    return tensors


def test_cli_quantize_and_inspect(tmp_path, capsys):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    tensors = _torch_style_checkpoint(src)
    assert main(["quantize", str(src), str(dst), "--format", "nvfp4", "-v"]) == 0
    out = capsys.readouterr().out
    assert "quantized 3 of 7 tensors to nvfp4" in out
    q = jio.load(dst)
    up = q["layers.0.mlp.up_proj.weight"]
    assert isinstance(up, jf.QArray) and up.axis == 1 and up.tensor_scale is not None
    assert q["flax_dense.kernel"].axis == 0
    for name in ("embed_tokens.weight", "layers.0.norm.weight", "position_ids",
                 "layers.0.mlp.down_proj.bias"):
        np.testing.assert_array_equal(np.asarray(q[name]), np.asarray(tensors[name]))
    ref = jf.quantize(tensors["layers.0.mlp.up_proj.weight"], "nvfp4", axis=1,
                      tensor_scale="auto")
    np.testing.assert_array_equal(np.asarray(up.data), np.asarray(ref.data))
    d = jio.describe(dst)
    assert d["metadata"] == {"format": "pt", "jax_fp4_source": "in.safetensors",
                             "jax_fp4_format": "nvfp4"}
    # --filter, other options
    assert main(["quantize", str(src), str(dst), "--format", "int4", "--filter", "up_proj",
                 "--block-size", "32"]) == 0
    q = jio.load(dst)
    assert q["layers.0.mlp.up_proj.weight"].block_size == 32
    assert not isinstance(q["layers.0.mlp.down_proj.weight"], jf.QArray)
    assert main(["quantize", str(src), str(dst), "--format", "mxfp4", "--filter", "nomatch"]) == 1
    assert "no tensor" in capsys.readouterr().err
    # inspect
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "1 quantized tensors" in out and "layers.0.mlp.up_proj.weight" in out
    assert "int4" in out and "128x64" in out
    assert main(["inspect", str(dst), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["qarrays"][0]["format"] == "int4" and d["qarrays"][0]["block_size"] == 32
    # errors: exit status 2 and a message naming the file
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00")
    assert main(["inspect", str(tmp_path / "bad.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "truncated" in err
    assert main(["quantize", str(tmp_path / "none.safetensors"), str(dst), "--format",
                 "nf4"]) == 2


def test_quantized_checkpoint_loads_into_minilm(tmp_path, encoder):
    """`jax-fp4 quantize` on the real model.safetensors, loaded back by the MiniLM loader,
    gives exactly the embeddings of quantizing the model in memory."""
    from jax_fp4.nn.flax import QuantizedLinear, quantize_model

    d = _have_model()
    for f in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
        shutil.copy(d / f, tmp_path / f)
    assert main(["quantize", str(d / "model.safetensors"), str(tmp_path / "model.safetensors"),
                 "--format", "mxfp4"]) == 0
    from jax_fp4.models import minilm

    q = minilm.load_bert(tmp_path)
    assert isinstance(q.layers[2].intermediate, QuantizedLinear)
    sents = demo.load_sentences(limit=4)
    np.testing.assert_array_equal(
        encoder.encode(sents, model=q),
        encoder.encode(sents, model=quantize_model(encoder.model, "mxfp4")))


def test_python_dash_m(tmp_path):
    path = tmp_path / "x.safetensors"
    jio.save(path, {"w": jf.quantize(jnp.ones((32, 32)), "mxfp4")})
    r = subprocess.run([sys.executable, "-m", "jax_fp4", "inspect", str(path), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["qarrays"][0]["name"] == "w"


# ----------------------------------------------------------------------------- bad input
def test_cli_clear_errors_for_paths(tmp_path, capsys):
    """A folder or a missing file as input, or an output in a missing folder: exit status 2
    and one line naming the argument and the path, no traceback."""
    src = tmp_path / "in.safetensors"
    _torch_style_checkpoint(src)
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jax-fp4: error: FILE:") and "directory" in err
    assert "in.safetensors" in err and "Traceback" not in err
    assert main(["inspect", str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors: no such file" in capsys.readouterr().err
    dst = tmp_path / "missing" / "out.safetensors"
    assert main(["quantize", str(src), str(dst), "--format", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "OUT:" in err and str(tmp_path / "missing") in err and "does not exist" in err
    assert not (tmp_path / "missing").exists()
    assert main(["quantize", str(tmp_path), str(tmp_path / "o.safetensors"), "--format",
                 "nf4"]) == 2
    assert "IN:" in capsys.readouterr().err


def test_cli_block_size_one_error(tmp_path, capsys):
    """A block size the format forbids, or one that fits no selected tensor: one error up
    front (exit status 2), no per-tensor warnings, nothing written."""
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    _torch_style_checkpoint(src)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # any warning fails the test
        assert main(["quantize", str(src), str(dst), "--format", "nvfp4",
                     "--block-size", "7"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--block-size" in err and "16" in err and "7" in err
        assert main(["quantize", str(src), str(dst), "--format", "int4",
                     "--block-size", "7"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--block-size" in err
        assert "layers.0.mlp.up_proj.weight (K=64 not a multiple of 7)" in err
    assert not dst.exists()
    # a block size that fits some tensors: quantized, the rest named in one note
    assert main(["quantize", str(src), str(dst), "--format", "int4", "--block-size", "128"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note" in err and "K=64 not a multiple of 128" in err
    assert isinstance(jio.load(dst)["layers.0.mlp.down_proj.weight"], jf.QArray)


def test_demo_refuses_quantized_checkpoint(tmp_path, capsys):
    """`demo --model` on a `jax-fp4 quantize`d checkpoint: a clear error instead of a
    "float32" row that is not float32."""
    d = _have_model()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(d / f, tmp_path / f)
    assert main(["quantize", str(d / "model.safetensors"), str(tmp_path / "model.safetensors"),
                 "--format", "nf4"]) == 0
    capsys.readouterr()
    assert main(["demo", "--model", str(tmp_path), "--limit", "4", "--formats", "int4",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "quantized to nf4" in err and "float checkpoint" in err and str(tmp_path) in err


def test_finetune_parser_defaults():
    from jax_fp4.cli import build_parser

    a = build_parser().parse_args(["finetune"])
    assert a.formats == ["nvfp4", "nf4"] and a.rank == 8 and a.steps == 200
    a = build_parser().parse_args(["finetune", "--formats", "nf4", "--rank", "4", "--json"])
    assert a.formats == ["nf4"] and a.rank == 4 and a.json
