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


def scan_counts(eqn: Any) -> tuple[int, int]:
    """A ``scan`` equation's (constants, carries) counts: ``num_consts``/``num_carry`` up to jax 0.10;
    from jax 0.11 its operands are grouped (consts, carry, xs) by the ``ft_in`` flat tree."""
    params = eqn.params
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carry))


def itemsize(aval: Any) -> int:
    """Bytes per element of an abstract value (a PRNG key: 8)."""
    import numpy as np

    try:
        return int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # PRNG key types
        return 8
