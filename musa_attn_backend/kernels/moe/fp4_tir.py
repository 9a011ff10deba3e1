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


SPAN = 32  # the values one UE8M0 weight scale covers: one FP8 MMA's K in the FP8-tensor-core programs
SPAN_WORDS = SPAN // 8

# twice the E2M1 magnitudes of codes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6), one per 4-bit field: code c's in bits 4c..4c+3
E2M1_TWICE = 0xC8643210


def packed_weights(packing: str) -> tuple[int, str]:
    """``(values per element of B, B's dtype)`` under an FP4 program's ``packing``: ``bytes``, the uint8 bytes (two
    values each, converted one value a thread by :func:`fp4_weight`); ``words``, the same memory as int32 words
    (eight values each, converted eight a thread by :func:`convert_words`)."""
    assert packing in ("bytes", "words"), packing
    return (2, "uint8") if packing == "bytes" else (8, "int32")


def fp4_from_word(word, i, scale, scale_dtype):
    """Value ``i`` (0..7) of a little-endian int32 ``word`` of packed E2M1 (bits ``4i .. 4i + 3``) under its
    ``scale`` (a UE8M0 byte, or a float32 value where ``scale_dtype`` is float32), in float32. The magnitude comes
    from the table constant :data:`E2M1_TWICE`: the value is ``table(code) * (scale / 2)``, both factors exact, so
    it equals :func:`fp4_weight`'s for every nibble and scale."""
    nib = T.shift_right(word, i * 4) & 15
    twice = T.shift_right(T.uint32(E2M1_TWICE), T.Cast("uint32", (nib & 7) * 4)) & T.uint32(15)
    half = (pow2(scale) if str(scale_dtype) == "uint8" else scale) * 0.5
    return T.Cast(ACC, twice) * T.if_then_else(nib >= 8, -half, half)


