"""A CPU model of the tensor-core first pass (kernels/attend_mma.h), lane by lane.

There is no GPU here, so this checks the kernel's indexing the only way it can:
``emulate_block`` follows ``muser_attend::attend_partials`` statement by
statement -- the block decomposition, the shared-memory byte layout (filled
with NaN garbage first), the cp.async copies and their zero fill, the ldmatrix
row addresses each lane computes, the mma.sync fragments, the quad shuffles,
the online softmax and the warps' combine -- with the fragment layouts of
ldmatrix and mma.m16n8k16 implemented from the PTX ISA's definitions, apart
from the kernel. Its partials must match the contract computed directly
(float64) and, combined, ``attention.reference``; the rows a sequence does not
hold must never be read, and a sequence's partials must be the same bits
whatever its slot, its ring's rotation, its strides or the batch around it.
"""

from __future__ import annotations

import zlib
from typing import List

import mlx.core as mx
import numpy as np
import pytest

from muser_kv.core import attention, attention_cuda
from muser_kv.core.attention import DecodeRead, KeyRead

WARPS, THREADS, ROWS, TK = 4, 128, 16, 16
STAGES = attention_cuda.STAGES  # the kernel's muser_attend::STAGES (the NVRTC test pins it)
NEG_INF = np.float32(-np.inf)
LANE = np.arange(32)
LG, LT = LANE // 4, LANE % 4     # g = lane / 4, t = lane % 4
SEL, R8 = LANE // 8, LANE % 8
NAN_BITS = {"bf16": 0x7FC0, "f16": 0x7E00}


# -- the element types ------------------------------------------------------------

