"""The stochastic-rounding element encoders the CUDA kernel uses (csrc/sr_codecs.h, through
csrc/cuda/quant/stochastic.cuh) compiled for the host with the system C++ compiler (they are __host__ __device__) == the reference's
rule (jax_fp4.reference: encode(..., rand), _encode_int4, _codebook_stochastic), bit for bit.

Runs without a GPU, so CI checks the rounding arithmetic the GPU kernel uses; the kernel
itself (scale selection, indexing, loads) is checked on a GPU by tests/test_cuda_stochastic.py.
Per element: a random word (with 0, 2^31 and 2^32 - 1 mixed in), and the encoder's own
threshold word (the smallest that does not round up, found by bisection in the C++ driver)
and the word below it: the reference must round up at the one and not at the other.
"""
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp4 import reference as R
from jax_fp4.formats import E2M1, E2M3, E3M2, E4M3, E5M2, get_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U32 = jnp.uint32

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cuda/quant/stochastic.cuh"
using namespace jf4;
using namespace jf4::cuda;
static uint32_t enc(int mode, float x, float a, float b, uint32_t r) {
  switch (mode) {
    case 0: return nvfp4_encode_sr(x, a, r);
    case 1: return mx_encode_sr<kMXFP4>(x, (uint32_t)b, r);
    case 2: return mx_encode_sr<kMXFP6_E2M3>(x, (uint32_t)b, r);
    case 3: return mx_encode_sr<kMXFP6_E3M2>(x, (uint32_t)b, r);
    case 4: return mx_encode_sr<kMXFP8_E4M3>(x, (uint32_t)b, r);
    case 5: return mx_encode_sr<kMXFP8_E5M2>(x, (uint32_t)b, r);
    case 6: return codebook_encode_sr<kNF4>(x, a, r);
    case 7: return codebook_encode_sr<kBNB_FP4>(x, a, r);
    default: return int4_encode_sr(x, a, b, r);
  }
}
// argv: mode n in out. in: x, a, b (float32), rand (uint32), n each. out: code[n], thr[n].
int main(int argc, char** argv) {
  const int mode = atoi(argv[1]);
  const long n = atol(argv[2]);
  std::vector<float> x(n), a(n), b(n);
  std::vector<uint32_t> r(n), out(2 * n);
  FILE* f = fopen(argv[3], "rb");
  if (!f || fread(x.data(), 4, n, f) != (size_t)n || fread(a.data(), 4, n, f) != (size_t)n ||
      fread(b.data(), 4, n, f) != (size_t)n || fread(r.data(), 4, n, f) != (size_t)n) return 1;
  fclose(f);
  for (long i = 0; i < n; ++i) {
    out[i] = enc(mode, x[i], a[i], b[i], r[i]);
    const uint32_t down = enc(mode, x[i], a[i], b[i], 0xffffffffu);
    unsigned long long lo = 0, hi = 1ull << 32;
    while (lo < hi) {
      const unsigned long long mid = (lo + hi) / 2;
      const uint32_t m = mid > 0xffffffffull ? 0xffffffffu : (uint32_t)mid;
      if (enc(mode, x[i], a[i], b[i], m) != down) lo = mid + 1; else hi = mid;
    }
    out[n + i] = lo > 0xffffffffull ? 0xffffffffu : (uint32_t)lo;
  }
  f = fopen(argv[4], "wb");
  fwrite(out.data(), 4, 2 * n, f);
  fclose(f);
  return 0;
}
"""

N = 4000


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the host copy of the CUDA encoders")
    d = tmp_path_factory.mktemp("sr_host")
    src, exe = d / "driver.cc", d / "driver"
    src.write_text(DRIVER)
    # the CUDA build's arithmetic: IEEE float32, no FMA contraction (-fmad=false)
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT}/csrc", str(src),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    return d, exe


def _run(driver, mode, x, a, b, r):
    d, exe = driver
    inp, out = d / "in.bin", d / "out.bin"
    with open(inp, "wb") as f:
        for arr in (np.float32(x), np.float32(a), np.float32(b), np.uint32(r)):
            f.write(np.ascontiguousarray(arr).tobytes())
    subprocess.run([str(exe), str(mode), str(len(x)), str(inp), str(out)], check=True)
    o = np.fromfile(out, np.uint32)
    return o[: len(x)], o[len(x):]


def _xs(rng, n):
    """Random magnitudes from subnormal to large, ties of the element grids, zeros, -0.0."""
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-140, 20, n)).astype(np.float32)
    x[:100] = 0.0
    x[100:200] = -0.0
    grid = np.float32([0.25, 0.5, 0.75, 1.0, 1.25, 1.75, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    x[200:600] = rng.choice(grid, 400) * rng.choice(np.float32([-1, 1]), 400)
    x[600:700] = np.float32(1e-45) * rng.integers(1, 100, 100)
    return x


def _words(rng, n):
    r = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    r[::7], r[1::7], r[2::7] = 0, 0xFFFFFFFF, 0x80000000
    return r


def _bits(v):
    return jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), U32)


def _check(driver, rng, name, mode, x, a, b, ref):
    r = _words(rng, len(x))
    code, thr = _run(driver, mode, x, a, b, r)
    np.testing.assert_array_equal(code, np.asarray(ref(r)), err_msg=f"{name}: random words")
    below = np.maximum(thr.astype(np.int64) - 1, 0).astype(np.uint32)
    for w, what in ((below, "threshold - 1"), (thr, "threshold")):
        np.testing.assert_array_equal(_run(driver, mode, x, a, b, w)[0], np.asarray(ref(w)),
                                      err_msg=f"{name}: {what} words")
    assert (thr > 0).sum() > len(x) // 4, f"{name}: too few elements between grid points"


def test_nvfp4(driver, rng):
    s = np.array(R._decode_minifloat(jnp.asarray(rng.integers(1, 0x7F, N), U32), E4M3))
    mult = np.array(R._div(1.0, jnp.asarray(s)))  # 1/s; two-level: (1/ts)/s
    mult[::3] = np.asarray(R._div(R._div(1.0, jnp.float32(3.7e-5)), jnp.asarray(s[::3])))
    x = (rng.standard_normal(N) * s * rng.choice([0.1, 1, 3, 6], N)).astype(np.float32)
    x[:700] = _xs(rng, 700)

    def ref(r):
        p = _bits(R._mul_exact(jnp.asarray(x), jnp.asarray(mult)))
        return R.encode((p & 0x7FFFFFFF) | (_bits(x) & U32(0x80000000)), E2M1, rand=jnp.asarray(r))
    _check(driver, rng, "nvfp4", 0, x, mult, np.zeros(N), ref)


@pytest.mark.parametrize("mode,mf", [(1, E2M1), (2, E2M3), (3, E3M2), (4, E4M3), (5, E5M2)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_mx(driver, rng, mode, mf):
    x = _xs(rng, N)
    ex = np.floor(np.log2(np.maximum(np.abs(x), 1e-45))).astype(np.int64)
    near = np.clip(ex + 127 - mf.emax + rng.integers(-3, 2, N), 0, 254)
    code = np.where(rng.random(N) < 0.8, near, rng.integers(0, 255, N)).astype(np.float32)
    ref = lambda r: R.encode(_bits(x), mf, 127 - jnp.asarray(code.astype(np.int32)),
                             rand=jnp.asarray(r))
    _check(driver, rng, mf.name, mode, x, np.zeros(N), code, ref)


@pytest.mark.parametrize("mode,fmt", [(6, "nf4"), (7, "bnb_fp4")])
def test_codebook(driver, rng, mode, fmt):
    table = get_format(fmt).table
    x = _xs(rng, N)
    a = np.maximum(np.abs(x) * rng.choice([1, 1, 1.5, 3, 100], N), np.float32(1e-38))
    a[:50] = np.float32(1e-38)
    mult = np.asarray(R._div(1.0, jnp.asarray(a, jnp.float32)))
    ref = lambda r: R._codebook_stochastic(R._mul_exact(jnp.asarray(x), jnp.asarray(mult)),
                                           table, jnp.asarray(r))
    _check(driver, rng, fmt, mode, x, mult, np.zeros(N), ref)


def test_int4(driver, rng):
    s = (np.abs(rng.standard_normal(N)) * 2.0 ** rng.integers(-20, 5, N) + 1e-30).astype(np.float32)
    x = (rng.standard_normal(N) * s * 5).astype(np.float32)
    x[:700] = _xs(rng, 700)
    z = rng.integers(0, 16, N).astype(np.float32)
    ref = lambda r: R._encode_int4(_bits(x)[:, None], jnp.asarray(s), jnp.asarray(z.astype(np.uint8)),
                                   jnp.asarray(r)[:, None])[:, 0]
    _check(driver, rng, "int4", 8, x, s, z, ref)