def convert_words(rows: int, cols: int, threads: int, out_dtype: str):
    """A macro ``convert(Bw, Bs, B_w)``: the weight tile ``B_w [rows, cols]`` (``out_dtype``) from its packed words
    ``Bw [rows, cols / 8]`` (int32, the bytes' little-endian order: value ``8q + i`` in bits ``4i .. 4i + 3`` of
    word ``q``) and scales ``Bs [rows, cols / 32]``. Each thread converts 8 neighbouring values at a time: one
    word, one scale, one vectorised store (per element, the byte form's ``j // 2`` index kept each value a
    scalar load, convert and 2-byte store)."""
    chunks = rows * cols // 8
    assert chunks % threads == 0 and cols % 32 == 0

    @T.macro
    def convert(Bw, Bs, B_w):
        tx = T.get_thread_binding()
        for it in T.serial(chunks // threads):
            u = it * threads + tx
            n = u // (cols // 8)
            c = u % (cols // 8)
            for v in T.vectorized(8):
                B_w[n, c * 8 + v] = T.Cast(out_dtype, fp4_from_word(Bw[n, c], v, Bs[n, c // 4], Bs.dtype))

    return convert


def bf16_operand_tiles(block_m: int, block_n: int, block_k: int, packing: str, scale_dtype: str):
    """The shared tiles of the FP4 programs that convert in shared memory (both layouts), allocated in the calling
    kernel, in :func:`bf16_operands`' names: ``(Bq_s, Bs_s, A_w, B_w, D_s)``: a K step's packed weights (as
    ``packing`` reads them, :func:`packed_weights`) and their ``scale_dtype`` scales, the bf16 GEMM operands, and
    the bf16 output tile."""
    per, packed = packed_weights(packing)
    return (T.alloc_shared((block_n, block_k // per), packed),
            T.alloc_shared((block_n, block_k // 32), scale_dtype),
            T.alloc_shared((block_m, block_k), "bfloat16"),
            T.alloc_shared((block_n, block_k), "bfloat16"),
            T.alloc_shared((block_m, block_n), "bfloat16"))


def bf16_operands(block_m: int, block_n: int, block_k: int, threads: int, packing: str):
    """A macro ``widen(A_s, Bq_s, Bs_s, A_w, B_w)``: a K step's bf16 GEMM operands of the FP4 programs that convert
    in shared memory (both layouts): ``A_w`` the FP8 tile ``A_s`` widened (exact), ``B_w [block_n, block_k]`` the
    weights from their packed tile ``Bq_s`` and scales ``Bs_s`` by words (:func:`convert_words`) or one value a
    thread (:func:`fp4_weight`), as ``packing`` says."""
    convert = convert_words(block_n, block_k, threads, "bfloat16")

    @T.macro
    def widen(A_s, Bq_s, Bs_s, A_w, B_w):
        for i, j in T.Parallel(block_m, block_k):
            A_w[i, j] = T.Cast("bfloat16", A_s[i, j])
        if packing == "words":
            convert(Bq_s, Bs_s, B_w)
        else:
            for n, j in T.Parallel(block_n, block_k):
                B_w[n, j] = T.Cast("bfloat16", fp4_weight(Bq_s, Bs_s, n, j))

    return widen


def e4m3_quads(word):
    """The e4m3 bytes of the eight E2M1 values of a little-endian int32 ``word`` of packed E2M1 (value ``i`` in bits
    ``4i .. 4i + 3``), as two uint32 words: values 0..3 in bytes 0..3 of the first, 4..7 of the second. Each byte
    is the e4m3 value ``E2M1 / 64``, made by bit moves alone: the nibble ``s eem`` becomes the byte ``s 000 0ee
    m00`` (e4m3's exponent bias is 7, E2M1's 1; the subnormals line up, ``0 001`` = 0.5 -> ``0 0000 100`` =
    2^-7). Each half of the word has its four nibbles spread one a byte (two shift-or-mask steps), then all four
    moved at once, so no byte is taken apart or put back together."""
    u32 = T.uint32
    w = T.Cast("uint32", word)

    def quad(x):  # four nibbles in bits 0..15 -> four e4m3 bytes
        x = (x | T.shift_left(x, u32(8))) & u32(0x00FF00FF)
        x = (x | T.shift_left(x, u32(4))) & u32(0x0F0F0F0F)
        return (T.shift_left(x, u32(4)) & u32(0x80808080)) | (T.shift_left(x, u32(2)) & u32(0x1C1C1C1C))

    return quad(w & u32(0xFFFF)), quad(T.shift_right(w, u32(16)))


def convert_words_e4m3(rows: int, words: int, threads: int):
    """A macro ``convert(Bw, B_s)``: the e4m3 tile ``B_s [rows, 8 * words]`` (``E2M1 / 64``, unscaled:
    :func:`e4m3_quads`) from its packed int32 words ``Bw [rows, words]``. Each thread converts one word at a time
    into a two-word register buffer and stores its eight bytes at once, through a uint8 view of ``B_s``: a view of
    the same element size keeps the tile's layout (its swizzle, chosen for the GEMM, counts bytes either way),
    and storing uint8 lanes keeps the store one 8-byte move."""
    assert rows * words % threads == 0

    @T.macro
    def convert(Bw, B_s):
        tx = T.get_thread_binding()
        quads = T.alloc_local((2,), "uint32")
        values = T.view(quads, (8,), "uint8")
        B_bytes = T.view(B_s, (rows, 8 * words), "uint8")
        for it in T.serial(rows * words // threads):
            u = it * threads + tx
            quads[0], quads[1] = e4m3_quads(Bw[u // words, u % words])
            for v in T.vectorized(8):
                B_bytes[u // words, (u % words) * 8 + v] = values[v]

    return convert


def staged_chunk(K: int, chunk: int, spans: int) -> tuple[int, int]:
    """``(KS, chunk)``: the 32-value columns of weight scales a row has (``K / 32``) and how many of them the FP8-MMA
    programs stage in shared memory at a time: the largest multiple of ``spans`` that divides ``KS``, at most
    ``chunk`` (and at least ``spans``)."""
    KS = K // SPAN
    return KS, max(c for c in range(spans, max(min(chunk, KS), spans) + 1, spans) if KS % c == 0)


def fp8_mma_buffers(block_m: int, block_n: int, spans: int, K: int, chunk: int, scale_dtype: str):
    """The tiles of the FP8-MMA FP4 programs, allocated in the calling kernel, in :func:`fp8_mma_step`'s names:
    ``(A_s, Bw_s, B_s, SA_s, SB_s, D_s, part, acc, sb, sa)``. Shared: a step's activations (``block_m`` x
    ``32 * spans`` e4m3), packed weight words and their e4m3 conversion, the activation rows' ``K / 128`` scales,
    ``chunk`` columns of weight scales (:func:`staged_chunk`) and the bf16 output tile; fragments: a GEMM's
    product and the accumulator (``block_n`` x ``block_m``) and one step's weight and activation scales."""
    return (T.alloc_shared((block_m, SPAN * spans), "float8_e4m3"),
            T.alloc_shared((block_n, SPAN_WORDS * spans), "int32"),
            T.alloc_shared((block_n, SPAN * spans), "float8_e4m3"),
            T.alloc_shared((block_m, K // 128), ACC),
            T.alloc_shared((block_n, chunk), scale_dtype),
            T.alloc_shared((block_m, block_n), "bfloat16"),
            T.alloc_fragment((block_n, block_m), ACC),
            T.alloc_fragment((block_n, block_m), ACC),
            T.alloc_fragment((block_n,), ACC),
            T.alloc_fragment((block_m,), ACC))


def fp8_mma_step(block_n: int, block_m: int, spans: int, threads: int, scale_dtype: str):
    """A macro ``step(Bw_s, B_s, A_s, SB_s, SA_s, kk, k, sb, sa, part, acc)``: one K step of ``spans`` x 32 values
    of the FP4 programs on FP8 tensor cores, after its copies: the packed words ``Bw_s [block_n, 4 * spans]``
    converted into ``B_s [block_n, 32 * spans]`` (:func:`convert_words_e4m3`), then per 32 values (one weight
    scale's span, ``s``) one FP8 GEMM of that slice of ``B_s`` and of the token tile ``A_s [block_m, 32 * spans]``
    into ``part [block_n, block_m]``, added to ``acc`` times the weight rows' scales (column ``kk * spans + s`` of
    the staged ``SB_s``: UE8M0 bytes or float32 values) and the token rows' (column ``(k + s) / 4`` of ``SA_s``;
    ``k`` counts spans of 32). More spans a step: fewer barriers and longer loads per row, more shared memory. With
    more than one span the GEMMs read slices of the tiles, which MUSA's GEMMs do not take (they read a whole
    tile at offset 0: ``platform.gemm_tile_slices``): one span there."""
    convert = convert_words_e4m3(block_n, spans * SPAN_WORDS, threads)

    @T.macro
    def span(SB_s, SA_s, kk, k, sb, sa, part, acc, s, B_span, A_span):
        """Span ``s``: its scales, the GEMM of the tiles' span ``B_span`` x ``A_span``, the rescale."""
        for i in T.Parallel(block_n):
            sb[i] = pow2(SB_s[i, kk * spans + s]) if scale_dtype == "uint8" else SB_s[i, kk * spans + s]
        for j in T.Parallel(block_m):
            sa[j] = SA_s[j, (k + s) // 4]
        T.gemm(B_span, A_span, part, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(block_n, block_m):
            acc[i, j] += part[i, j] * (sb[i] * sa[j])

    @T.macro
    def step(Bw_s, B_s, A_s, SB_s, SA_s, kk, k, sb, sa, part, acc):
        convert(Bw_s, B_s)
        if spans == 1:  # the whole tiles: what MUSA's GEMMs take (platform.gemm_tile_slices)
            span(SB_s, SA_s, kk, k, sb, sa, part, acc, 0, B_s, A_s)
        else:
            for s in T.unroll(spans):
                span(SB_s, SA_s, kk, k, sb, sa, part, acc, s, B_s[:, s * SPAN:(s + 1) * SPAN],
                     A_s[:, s * SPAN:(s + 1) * SPAN])

    return step