def to_bits(x, kind: str) -> np.ndarray:
    """float32 -> P's bits, round to nearest even (finite values)."""
    x = np.asarray(x, np.float32)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits, kind: str) -> np.ndarray:
    bits = np.asarray(bits, np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_p(x, kind):
    return from_bits(to_bits(x, kind), kind)


# -- the PTX fragment layouts (ISA: ldmatrix; mma.m16n8k16 .f16/.bf16) ---------------

def ldsm_x4(h16: np.ndarray, addr: np.ndarray, kind: str, trans: bool = False) -> np.ndarray:
    """``addr[32]``: each lane's row address, in halves. Returns [4, 32, 2] floats:
    register j of lane (g, t) is matrix j's (row g, cols 2t, 2t+1), or with
    .trans (rows 2t, 2t+1, col g); matrix j's row r is at addr[8j + r]."""
    out = np.empty((4, 32, 2), np.float32)
    for j in range(4):
        rows = addr[8 * j: 8 * j + 8]
        for e in range(2):
            if trans:
                out[j, :, e] = from_bits(h16[rows[2 * LT + e] + LG], kind)
            else:
                out[j, :, e] = from_bits(h16[rows[LG] + 2 * LT + e], kind)
    return out


def mma(c: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """D = A B + C, m16n8k16 row.col, f32 accumulate; per-lane fragments:
    a [4, 32, 2], b0/b1 [32, 2], c [32, 4]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for e in range(2):
        A[LG, 2 * LT + e] = a[0, :, e]
        A[LG + 8, 2 * LT + e] = a[1, :, e]
        A[LG, 2 * LT + 8 + e] = a[2, :, e]
        A[LG + 8, 2 * LT + 8 + e] = a[3, :, e]
        B[2 * LT + e, LG] = b0[:, e]
        B[2 * LT + 8 + e, LG] = b1[:, e]
        C[LG, 2 * LT + e] = c[:, e]
        C[LG + 8, 2 * LT + e] = c[:, 2 + e]
    D = (A @ B + C).astype(np.float32)
    out = np.empty((32, 4), np.float32)
    for e in range(2):
        out[:, e] = D[LG, 2 * LT + e]
        out[:, 2 + e] = D[LG + 8, 2 * LT + e]
    return out


def shfl_xor(x: np.ndarray, mask: int) -> np.ndarray:
    return x[LANE ^ mask]


# -- memory -----------------------------------------------------------------------

class Global:
    """A flat device buffer of 16-bit elements that records what is read."""

    def __init__(self, bits: np.ndarray):
        self.bits = bits
        self.read = np.zeros(bits.shape, bool)

    def __getitem__(self, index):
        self.read[index] = True
        return self.bits[index]


def smem_bytes(hd):
    return attention_cuda.shared_bytes(hd)


# -- the kernel, statement by statement ------------------------------------------------

def emulate_block(block: int, HD: int, kind: str, q_kind: str, q: Global, qs, k: Global, ks,
                  v: Global, vs, scale: float, params: List[int], partials: np.ndarray) -> None:
    PITCH, VPR, OUTW, OPITCH = HD + 8, HD // 8, HD + 2, HD + 8
    q_bytes = ROWS * PITCH * 2
    warp_bytes = STAGES * 2 * TK * PITCH * 2
    smem = np.full(smem_bytes(HD), 0xFF, np.uint8)  # garbage: NaN in both types
    h16, f32 = smem.view(np.uint16), smem.view(np.float32)
    rings = q_bytes  # byte offset
    comb = (rings + WARPS * warp_bytes) // 4  # float index

    B, Hkv, G, n = params[:4]
    CHUNK, max_chunks, window = params[5:8]
    nG = n * G
    MT = (nG + ROWS - 1) // ROWS
    blk = block
    mt = blk % MT
    blk //= MT
    c = blk % max_chunks
    blk //= max_chunks
    h = blk % Hkv
    b = blk // Hkv
    if b >= B:
        return
    seq0 = len(params) - 5 * B + 5 * b  # a header of 8 or 9 ints
    slot, end, held, origin, wrap = params[seq0: seq0 + 5]
    start = end - held
    lo = max(start, end - n - window + 1) if window > 0 else start
    rows_out = min(ROWS, nG - ROWS * mt)
    out0 = ((b * Hkv + h) * max_chunks + c) * nG + ROWS * mt  # row index into partials

    if CHUNK <= 0 or CHUNK % (WARPS * TK):
        partials[out0: out0 + rows_out] = np.nan
        return
    first = lo // CHUNK
    count = 0 if lo >= end else (end - 1) // CHUNK - first + 1
    if c >= count:
        for e in range(rows_out * OUTW):
            partials[out0 + e // OUTW, e % OUTW] = NEG_INF if e % OUTW == HD else 0.0
        return

    for e in range(ROWS * HD):
        r, d = divmod(e, HD)
        R = ROWS * mt + r
        val = 0
        if R < nG:
            i, hg = R // G, h * G + R % G
            val = q[b * qs[0] + hg * qs[1] + i * qs[2] + d * qs[3]]
            if q_kind != kind:  # query_bits: one round to P through f32
                val = to_bits(val if q_kind == "f32" else from_bits(val, q_kind), kind)
        h16[r * PITCH + d] = val

    tiles = CHUNK // (WARPS * TK)
    kbase = slot * ks[0] + h * ks[1]
    vbase = slot * vs[0] + h * vs[1]
    scale = np.float32(scale)

    for warp in range(WARPS):
        warp_pos = (first + c) * CHUNK + warp * tiles * TK
        ring = rings + warp * warp_bytes  # bytes
        rlo = np.empty((2, 32), np.int64)
        rhi = np.empty((2, 32), np.int64)
        for kk in range(2):
            R = ROWS * mt + LG + 8 * kk
            qpos = end - n + R // G
            lo_r = np.maximum(start, qpos - window + 1) if window > 0 else np.full(32, start)
            rlo[kk] = np.where(R < nG, lo_r, 1)
            rhi[kk] = np.where(R < nG, qpos, 0)

        def tile_live(tile, warp_pos=warp_pos):
            p0 = warp_pos + tile * TK
            return p0 + TK > lo and p0 < end

        def issue(tile, warp_pos=warp_pos, ring=ring):
            if not tile_live(tile):
                return
            p0 = warp_pos + tile * TK
            k_s = (ring + (tile % STAGES) * 2 * TK * PITCH * 2) // 2  # halves
            v_s = k_s + TK * PITCH
            for e in range(TK * VPR):  # every lane's share, in any order
                key, col = e // VPR, (e % VPR) * 8
                p = p0 + key
                kd, vd = k_s + key * PITCH + col, v_s + key * PITCH + col
                if lo <= p < end:
                    row = (origin + (p - start)) % wrap
                    ko, vo = kbase + row * ks[2], vbase + row * vs[2]
                    for j in range(8):
                        h16[kd + j] = k[ko + (col + j) * ks[3]]
                        h16[vd + j] = v[vo + (col + j) * vs[3]]
                else:
                    h16[kd: kd + 8] = 0
                    h16[vd: vd + 8] = 0

        o = np.zeros((HD // 8, 32, 4), np.float32)
        m = np.full((2, 32), NEG_INF, np.float32)
        lsum = np.zeros((2, 32), np.float32)
        q_lane = (R8 + 8 * (SEL & 1)) * PITCH + 8 * (SEL >> 1)
        k_off = (R8 + 8 * (SEL >> 1)) * PITCH + 8 * (SEL & 1)
        v_off = (R8 + 8 * (SEL & 1)) * PITCH + 8 * (SEL >> 1)

        for st in range(STAGES):
            if st < tiles:
                issue(st)
        for tile in range(tiles):
            if tile_live(tile):
                p0 = warp_pos + tile * TK
                k_s = (ring + (tile % STAGES) * 2 * TK * PITCH * 2) // 2
                k_lane, v_lane = k_s + k_off, k_s + TK * PITCH + v_off
                s = np.zeros((2, 32, 4), np.float32)
                for kstep in range(HD // 16):
                    a = ldsm_x4(h16, q_lane + kstep * 16, kind)
                    kb = ldsm_x4(h16, k_lane + kstep * 16, kind)
                    s[0] = mma(s[0], a, kb[0], kb[1])
                    s[1] = mma(s[1], a, kb[2], kb[3])
                for nt in range(2):
                    for j in range(4):
                        p = p0 + 8 * nt + 2 * LT + (j & 1)
                        kk = j >> 1
                        seen = (p >= rlo[kk]) & (p <= rhi[kk])
                        with np.errstate(invalid="ignore"):
                            s[nt, :, j] = np.where(seen, s[nt, :, j] * scale, NEG_INF)
                for kk in range(2):
                    top = np.maximum(np.maximum(s[0, :, 2 * kk], s[0, :, 2 * kk + 1]),
                                     np.maximum(s[1, :, 2 * kk], s[1, :, 2 * kk + 1]))
                    top = np.maximum(top, shfl_xor(top, 1))
                    top = np.maximum(top, shfl_xor(top, 2))
                    m_new = np.maximum(m[kk], top)
                    m_use = np.where(m_new == NEG_INF, np.float32(0), m_new)
                    alpha = np.exp(m[kk] - m_use).astype(np.float32)
                    m[kk] = m_new
                    for nt in range(2):
                        for e in range(2):
                            s[nt, :, 2 * kk + e] = np.exp(s[nt, :, 2 * kk + e] - m_use)
                    lsum[kk] *= alpha
                    o[:, :, 2 * kk] *= alpha
                    o[:, :, 2 * kk + 1] *= alpha
                s = round_p(s, kind)  # pack: the A operand and what l sums
                pa = np.stack([s[0, :, 0:2], s[0, :, 2:4], s[1, :, 0:2], s[1, :, 2:4]])
                lsum[0] += (s[0, :, 0] + s[0, :, 1]) + (s[1, :, 0] + s[1, :, 1])
                lsum[1] += (s[0, :, 2] + s[0, :, 3]) + (s[1, :, 2] + s[1, :, 3])
                for jj in range(HD // 16):
                    vb = ldsm_x4(h16, v_lane + jj * 16, kind, trans=True)
                    o[2 * jj] = mma(o[2 * jj], pa, vb[0], vb[1])
                    o[2 * jj + 1] = mma(o[2 * jj + 1], pa, vb[2], vb[3])
            if tile + STAGES < tiles:
                issue(tile + STAGES)

        for kk in range(2):
            lsum[kk] = lsum[kk] + shfl_xor(lsum[kk], 1)
            lsum[kk] = lsum[kk] + shfl_xor(lsum[kk], 2)
        ms, ls = ring // 4, ring // 4 + ROWS
        os_ = ls + ROWS
        quad0 = LT == 0
        f32[ms + LG[quad0]] = m[0][quad0]
        f32[ms + LG[quad0] + 8] = m[1][quad0]
        f32[ls + LG[quad0]] = lsum[0][quad0]
        f32[ls + LG[quad0] + 8] = lsum[1][quad0]
        for j in range(HD // 8):
            for e in range(2):
                f32[os_ + LG * OPITCH + 8 * j + 2 * LT + e] = o[j, :, e]
                f32[os_ + (LG + 8) * OPITCH + 8 * j + 2 * LT + e] = o[j, :, 2 + e]

    for r in range(ROWS):
        mw = [f32[(rings + w * warp_bytes) // 4 + r] for w in range(WARPS)]
        top = NEG_INF
        for w in range(WARPS):
            top = max(top, mw[w])
        f32[comb + r * 8] = top
        for w in range(WARPS):
            f32[comb + r * 8 + 1 + w] = 0.0 if mw[w] == NEG_INF else np.exp(np.float32(mw[w] - top))

    for e in range(rows_out * OUTW):
        r, col = divmod(e, OUTW)
        if col == HD:
            acc = f32[comb + r * 8]
        else:
            at = 2 * ROWS + r * OPITCH + col if col < HD else ROWS + r
            acc = np.float32(0)
            for w in range(WARPS):
                acc = np.float32(acc + f32[comb + r * 8 + 1 + w] * f32[(rings + w * warp_bytes) // 4 + at])
        partials[out0 + r, col] = acc


def emulate(HD, kind, q_kind, q, qs, k, ks, v, vs, scale, params, shape_q, max_chunks):
    B, hq, n, _ = shape_q
    hkv, G = params[1], params[2]
    (grid, threadgroup, blocks) = attention_cuda.launch_geometry(B, hkv, max_chunks, n * G)
    assert threadgroup == (THREADS, 1, 1) and grid[0] == THREADS * blocks
    partials = np.full((B * hkv * max_chunks * n * G, HD + 2), np.nan, np.float32)
    for block in range(blocks):
        emulate_block(block, HD, kind, q_kind, q, qs, k, ks, v, vs, scale, params, partials)
    return partials.reshape(B, hkv, max_chunks, n * G, HD + 2)


# -- the contract, directly ------------------------------------------------------------

def contract_partials(qf, kf, vf, seqs: List[KeyRead], n, G, window, scale, chunk, max_chunks):
    """float64 partials from the contract: qf [B, Hq, n, D], kf/vf [S, Hkv, R, D]."""
    B, hq, _, D = qf.shape
    hkv = kf.shape[1]
    out = np.zeros((B, hkv, max_chunks, n * G, D + 2))
    out[..., D] = -np.inf
    for b, s in enumerate(seqs):
        start = s.end - s.held
        lo = max(start, s.end - n - window + 1) if window else start
        if lo >= s.end:
            continue
        first = lo // chunk
        count = (s.end - 1) // chunk - first + 1
        for h in range(hkv):
            for c in range(count):
                pos = np.arange((first + c) * chunk, (first + c + 1) * chunk)
                for r in range(n * G):
                    i, g = divmod(r, G)
                    qpos = s.end - n + i
                    rlo = max(start, qpos - window + 1) if window else start
                    seen = pos[(pos >= rlo) & (pos <= qpos)]
                    if seen.size == 0:
                        continue
                    rows = (s.origin + seen - start) % s.wrap
                    kk = kf[s.slot, h, rows].astype(np.float64)
                    vv = vf[s.slot, h, rows].astype(np.float64)
                    sc = scale * (kk @ qf[b, h * G + g, i].astype(np.float64))
                    mm = sc.max()
                    e = np.exp(sc - mm)
                    out[b, h, c, r, :D] = e @ vv
                    out[b, h, c, r, D] = mm
                    out[b, h, c, r, D + 1] = e.sum()
    return out


# -- cases ---------------------------------------------------------------------------

def make_case(rng, kind, B, n, G, hkv, D, window, k_layout="token", pad=8, lengths=None,
              q_kind=None):
    """Random queries and K/V in flat buffers behind strided views; rows a
    sequence does not hold are NaN. Returns a dict of everything."""
    seqs = []
    slots = rng.permutation(B + 1)[:B]  # one slot stays unused
    R = 0
    for b in range(B):
        wrap = int(rng.integers(40, 700)) if lengths is None else lengths[b][0]
        held = int(rng.integers(1, wrap + 1)) if lengths is None else lengths[b][1]
        end = held + int(rng.integers(0, 900)) if lengths is None else lengths[b][2]
        origin = int(rng.integers(0, wrap))
        seqs.append(KeyRead(int(slots[b]), end, held, origin, wrap))
        R = max(R, wrap)
    R += 3
    S = B + 1
    nan = NAN_BITS[kind]

    def kv_buffer(layout):
        if layout == "token":  # [S, R, H, D + pad] viewed as [S, H, R, D]
            full = (S, R, hkv, D + pad)
            strides = ((R * hkv * (D + pad)), D + pad, hkv * (D + pad), 1)
        else:  # head-major with row padding
            full = (S, hkv, R, D + pad)
            strides = (hkv * R * (D + pad), R * (D + pad), D + pad, 1)
        offset = 8 if pad % 8 == 0 else 3
        bits = np.full(offset + int(np.prod(full)), nan, np.uint16)
        vals = np.full((S, hkv, R, D), np.nan, np.float32)
        for s in seqs:
            rows = (s.origin + np.arange(s.held)) % s.wrap
            x = round_p(rng.standard_normal((hkv, s.held, D)).astype(np.float32) * 2, kind)
            vals[s.slot][:, rows] = x
        # write the held rows through the strides
        for s in seqs:
            rows = (s.origin + np.arange(s.held)) % s.wrap
            for h in range(hkv):
                for row in rows:
                    at = offset + s.slot * strides[0] + h * strides[1] + row * strides[2]
                    bits[at: at + D] = to_bits(vals[s.slot, h, row], kind)
        return Global(bits), tuple(strides), vals, offset

    kbits, ks, kf, koff = kv_buffer(k_layout)
    vbits, vs, vf, voff = kv_buffer("head" if k_layout == "token" else "token")
    hq = hkv * G
    q_kind = q_kind or kind
    qf = rng.standard_normal((B, hq, n, D)).astype(np.float32)
    if q_kind != "f32":
        qf = round_p(qf, q_kind)
    # queries as mlx-lm hands them: [B, n, Hq, D] transposed (strided for n > 1)
    qbits = qf.transpose(0, 2, 1, 3).copy().reshape(-1)
    if q_kind != "f32":
        qbits = to_bits(qbits, q_kind)
    qs = (n * hq * D, D, hq * D, 1)
    return dict(seqs=seqs, k=kbits, ks=ks, kf=kf, koff=koff, v=vbits, vs=vs, vf=vf, voff=voff,
                q=Global(qbits), qs=qs, qf=qf, window=window, n=n, G=G, D=D, B=B, hkv=hkv,
                q_kind=q_kind)


def chunks(s: KeyRead, n: int, window: int, chunk: int):
    """(first, count) for any chunk size: KeyRead.chunks' rule."""
    start = s.end - s.held
    lo = max(start, s.end - n - window + 1) if window else start
    if lo >= s.end:
        return lo // chunk, 0
    return lo // chunk, (s.end - 1) // chunk - lo // chunk + 1


def run_case(case, kind, chunk, scale=0.3, header=9):
    seqs, n, G, D, window = case["seqs"], case["n"], case["G"], case["D"], case["window"]
    max_chunks = max([chunks(s, n, window, chunk)[1] for s in seqs] + [1])
    params = [case["B"], case["hkv"], G, n, D, chunk, max_chunks, window] + [0] * (header - 8)
    for s in seqs:
        params += [s.slot, s.end, s.held, s.origin, s.wrap]

    class Shifted:  # the views' element offsets (their base pointers)
        def __init__(self, g, off):
            self.g, self.off = g, off

        def __getitem__(self, i):
            return self.g[self.off + i]

    got = emulate(D, kind, case["q_kind"], case["q"], case["qs"], Shifted(case["k"], case["koff"]), case["ks"],
                  Shifted(case["v"], case["voff"]), case["vs"], scale, params,
                  case["qf"].shape, max_chunks)
    return got, params, max_chunks


def held_elements(case, which):
    """Element offsets (into the flat buffer) of every row some sequence holds."""
    g = case[which]
    st = case["ks" if which == "k" else "vs"]
    off = case["koff" if which == "k" else "voff"]
    ok = np.zeros(g.bits.shape, bool)
    for s in case["seqs"]:
        for row in (s.origin + np.arange(s.held)) % s.wrap:
            for h in range(case["hkv"]):
                at = off + s.slot * st[0] + h * st[1] + row * st[2]
                ok[at: at + case["D"]] = True
    return ok


def check_partials(got, want, D, kind):
    assert not np.isnan(got).any(), "an element of partials was never written"
    m_got, m_want = got[..., D], want[..., D]
    empty = m_want == -np.inf
    assert np.array_equal(m_got == -np.inf, empty)
    assert (got[empty][:, :D] == 0).all() and (got[empty][:, D + 1] == 0).all()
    live = ~empty
    np.testing.assert_allclose(m_got[live], m_want[live], rtol=1e-5, atol=1e-4)
    tol = 2e-2 if kind == "bf16" else 4e-3
    l_got, l_want = got[..., D + 1][live], want[..., D + 1][live]
    np.testing.assert_allclose(l_got, l_want, rtol=tol)
    o_got = got[..., :D][live] / l_got[:, None]
    o_want = want[..., :D][live] / l_want[:, None]
    np.testing.assert_allclose(o_got, o_want, atol=4 * tol, rtol=tol)


CASES = [
    # P, queries T, B, n, G, Hkv, D, window, chunk, k layout, pad, params header
    ("bf16", "bf16", 3, 1, 16, 2, 64, 0, 128, "token", 8, 9),
    ("f16", "f16", 2, 4, 5, 1, 64, 0, 64, "head", 8, 8),       # 20 rows: two M tiles, the 2nd partial
    ("bf16", "f32", 2, 4, 16, 1, 64, 100, 128, "token", 3, 9),  # misaligned rows: the element copy
    ("f16", "bf16", 2, 3, 6, 2, 32, 70, 64, "token", 8, 9),     # 18 rows; HD 32 (a template value)
]


@pytest.mark.parametrize("spec", CASES, ids=lambda s: "-".join(map(str, s)))
def test_partials_match_the_contract(spec):
    check_case(spec)


@pytest.mark.parametrize("stages", [3, 4])  # 1 would not hold the combine (a static_assert)
def test_other_ring_depths(stages, monkeypatch):
    """STAGES is a tuning knob: the pipeline's indexing holds for other depths
    (CHUNK 256: four tiles a warp)."""
    monkeypatch.setattr(attention_cuda, "STAGES", stages)  # shared_bytes
    monkeypatch.setitem(globals(), "STAGES", stages)          # the model
    check_case(("bf16", "bf16", 2, 2, 8, 1, 32, 0, 256, "token", 8, 9))


def check_case(spec):
    kind, q_kind, B, n, G, hkv, D, window, chunk, layout, pad, header = spec
    rng = np.random.default_rng(zlib.crc32(repr(spec).encode()))
    case = make_case(rng, kind, B, n, G, hkv, D, window, layout, pad, q_kind=q_kind)
    got, params, max_chunks = run_case(case, kind, chunk, header=header)
    # the mma takes queries in P: the contract of queries rounded to P (by design)
    want = contract_partials(round_p(case["qf"], kind), case["kf"], case["vf"], case["seqs"], n, G,
                             window, 0.3, chunk, max_chunks)
    check_partials(got, want, D, kind)
    for which in ("k", "v"):
        stray = case[which].read & ~held_elements(case, which)
        assert not stray.any(), f"{which}: read {int(stray.sum())} elements of rows not held"


def test_same_bits_whatever_slot_rotation_and_batch():
    """One sequence alone, then with others in another slot, rotated, other strides."""
    kind, n, G, D, window, chunk = "bf16", 2, 8, 32, 0, 128
    rng = np.random.default_rng(7)
    lengths = [(300, 290, 700)]
    a = make_case(rng, kind, 1, n, G, 1, D, window, "token", 8, lengths=lengths)
    got_a, _, _ = run_case(a, kind, chunk)
    rng = np.random.default_rng(8)
    b = make_case(rng, kind, 3, n, G, 1, D, window, "head", 8,
                  lengths=[(100, 50, 60), (320, 290, 700), (64, 64, 64)])
    # give sequence 1 of b the same keys, values and queries as a's only one
    s_a, s_b = a["seqs"][0], b["seqs"][1]
    for src, dst, st_name, off_name in (("kf", "k", "ks", "koff"), ("vf", "v", "vs", "voff")):
        st, off = b[st_name], b[off_name]
        for p in range(s_a.end - s_a.held, s_a.end):
            ra = (s_a.origin + p - (s_a.end - s_a.held)) % s_a.wrap
            rb = (s_b.origin + p - (s_b.end - s_b.held)) % s_b.wrap
            at = off + s_b.slot * st[0] + rb * st[2]
            b[dst].bits[at: at + D] = to_bits(a[src][s_a.slot, 0, ra], kind)
    qa = a["qf"][0]
    qb = b["qf"].copy()
    qb[1] = qa
    b["qf"] = qb
    b["q"] = Global(to_bits(qb.transpose(0, 2, 1, 3).copy(), kind).reshape(-1))
    got_b, _, mc_b = run_case(b, kind, chunk)
    chunks_a = got_a.shape[2]
    assert np.array_equal(got_b[1, :, :chunks_a].view(np.uint32), got_a[0].view(np.uint32))
    assert (got_b[1, :, chunks_a:, :, D] == -np.inf).all()


@pytest.mark.parametrize("kind, n, window", [("bf16", 1, 0), ("f16", 4, 300)])
def test_combined_matches_reference(kind, n, window):
    """CHUNK = 256 as the kernel runs: the partials, combined, against
    attention.reference."""
    G, hkv, D = 4, 2, 64
    rng = np.random.default_rng(3 + n)
    case = make_case(rng, kind, 2, n, G, hkv, D, window, "token", 8,
                     lengths=[(700, 650, 1000), (300, 120, 130)])
    got, _, max_chunks = run_case(case, kind, attention.CHUNK, scale=0.125)
    dtype = mx.bfloat16 if kind == "bf16" else mx.float16
    out = attention_cuda.combine_partials(mx.array(got), n, G, mx.float32)
    read = DecodeRead(mx.array(case["kf"]).astype(dtype), mx.array(case["vf"]).astype(dtype),
                      tuple(case["seqs"]), window or None)
    want = attention.reference(mx.array(case["qf"]).astype(dtype), read, 0.125).astype(mx.float32)
    np.testing.assert_allclose(np.array(out), np.array(want), atol=3e-2, rtol=3e-2)
