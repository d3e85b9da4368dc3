"""Training recipes built on :mod:`jax_fp4.nn` (QLoRA distillation: :mod:`.finetune`)."""
