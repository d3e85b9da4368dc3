"""Memory of QLoRA training: a frozen 4-bit base plus LoRA adapters against a bf16 full
fine-tune of the same Llama-like decoder (docs/training.md, "QLoRA: memory").

Each variant runs in its own process (the device's peak counter cannot be reset): build the
model layer by layer (each dense layer quantized as it is made, so no float copy of the whole
base ever exists), run jitted optax steps on random inputs (MSE to a random target; the state
is donated, so it is updated in place), and report

* state between steps: bytes of every array the training loop keeps (model, adapters,
  optimizer state): the 4-bit codes and scales of the base, never a dequantized copy;
* the compiled step's memory_analysis(): argument, output and temporary buffer sizes
  (temporaries include the weights decoded inside the step);
* device peak: ``memory_stats()["peak_bytes_in_use"]`` where the backend reports it (GPU),
  else "-" (XLA:CPU has no allocator statistics: read the compiled sizes);
* the size of one bf16 copy of the base's dense weights, the memory a persistent
  dequantized copy would take.

Prints a Markdown table (one row per variant). On a GPU, the default model is 16 layers of
hidden size 2048 (about 1.1 B dense parameters); ``--tiny`` is a CPU smoke run.

    python3 benchmarks/qlora_memory.py                 # GPU
    python3 benchmarks/qlora_memory.py --tiny          # CPU, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

VARIANTS = ("qlora", "bf16_full")


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 2048
    inter: int = 8192
    layers: int = 16
    heads: int = 16
    batch: int = 4
    seq: int = 512
    rank: int = 16
    format: str = "nf4"
    steps: int = 5


TINY = Config(hidden=128, inter=256, layers=2, heads=4, batch=2, seq=16, rank=4, steps=3)


def build(cfg: Config, variant: str):
    """(model, optimizer, trained-variable filter) of one variant."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_fp4.nn import flax_train as ft
    from jax_fp4.nn.flax import QuantizedLinear

    rngs = nnx.Rngs(0)
    bf16 = jnp.bfloat16

    def dense(n_in, n_out):
        if variant == "qlora":  # quantized as it is made: one float layer at a time
            return QuantizedLinear(n_in, n_out, use_bias=False, dtype=bf16, format=cfg.format,
                                   rngs=rngs)
        return nnx.Linear(n_in, n_out, use_bias=False, dtype=bf16, param_dtype=bf16, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self):
            h, f = cfg.hidden, cfg.inter
            self.q, self.k, self.v, self.o = (dense(h, h) for _ in range(4))
            self.gate, self.up, self.down = dense(h, f), dense(h, f), dense(f, h)
            self.n1 = nnx.RMSNorm(h, dtype=bf16, param_dtype=bf16, rngs=rngs)
            self.n2 = nnx.RMSNorm(h, dtype=bf16, param_dtype=bf16, rngs=rngs)

        def __call__(self, x):
            import jax

            b, t, h = x.shape
            y = self.n1(x)
            heads = [p(y).reshape(b, t, cfg.heads, h // cfg.heads) for p in (self.q, self.k, self.v)]
            a = jax.nn.dot_product_attention(*heads, is_causal=True).reshape(b, t, h)
            x = x + self.o(a)
            y = self.n2(x)
            return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y))

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([Block() for _ in range(cfg.layers)])

        def __call__(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x

    model = Model()
    if variant == "qlora":
        model = ft.add_lora(model, rank=cfg.rank, alpha=2 * cfg.rank, rngs=rngs, inplace=True)
        wrt = nnx.LoRAParam
    else:
        wrt = nnx.Param
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=wrt)
    return model, opt, wrt


def _nbytes(tree) -> int:
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree)))


