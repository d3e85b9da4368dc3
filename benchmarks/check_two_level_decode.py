"""Design check (CPU, exact rational arithmetic) for a bit decode of two-level NVFP4 on bf16
arithmetic, before it is written as a kernel (benchmarks/log/NOTES.md round 26, "Left" item 2).

Two-level NVFP4 decodes as w = bf16(f32(v * S)) with S = f32(pts * s) (docs/spec.md section 3:
the two scales' product rounded to float32 first), v an E2M1 value, s the E4M3 block scale
and pts the float32 per-tensor scale. The wgmma kernel now decodes it through the
shared-memory table (a float32 multiply per element), because one bf16 multiply of the
placed E2M1 bits by one per-block bf16 factor cannot give both roundings: for v = 2^k the
reference rounds 2^k S once, for v = 1.5 2^k it rounds f32(1.5 S) -- two roundings.

The decode checked here, per pair of elements (bf16x2), with F = floor(log2 pts) + 9 folded
into the float32 accumulator as the one-level decode folds 2^9:
  A = bf16(S 2^-F), B = bf16(f32(1.5 S 2^-F)), T = bf16(1.5 A)      (per block)
  X = A 2^126, Y = (B - T) 2^126                                    (exact bf16: Sterbenz)
  P  = v 2^-126 (the bit path's placed E2M1 bits, as now)
  Pm = (v / 1.5) 2^-126 for v in {1.5, 3, 6} (the same placement of the code word with the
       mantissa bit cleared where it is set and the exponent is not 0), else +-0
  w 2^-F = HFMA2(Pm, Y, HMUL2(P, X))
For v = 2^k the HMUL2 is exact and the FMA adds +-0; for v = 1.5 2^k the HMUL2 rounds 1.5 A
(T) and the FMA adds back B - T exactly: one rounding of an exact B. Zero codes give +-0 (a
-0 may become +0 where B < T, invisible after the float32 accumulator, which starts at +0).

Run: python3 benchmarks/check_two_level_decode.py [TRIALS]   (default 1500: ~20 s). It
prints the number of decodes compared, mismatches (must be 0) and how many the HMUL2 alone
would get wrong (the reason for the correction).
"""
import math
import sys
from fractions import Fraction as Fr

import ml_dtypes
import numpy as np


def rne(x: Fr, bits: int = 8, emin: int = -126) -> Fr:
    """x rounded to `bits` significant bits, nearest-even, gradual underflow below 2^emin
    (bits = 8, emin = -126: bfloat16, without overflow)."""
    if x == 0:
        return Fr(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fr(2) ** e > a:
        e -= 1
    while Fr(2) ** (e + 1) <= a:
        e += 1
    q = Fr(2) ** (max(e, emin) - bits + 1)
    n = a / q
    fl = math.floor(n)
    if n - fl > Fr(1, 2) or (n - fl == Fr(1, 2) and fl % 2 == 1):
        fl += 1
    return (fl * q) if x > 0 else -(fl * q)


def main(trials: int) -> int:
    e2m1 = [Fr(0), Fr(1, 2), Fr(1), Fr(3, 2), Fr(2), Fr(3), Fr(4), Fr(6)]
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4m3 = codes[np.isfinite(codes) & (codes > 0)]  # every positive E4M3 scale
    rng = np.random.default_rng()
    n = bad = naive_bad = 0
    for trial in range(trials):
        if trial % 4 == 0:  # amax / 2688, as tensor_scale_from_amax gives it
            pts = np.float32(np.float32(rng.uniform(0.01, 20)) / np.float32(2688))
        else:
            pts = np.float32(2.0 ** rng.uniform(-30, 10))
        f = math.floor(math.log2(pts)) + 9
        for s in rng.choice(e4m3, 8):
            big_s = np.float32(pts * s)  # f32(pts * s)
            s_f = Fr(float(big_s)) * Fr(2) ** -f  # exact: a power-of-two scaling of a normal
            a = rne(s_f)
            b = rne(Fr(float(np.float32(np.float32(1.5) * np.float32(float(s_f))))))
            t_blk = rne(Fr(3, 2) * a)
            x, y = a * Fr(2) ** 126, (b - t_blk) * Fr(2) ** 126
            assert rne(x) == x and rne(y) == y, "X and Y must be bf16 values"
            for code in range(1, 8):
                for sign in (1, -1):
                    v = sign * e2m1[code]
                    ref = rne(Fr(float(np.float32(np.float32(float(v)) * big_s))))
                    p = v * Fr(2) ** -126
                    pm = (v / Fr(3, 2) if code in (3, 5, 7) else 0) * Fr(2) ** -126
                    t = rne(p * x)
                    w = rne(pm * y + t)
                    n += 1
                    bad += w * Fr(2) ** f != ref
                    naive_bad += t * Fr(2) ** f != ref
    print(f"{n} decodes, {bad} mismatches; the HMUL2 alone: {naive_bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1500))
