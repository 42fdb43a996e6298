"""Triton kernels (only ``@triton.jit`` code lives here; launchers and references live apart)."""
