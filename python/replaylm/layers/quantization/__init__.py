"""FP8 weights: the quantization config read from a checkpoint or `--quantization` (`config`, no
torch: the flags' choices come from it), the weights' and activations' quantization (`fp8`), the
scales' shapes and tensor-parallel parts (`layout`), and the FP8 matmul (`fp8_linear`).

This package's `__init__` imports nothing, so that the front end reads `config` without torch.
"""
