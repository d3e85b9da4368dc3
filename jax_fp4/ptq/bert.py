"""Calibration of a Hugging Face BERT sentence encoder's checkpoint (``jax-fp4 quantize
--calibration-text``): runs jax_fp4.models.minilm on sentences and keys the statistics by
the checkpoint's weight names."""
from __future__ import annotations

from typing import Iterable, Optional

from .awq import ScaleGroup, bert_groups
from .calibration import collect_stats

__all__ = ["hf_bert_calibration"]


def _embed(model, batch):
    return model.embed(*batch)


def hf_bert_calibration(model_dir, text, method: str, act_order: bool = False,
                        tensor_names: Optional[Iterable[str]] = None, progress: bool = True):
    """GPTQ / AWQ calibration for the weights of a BERT checkpoint.

    Args:
      model_dir: Hugging Face directory with config.json, model.safetensors, tokenizer.json.
      text: a file with one sentence per line, or "default" (the calibration half of the
        packaged demo sentences, :func:`jax_fp4.models.demo.split_sentences`).
      method: "gptq", "awq" or "awq+gptq"; act_order: GPTQ option.
      tensor_names: the checkpoint's tensor names (to find a "bert." style prefix).
    Returns:
      ({HF weight name: LayerStats}, ptq_options) for :func:`jax_fp4.nn.quantize_params`.
    Raises:
      FileNotFoundError: missing model files or sentence file.
    """
    from ..models.demo import load_sentences, split_sentences
    from ..models.minilm import _hf_name_map, load_sentence_encoder

    enc = load_sentence_encoder(model_dir)
    sents = (split_sentences(load_sentences())[0] if text == "default"
             else load_sentences(text))
    stats = collect_stats(enc.model, enc.token_batches(sents, 32), _embed,
                          lambda b: b[1], progress=progress)
    names = set(tensor_names or ())
    first = "encoder.layer.0.attention.self.query.weight"
    prefix = next((n[:-len(first)] for n in names if n.endswith(first)), "")
    hf = _hf_name_map(enc.model.config)
    calib = {prefix + hf[k][0]: v for k, v in stats.items() if k in hf}
    groups = tuple(ScaleGroup(tuple(prefix + p for p in g.kernels),
                              tuple((prefix + p, a) for p, a in g.producers))
                   for g in bert_groups(enc.model.config.num_hidden_layers, "hf"))
    options = {}
    if "gptq" in method:
        options["act_order"] = act_order
    if "awq" in method:
        options["awq_groups"] = groups
    return calib, options
