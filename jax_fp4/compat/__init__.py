"""The public call signatures and semantics of the seed codebases (SEEDS_API.md) as
jittable JAX functions: LightX2V's quantize ops and scaled GEMMs (:mod:`.lightx2v`),
InfiniCore's AWQ dequantize (:mod:`.infinicore`), ``torch._scaled_mm`` with the NVFP4
recipe helpers (:mod:`.torch_scaled_mm`), bitsandbytes' 4-bit quantize / dequantize and
quant state (:mod:`.bitsandbytes`), vLLM's NVFP4 dequantize and QDQ (:mod:`.vllm`)."""
from . import bitsandbytes, infinicore, lightx2v, torch_scaled_mm, vllm

__all__ = ["bitsandbytes", "infinicore", "lightx2v", "torch_scaled_mm", "vllm"]
