"""The jaxpr primitives fast mode and the kernel costs count as arithmetic."""

from __future__ import annotations

from typing import Any

# Elementwise primitives (output shape = operand shape; jax broadcasts scalars before). The
# transcendental ones are counted apart as well, as XLA's cost analysis does.
TRANSCENDENTAL = {
    "atan2",
    "cbrt",
    "cos",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "logistic",
    "pow",
    "rsqrt",
    "sin",
    "sqrt",
    "tan",
    "tanh",
}
ELEMENTWISE = TRANSCENDENTAL | {
    "abs",
    "add",
    "add_any",
    "and",
    "ceil",
    "clamp",
    "conj",
    "convert_element_type",
    "copy",
    "copy_p",
    "div",
    "eq",
    "floor",
    "ge",
    "gt",
    "imag",
    "integer_pow",
    "is_finite",
    "le",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "population_count",
    "real",
    "reduce_precision",
    "rem",
    "round",
    "select_n",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "square",
    "stop_gradient",
    "sub",
    "xor",
}


def itemsize(aval: Any) -> int:
    """Bytes per element of an abstract value (a PRNG key: 8)."""
    import numpy as np

    try:
        return int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # PRNG key types
        return 8
