"""`python -m zerohop.engine.kernels`: build (or find) the cached CPU kernels."""

from zerohop.engine.kernels import cache_dir, load

module = load()
simd = "AVX-512 VNNI" if module.wide() else "AVX2" if module.simd() else "portable C++"
print(f"zerohop CPU kernels ({simd}) ready in {cache_dir()}")
