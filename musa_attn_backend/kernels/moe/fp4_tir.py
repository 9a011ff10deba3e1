"""TIR expressions shared by the FP4 (MXFP4) programs: an E2M1 nibble's value and a UE8M0 byte's power of two,
in float32 (the formats: :mod:`.reference`)."""

from ..._tilelang import tl_lang as T

ACC = "float32"


def e2m1(nib):
    """The float32 value of an E2M1 nibble (int32 in 0..15): bit 3 the sign, bits 2-1 the exponent (bias 1, 0:
    subnormal, 0.5 a step), bit 0 the mantissa."""
    code = nib & 7
    exp = T.shift_right(code, 1)
    man = T.Cast(ACC, code & 1)
    mag = T.if_then_else(exp == 0, man * 0.5, (1.0 + man * 0.5) * T.Cast(ACC, T.shift_left(1, T.max(exp, 1) - 1)))
    return T.if_then_else(nib >= 8, -mag, mag)


def pow2(s):
    """``2^(s - 127)`` for a UE8M0 byte ``s`` (uint8), as the float32 whose exponent field is ``s``: exact for 1 to
    254; 0 gives 0 (not 2^-127), 255 gives infinity (the format's NaN)."""
    return T.reinterpret(T.shift_left(T.Cast("uint32", s), T.uint32(23)), ACC)


def fp4_weight(Bq, Bs, n, j):
    """Element ``(n, j)`` of a weight tile in float32 from its packed bytes ``Bq [rows, cols / 2]`` (element ``2c``
    in byte ``c``'s low nibble) and its scales ``Bs [rows, cols / 32]``: UE8M0 bytes (uint8), or float32 values
    used as they are."""
    nib = T.shift_right(T.Cast("int32", Bq[n, j // 2]), (j % 2) * 4) & 15
    scale = Bs[n, j // 32]
    return e2m1(nib) * (pow2(scale) if str(Bs.dtype) == "uint8" else scale)
