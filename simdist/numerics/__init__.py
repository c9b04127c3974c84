"""Floating-point facts: formats, ulps, exact rounding, and bitwise/ulp comparison of tensors."""
