"""The parameters of the sampler's noise hash (splitmix64 on (seed, step, vocab id)), shared by
its torch code (`sampler.py`) and its Triton kernel (`kernels/seeded_sample.py`)."""

# splitmix64 constants, as signed int64 (torch int64 arithmetic wraps around)
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64
UNIFORM_BITS = 23  # 23 bits keep (k + 0.5) / 2**23 exact in float32 and strictly inside (0, 1)