def measure(cfg: Config, variant: str) -> dict:
    """Run one variant in this process and return its numbers (bytes)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_fp4.nn.flax import QuantizedLinear

    model, opt, wrt = build(cfg, variant)
    dense_params = sum(m.in_features * m.out_features for _, m in nnx.iter_modules(model)
                       if isinstance(m, (QuantizedLinear, nnx.Linear)))
    base_bytes = sum(_nbytes(m.kernel.get_value()) for _, m in nnx.iter_modules(model)
                     if isinstance(m, (QuantizedLinear, nnx.Linear)))
    graphdef, state = nnx.split((model, opt))
    del model, opt

    def step(state, x, target):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(m):
            return jnp.mean((m(x).astype(jnp.float32) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    kx, kt = jax.random.split(jax.random.key(1))
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    x = jax.random.normal(kx, shape, jnp.bfloat16)
    target = jax.random.normal(kt, shape, jnp.float32)
    fn = jax.jit(step, donate_argnums=0)
    compiled = fn.lower(state, x, target).compile()
    ma = compiled.memory_analysis()
    state_bytes = _nbytes(state)
    losses = []
    for _ in range(cfg.steps):
        loss, state = compiled(state, x, target)
        losses.append(float(loss))
    jax.block_until_ready(state)
    stats = jax.devices()[0].memory_stats() or {}
    dev = jax.devices()[0]
    return dict(variant=variant, device=str(getattr(dev, "device_kind", dev.platform)),
                format=cfg.format if variant == "qlora" else "bf16",
                dense_params=int(dense_params), base_bytes=int(base_bytes),
                bf16_copy_bytes=int(dense_params * 2), state_bytes=state_bytes,
                trained_bytes=_nbytes(nnx.state(nnx.merge(graphdef, state)[0], wrt)),
                argument_bytes=int(getattr(ma, "argument_size_in_bytes", 0)),
                output_bytes=int(getattr(ma, "output_size_in_bytes", 0)),
                alias_bytes=int(getattr(ma, "alias_size_in_bytes", 0)),
                temp_bytes=int(getattr(ma, "temp_size_in_bytes", 0)),
                peak_bytes=stats.get("peak_bytes_in_use"), losses=losses)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def table(rows, cfg: Config) -> str:
    head = ("| device | variant | trained | state between steps | base weights | "
            "bf16 copy of base | step temporaries | step arguments | device peak |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        name = f"QLoRA ({r['format']} base, rank {cfg.rank})" if r["variant"] == "qlora" \
            else "bf16 full fine-tune"
        lines.append(f"| {r['device']} | {name} | {_mib(r['trained_bytes'])} | "
                     f"{_mib(r['state_bytes'])} | {_mib(r['base_bytes'])} | "
                     f"{_mib(r['bf16_copy_bytes'])} | {_mib(r['temp_bytes'])} | "
                     f"{_mib(r['argument_bytes'])} | {_mib(r['peak_bytes'])} |")
    note = (f"\n\n{cfg.layers} Llama-like blocks (hidden {cfg.hidden}, MLP {cfg.inter}, "
            f"{cfg.heads} heads), {rows[0]['dense_params'] / 1e6:.1f} M dense parameters, "
            f"batch {cfg.batch} x {cfg.seq} tokens, AdamW; bf16 activations.")
    return "\n".join(lines) + note


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--format", default=None, help="base format of the QLoRA variant (nf4)")
    for f in ("hidden", "inter", "layers", "heads", "batch", "seq", "rank", "steps"):
        ap.add_argument(f"--{f}", type=int, default=None)
    ap.add_argument("--variant", choices=VARIANTS, default=None,
                    help="run one variant in this process and print its JSON")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else Config()
    over = {k: v for k, v in vars(args).items()
            if k in Config.__dataclass_fields__ and v is not None}
    cfg = dataclasses.replace(cfg, **over)
    if args.variant:
        print(json.dumps(measure(cfg, args.variant)))
        return None
    base = [a for a in (argv if argv is not None else sys.argv[1:])
            if not a.startswith("--json")]
    if args.json:  # drop the --json value too
        base = [a for a in base if a != args.json]
    rows = []
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, *base, "--variant", v],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"variant {v} failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(table(rows, cfg))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
