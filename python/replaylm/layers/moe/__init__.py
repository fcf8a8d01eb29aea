"""Mixture-of-experts layers: routing (`routing`), the experts' computation (`experts`: torch on
the CPU, fused Triton kernels on the GPU) and the module a model holds (`layer`)."""
