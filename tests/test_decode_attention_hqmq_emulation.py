"""Lane-level emulation of the CUDA tensor-core path of kvq.decode_attention_hqmq
(hqmq_warp_mma in include/kvq/attention/decode_attention_hqmq.cuh) on the CPU: the K/V
A-fragment permutations, the lane-pair exchange of V halves, the movmatrix P^T operand, the
per-lane online softmax and the Med3x record paths, with the standard mma.m16n8k16 fragment
layouts and fp16 rounding of every mma operand.  One warp walks every full 32-token tile of
one (b, h).  The result must match the CPU op, so a layout slip in the kernel's design shows
up here in CI (the kernel itself only runs on the GPU machine).  Keep in sync with the kernel.

K/V tiles are packed rows (int16 [32, U], include/kvq/hqmq/hqmq.h).  The general path reads
each field straight from the packed row in shared memory (smem_packed_field: plain bits +
the digit of its group, FMT 0 with runtime widths, FMT 1 / 2 with the compile-time R = 9
layout and multiply-high divisions by 9^i) and the row's scale from the row
(smem_packed_scale); the v2 path first unpacks each tile, one token per lane, into rows of
16-bit fields and fp16 scales (hqmq_unpack16) and then runs the old v2 arithmetic.  The
shared-memory tiles are emulated as flat arrays of 16-bit units followed by random garbage,
so a read past a row or a tile that is not masked off shows up.
"""
import numpy as np
import pytest
import torch

import kvquant_ext as kvq
from reference import hqmq_reference as ref

f16 = lambda x: np.float32(np.float16(x))
def hamilton(a, b):
    a0,a1,a2,a3 = a; b0,b1,b2,b3 = b
    return [a0*b0-a1*b1-a2*b2-a3*b3, a0*b1+a1*b0+a2*b3-a3*b2, a0*b2-a1*b3+a2*b0+a3*b1, a0*b3+a1*b2-a2*b1+a3*b0]
def unit(p):
    if p < 8:
        q=[0.,0.,0.,0.]; q[p>>1] = -1. if p&1 else 1.; return q
    m=p-8; return [(-.5 if m>>k&1 else .5) for k in range(4)]
def asmA(regs):
    A=np.zeros((16,16),np.float32)
    for l in range(32):
        g,t=l>>2,l&3
        A[g,2*t:2*t+2]=regs[l][0]; A[g+8,2*t:2*t+2]=regs[l][1]; A[g,2*t+8:2*t+10]=regs[l][2]; A[g+8,2*t+8:2*t+10]=regs[l][3]
    return A
def asmB(b0,b1):
    B=np.zeros((16,8),np.float32)
    for l in range(32):
        g,t=l>>2,l&3
        B[2*t:2*t+2,g]=b0[l]; B[2*t+8:2*t+10,g]=b1[l]
    return B
def distC(C):
    return [[C[l>>2,2*(l&3)],C[l>>2,2*(l&3)+1],C[(l>>2)+8,2*(l&3)],C[(l>>2)+8,2*(l&3)+1]] for l in range(32)]
def hb(x): return float(np.array([x],np.uint16).view(np.float16)[0])


# ---------------------------------------------------------------- packed rows in shared memory
def row_layout(D, S, RB):
    """hqmq_row_layout (the kernel's RowLayout fields); checked against kvq.ops.hqmq_row_layout."""
    L = (24 * S - 1).bit_length() - 4
    C, E, R = D // 4, L + RB, -(-24 * S // (1 << L))
    K = 5 if R == 9 else 4
    G = C // K
    tail_bits = (R ** (C - G * K) - 1).bit_length()
    groups_at = C * E; tail_at = groups_at + 16 * G; scale_at = tail_at + tail_bits
    units = (scale_at + 8 + 15) // 16
    return dict(C=C, E=E, R=R, K=K, G=G, tail_bits=tail_bits, groups_at=groups_at, tail_at=tail_at,
                scale_at=scale_at, scale_bits=min(15, 16 * units - scale_at), units=units)


def umulhi(a, b): return ((a & 0xffffffff) * (b & 0xffffffff)) >> 32
def div_pow9(x, i):  # x / 9^i for x < 2^16 (the kernel's div_pow9)
    m = 477218589 if i == 1 else 53024288 if i == 2 else 5891588 if i == 3 else 654621
    return x if i == 0 else umulhi(x, m)


def hqmq_fmt(kl, vl, k_rb, v_rb, k_S, v_S):
    """The kernel's hqmq_fmt: 1 = F 16 / b_r 4, 2 = F 19 / b_r 6 for both roles (R = 9), else 0."""
    def is_(F, RB):
        return all((24 * S - 1).bit_length() + rb == F and rb == RB and l["R"] == 9
                   for l, rb, S in ((kl, k_rb, k_S), (vl, v_rb, v_S)))
    return 1 if is_(16, 4) else 2 if is_(19, 6) else 0


def smem_tile(rows, pad_units, rng):
    """A tile of packed rows [32, U] (int16) as shared memory: 32 U 16-bit units (uint32 ints),
    then `pad_units` of garbage (what lies past the tile in the ring)."""
    flat = (rows.astype(np.int64) & 0xffff).reshape(-1)
    return np.concatenate([flat, rng.integers(0, 1 << 16, pad_units)]).astype(np.int64)


def smem_packed_field(sm, row0, chunk, rl, fmt, D):
    """smem_packed_field<FMT, D>: chunk's field (dir << RB | rcode) of the packed row at unit
    `row0` of shared memory `sm` (reads may touch up to two units past the row)."""
    row = lambda u: int(sm[row0 + u])  # noqa: E731
    if fmt == 0:
        bit = chunk * rl["E"]; j = bit >> 4
        v = row(j) | row(j + 1) << 16 | row(j + 2) << 32
        plain = (v >> (bit & 15)) & ((1 << rl["E"]) - 1)
        gi = chunk // rl["K"]
        at = rl["groups_at"] + 16 * gi if gi < rl["G"] else rl["tail_at"]
        w = 16 if gi < rl["G"] else rl["tail_bits"]
        gv = ((row(at >> 4) | row((at >> 4) + 1) << 16) >> (at & 15)) & ((1 << w) - 1)
        digit = (gv // rl["R"] ** (chunk - gi * rl["K"])) % rl["R"]
        return (digit << rl["E"]) | plain
    L = row_layout(D, 192 if fmt == 2 else 96, 6 if fmt == 2 else 4)  # hqmq_fmt_row<FMT, D>
    bit = chunk * L["E"]; j = bit >> 4
    v = row(j) | row(j + 1) << 16
    plain = (v >> (bit & 15)) & ((1 << L["E"]) - 1)
    gi = chunk // 5
    at = L["groups_at"] + 16 * gi if gi < L["G"] else L["tail_at"]
    gv = ((row(at >> 4) | row((at >> 4) + 1) << 16) >> (at & 15)) & 0xffffffff
    q = div_pow9(gv & (0xffff if gi < L["G"] else (1 << L["tail_bits"]) - 1), chunk - 5 * gi)
    return (((q - 9 * umulhi(q, 477218589)) & 0xffffffff) << L["E"]) | plain


def smem_packed_scale(sm, row0, rl, fmt, D):
    """smem_packed_scale<FMT, D>: the fp16 bits of the row's radius scale (SB bits at scale_at)."""
    L = rl if fmt == 0 else row_layout(D, 192 if fmt == 2 else 96, 6 if fmt == 2 else 4)
    at, sb = L["scale_at"], L["scale_bits"]
    v = (int(sm[row0 + (at >> 4)]) | int(sm[row0 + (at >> 4) + 1]) << 16) >> (at & 15)
    return (v & ((1 << sb) - 1)) << (15 - sb)


def hqmq_unpack16(sm, D):
    """hqmq_unpack16<D>: lane t unpacks token t of the packed tile in `sm` (its row starts at unit
    t U; the lane loads NW 32-bit words from the row's word-aligned start) into W = D / 8 words of
    two 16-bit fields and the fp16 scale bits.  Returns (words [32, W] int64, scale bits [32])."""
    R = row_layout(D, 96, 4)
    U, W = R["units"], D // 8
    NW = (U + 1) // 2 + 1
    words = np.zeros((32, W), np.int64); scl = np.zeros(32, np.int64)
    for lane in range(32):
        u0 = lane * U
        w = [int(sm[2 * ((u0 >> 1) + j)]) | int(sm[2 * ((u0 >> 1) + j) + 1]) << 16 for j in range(NW)]
        sh = (u0 & 1) * 16
        r = [((w[j] | w[j + 1] << 32) >> sh) & 0xffffffff for j in range(NW - 1)]  # __funnelshift_r

        def bits(b, width):
            j, o = b >> 5, b & 31
            v = r[j] >> o
            if o + width > 32: v |= r[j + 1] << (32 - o)
            return v & ((1 << width) - 1)
        out = [0] * W
        for gi in range(R["G"] + 1):
            n = 5 if gi < R["G"] else R["C"] - 5 * R["G"]
            gv = 0 if n == 0 else bits(R["groups_at"] + 16 * gi, 16) if gi < R["G"] else bits(R["tail_at"], R["tail_bits"])
            for k in range(n):
                ch = 5 * gi + k
                q = umulhi(gv, 477218589)
                f = ((gv - 9 * q) << 12) | bits(12 * ch, 12)
                gv = q
                out[ch >> 1] = (out[ch >> 1] | (f << 16)) if ch & 1 else f
        words[lane] = out
        scl[lane] = bits(R["scale_at"], R["scale_bits"]) << (15 - R["scale_bits"])
    return words, scl

def key_records_and_softmax(sc, kptr, krec, t0, BH, n, g, qf, sl, mA, mB, lA, lB, acc, MV):
    """Both tensor-core paths, per tile: add q . (exact chunk) of the tile's Med3x key records
    to the lane scores, scale by sl, then the per-lane online softmax over the 8 lanes that
    share c (sc becomes P, the accumulators are rescaled)."""
    ra, re = (kptr[(t0 // 32) * BH + n], kptr[(t0 // 32) * BH + n + 1]) if len(kptr) else (0, 0)
    buf = np.zeros((32, 8))
    for r in range(ra, re):
        rec = krec[r]; tl = rec[0] - t0; cc = rec[1] & 0xff
        if not (0 <= tl < 32) or (int(rec[1]) & 0xffffffff) >> 8 != n: continue
        v = [hb(int(rec[2]) & 0xffff), hb((int(rec[2]) >> 16) & 0xffff), hb(int(rec[3]) & 0xffff), hb((int(rec[3]) >> 16) & 0xffff)]
        for j in range(g): buf[tl, j] += np.dot(qf[j, 4 * cc:4 * cc + 4], v)
    if re > ra:
        for l in range(32):
            i, c = l >> 2, l & 3
            for mt in range(2):
                for e in range(4): sc[l][mt][e] += buf[16 * mt + i + 8 * (e >> 1), 2 * c + (e & 1)]
    for l in range(32):
        for mt in range(2):
            for e in range(4): sc[l][mt][e] *= sl
    for c in range(4):
        lanes = [4 * i + c for i in range(8)]
        xA = max(max(sc[l][mt][e] for mt in range(2) for e in (0, 2)) for l in lanes)
        xB = max(max(sc[l][mt][e] for mt in range(2) for e in (1, 3)) for l in lanes)
        for l in lanes:
            nA = max(mA[l], xA); nB = max(mB[l], xB)
            alA = 1. if nA == -np.inf else 2 ** (mA[l] - nA); alB = 1. if nB == -np.inf else 2 ** (mB[l] - nB)
            mA[l], mB[l] = nA, nB; uA = 0 if nA == -np.inf else nA; uB = 0 if nB == -np.inf else nB
            ps = [0., 0.]
            for mt in range(2):
                for e in range(4):
                    sc[l][mt][e] = 2 ** (sc[l][mt][e] - (uB if e & 1 else uA)); ps[e & 1] += sc[l][mt][e]
            lA[l] = lA[l] * alA + ps[0]; lB[l] = lB[l] * alB + ps[1]
            for mv in range(MV):
                acc[l][mv][0] *= alA; acc[l][mv][1] *= alB; acc[l][mv][2] *= alA; acc[l][mv][3] *= alB


def write_out(out, acc, lA, lB, g, MV, channel):
    """Both paths, end of the warp: l summed over the 8 lanes sharing c, out[head, channel(i,
    mv, e)] = acc / l for lane (i, c), m-tile mv, element e (head 2c + (e & 1))."""
    for c in range(4):
        LA = sum(lA[4 * i + c] for i in range(8)); LB = sum(lB[4 * i + c] for i in range(8))
        for i in range(8):
            l = 4 * i + c
            for mv in range(MV):
                for e in range(4):
                    head = 2 * c + (e & 1)
                    if head >= g: continue
                    out[head, channel(i, mv, e)] = acc[l][mv][e] / (LA if e % 2 == 0 else LB)


def emulate(q, kops, vops, RB, b, h, B, H, g, D, scale, T, fmt=None, seed=0):
    """hqmq_warp_mma<FMT> (fmt None: the launch's hqmq_fmt)."""
    out=np.zeros((g,D))
    kc,ksec,krec,kptr=[t.numpy() for t in kops]; vc,vsec,vrec,vptr=[t.numpy() for t in vops]
    S=ksec.shape[1]; maxq=(1<<RB)-1; C=D//4; NK=MV=D//16; BH=B*H; n=b*H+h
    rl=row_layout(D,S,RB); U=rl["units"]; assert kc.shape[-1]==vc.shape[-1]==U
    if fmt is None: fmt=hqmq_fmt(rl,rl,RB,RB,S,S)
    rng=np.random.default_rng(seed)
    cbk=[[f16(x) for x in hamilton(unit(e%24), ksec[h,e//24])] for e in range(24*S)]
    cbv=[[f16(x) for x in hamilton(unit(e%24), vsec[h,e//24])] for e in range(24*S)]
    qf=q[b, h*g:(h+1)*g].astype(np.float32)
    qm=np.abs(qf).max(1); qm[qm==0]=1
    qh=np.zeros((8,D),np.float32); qh[:g]=np.vectorize(f16)(qf/qm[:,None])
    qmv=np.ones(8); qmv[:g]=qm
    sl=scale*1.4426950408889634
    acc=[[[0.]*4 for _ in range(MV)] for _ in range(32)]
    mA=[-np.inf]*32; mB=[-np.inf]*32; lA=[0.]*32; lB=[0.]*32
    for t0 in range(0,(T//32)*32,32):
        # the ring stage: the K tile's packed rows, then the V tile's (+ 16 bytes of padding)
        skc=smem_tile(kc[b,h,t0:t0+32],32*U+8,rng); svc=smem_tile(vc[b,h,t0:t0+32],8,rng)
        sc=[[[0.]*4 for _ in range(2)] for _ in range(32)]
        for kk in range(NK):
            b0=[]; b1=[]
            for l in range(32):
                i,c=l>>2,l&3; ch=4*(4*kk+c)
                b0.append(qh[i,ch:ch+2]); b1.append(qh[i,ch+2:ch+4])
            Bm=asmB(b0,b1)
            for mt in range(2):
                regs=[]
                for l in range(32):
                    i,c=l>>2,l&3; a=[None]*4
                    for hh in range(2):
                        f=smem_packed_field(skc,(16*mt+i+8*hh)*U,4*kk+c,rl,fmt,D); d=min(f>>RB,24*S-1); rc=f&maxq; cw=cbk[d]
                        a[hh]=[f16(cw[0]*rc),f16(cw[1]*rc)]; a[2+hh]=[f16(cw[2]*rc),f16(cw[3]*rc)]
                    regs.append(a)
                Cm=asmA(regs)@Bm
                for l in range(32):
                    for e in range(4): sc[l][mt][e]+=distC(Cm)[l][e]
        for l in range(32):
            i,c=l>>2,l&3
            for mt in range(2):
                for hh in range(2):
                    stp=np.float32(hb(smem_packed_scale(skc,(16*mt+i+8*hh)*U,rl,fmt,D)))*np.float32(1/maxq)
                    sc[l][mt][2*hh]*=stp*qmv[2*c]; sc[l][mt][2*hh+1]*=stp*qmv[2*c+1]
        # key records, scale, online softmax
        key_records_and_softmax(sc, kptr, krec, t0, BH, n, g, qf, sl, mA, mB, lA, lB, acc, MV)
        # P^T fragments (movmatrix): lane (i,c) gets P[tok 16mt+2c(+1)][head i] and +8
        P=np.zeros((32,8))
        for l in range(32):
            i,c=l>>2,l&3
            for mt in range(2):
                for e in range(4): P[16*mt+i+8*(e>>1),2*c+(e&1)]=f16(sc[l][mt][e])
        for kst in range(2):
            b0=[P[16*kst+2*(l&3):16*kst+2*(l&3)+2,l>>2] for l in range(32)]
            b1=[P[16*kst+8+2*(l&3):16*kst+8+2*(l&3)+2,l>>2] for l in range(32)]
            Bm=asmB(b0,b1)
            for mv in range(MV):
                own={}; give={}
                for l in range(32):
                    i,c=l>>2,l&3; odd=i&1; cv=4*mv+(i>>1); x01=[];x23=[]
                    for u in range(2):
                        tl=16*kst+2*c+8*odd+u
                        f=smem_packed_field(svc,tl*U,cv,rl,fmt,D); d=min(f>>RB,24*S-1); rc=f&maxq; cw=cbv[d]
                        rs=f16(rc*np.float32(hb(smem_packed_scale(svc,tl*U,rl,fmt,D)))*np.float32(1/maxq))
                        x01.append([f16(cw[0]*rs),f16(cw[1]*rs)]); x23.append([f16(cw[2]*rs),f16(cw[3]*rs)])
                    own[l]=([x01[0][odd],x01[1][odd]],[x23[0][odd],x23[1][odd]])
                    give[l]=([x01[0][1-odd],x01[1][1-odd]],[x23[0][1-odd],x23[1][1-odd]])
                regs=[]
                for l in range(32):
                    odd=(l>>2)&1; got=give[l^4]; ow=own[l]
                    regs.append([got[0],got[1],ow[0],ow[1]] if odd else [ow[0],ow[1],got[0],got[1]])
                Cm=asmA(regs)@Bm; cd=distC(Cm)
                for l in range(32):
                    for e in range(4): acc[l][mv][e]+=cd[l][e]
        ra,re=(vptr[(t0//32)*BH+n],vptr[(t0//32)*BH+n+1]) if len(vptr) else (0,0)
        for r in range(ra,re):
            rec=vrec[r]; tl=rec[0]-t0; cc=rec[1]&0xff
            if not(0<=tl<32) or (int(rec[1])&0xffffffff)>>8!=n: continue
            v=[hb(int(rec[2])&0xffff),hb((int(rec[2])>>16)&0xffff),hb(int(rec[3])&0xffff),hb((int(rec[3])>>16)&0xffff)]
            # kernel reads p from buf (fp32 p before fp16 packing)
            pfull=np.zeros((32,8))
            for l in range(32):
                i,c=l>>2,l&3
                for mt in range(2):
                    for e in range(4): pfull[16*mt+i+8*(e>>1),2*c+(e&1)]=sc[l][mt][e]
            for l in range(32):
                i,c=l>>2,l&3
                if (i>>1)!=(cc&3): continue
                mv=cc>>2; vlo=v[i&1]; vhi=v[(i&1)+2]; pA=pfull[tl,2*c]; pB=pfull[tl,2*c+1]
                acc[l][mv][0]+=pA*vlo; acc[l][mv][1]+=pB*vlo; acc[l][mv][2]+=pA*vhi; acc[l][mv][3]+=pB*vhi
    # reduce l over lanes sharing c, write output
    write_out(out, acc, lA, lB, g, MV, lambda i, mv, e: 4*(4*mv+(i>>1))+(i&1)+2*(e>>1))
    return out



def hmul(a, b):  # fp16 x fp16 -> fp16 (the exact product fits fp32; one rounding, subnormals kept)
    return f16(np.float32(a) * np.float32(b))


def emulate_v2(q, kops, vops, b, h, B, H, g, D, scale, T, seed=0):
    """hqmq_warp_mma16 (F = 16, b_r = 4, D = 64 / 128): chunk NK c + kk in k-step kk of lane quad
    c; PV m-tiles 2m / 2m + 1 = elements (0, 1) / (2, 3) of chunk VP i + m in rows i / i + 8;
    codeword byte offsets (w >> 1) & 0x7ff8 / (w >> 17) & 0x7ff8 into 4096-entry codebooks
    (K x 2^15, V x 16/15, entries past 24 S clamped); K rcodes as fp16 subnormals rcode 2^-24,
    V as fp16(rcode / 16 x scale); per-word bit operations as in the kernel."""
    assert D in (64, 128)
    out = np.zeros((g, D))
    kc, ksec, krec, kptr = [t.numpy() for t in kops]
    vc, vsec, vrec, vptr = [t.numpy() for t in vops]
    S = ksec.shape[1]; W = D // 8; NK = MV = D // 16; VP = D // 32; BH = B * H; n = b * H + h
    U = row_layout(D, S, 4)["units"]; assert kc.shape[-1] == vc.shape[-1] == U
    rng = np.random.default_rng(seed)
    def book(sec, f):
        return [[f16(np.float32(x) * np.float32(f)) for x in hamilton(unit(min(e, 24 * S - 1) % 24),
                 sec[h, min(e, 24 * S - 1) // 24])] for e in range(4096)]
    cbk = book(ksec, 32768.0); cbv = book(vsec, np.float32(16.0) / np.float32(15.0))
    def cw_at(book_, w, hi):
        off = ((w >> 17) & 0x7ff8) if hi else ((w >> 1) & 0x7ff8)
        return book_[off >> 3]
    qf = q[b, h * g:(h + 1) * g].astype(np.float32)
    qm = np.abs(qf).max(1); qm[qm == 0] = 1
    qh = np.zeros((8, D), np.float32); qh[:g] = np.vectorize(f16)(qf / qm[:, None])
    qmv = np.ones(8); qmv[:g] = qm
    kf = np.float32(512.0) / np.float32(15.0)
    sl = scale * 1.4426950408889634
    acc = [[[0.] * 4 for _ in range(MV)] for _ in range(32)]
    mA = [-np.inf] * 32; mB = [-np.inf] * 32; lA = [0.] * 32; lB = [0.] * 32
    for t0 in range(0, (T // 32) * 32, 32):
        # the packed tiles land in shared memory (followed by other ring contents), then each
        # lane unpacks its token into 16-bit fields and its fp16 scale (hqmq_unpack16)
        krows, ksb = hqmq_unpack16(smem_tile(kc[b, h, t0:t0 + 32], 64, rng), D)
        vrows, vsb = hqmq_unpack16(smem_tile(vc[b, h, t0:t0 + 32], 64, rng), D)
        sc = [[[0.] * 4 for _ in range(2)] for _ in range(32)]
        for kk in range(NK):
            b0 = []; b1 = []
            for l in range(32):
                i, c = l >> 2, l & 3; ch = 4 * (NK * c + kk)
                b0.append(qh[i, ch:ch + 2]); b1.append(qh[i, ch + 2:ch + 4])
            Bm = asmB(b0, b1)
            for mt in range(2):
                regs = []
                for l in range(32):
                    i, c = l >> 2, l & 3; a = [None] * 4
                    for hh in range(2):
                        w = int(krows[16 * mt + i + 8 * hh][(NK * c + kk) >> 1])  # word kk >> 1 of the lane's block
                        hi = kk & 1; cw = cw_at(cbk, w, hi)
                        r = ((w >> 16) & 15 if hi else w & 15) * 2.0 ** -24  # fp16 subnormal
                        a[hh] = [hmul(cw[0], r), hmul(cw[1], r)]; a[2 + hh] = [hmul(cw[2], r), hmul(cw[3], r)]
                    regs.append(a)
                Cm = asmA(regs) @ Bm
                for l in range(32):
                    for e in range(4): sc[l][mt][e] += distC(Cm)[l][e]
        for l in range(32):
            i, c = l >> 2, l & 3
            for mt in range(2):
                for hh in range(2):
                    stp = np.float32(hb(int(ksb[16 * mt + i + 8 * hh])))
                    sc[l][mt][2 * hh] *= stp * (qmv[2 * c] * kf); sc[l][mt][2 * hh + 1] *= stp * (qmv[2 * c + 1] * kf)
        key_records_and_softmax(sc, kptr, krec, t0, BH, n, g, qf, sl, mA, mB, lA, lB, acc, MV)
        P = np.zeros((32, 8)); pfull = np.zeros((32, 8))
        for l in range(32):
            i, c = l >> 2, l & 3
            for mt in range(2):
                for e in range(4):
                    P[16 * mt + i + 8 * (e >> 1), 2 * c + (e & 1)] = f16(sc[l][mt][e])
                    pfull[16 * mt + i + 8 * (e >> 1), 2 * c + (e & 1)] = sc[l][mt][e]
        for kst in range(2):
            b0 = [P[16 * kst + 2 * (l & 3):16 * kst + 2 * (l & 3) + 2, l >> 2] for l in range(32)]
            b1 = [P[16 * kst + 8 + 2 * (l & 3):16 * kst + 8 + 2 * (l & 3) + 2, l >> 2] for l in range(32)]
            Bm = asmB(b0, b1)
            for m in range(VP):
                regs = {0: [], 1: []}
                for l in range(32):
                    i, c = l >> 2, l & 3
                    y01 = []; y23 = []
                    for u, tt in enumerate((2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)):
                        tl = 16 * kst + tt
                        w = int(vrows[tl][(VP * i + m) >> 1]); hi = m & 1; cw = cw_at(cbv, w, hi)
                        r16 = ((w >> 16) & 15 if hi else w & 15) / 16.0
                        rs = hmul(r16, np.float32(np.float16(hb(int(vsb[tl])))))
                        y01.append((hmul(cw[0], rs), hmul(cw[1], rs))); y23.append((hmul(cw[2], rs), hmul(cw[3], rs)))
                    for half, y in ((0, y01), (1, y23)):
                        regs[half].append([[y[0][0], y[1][0]], [y[0][1], y[1][1]], [y[2][0], y[3][0]], [y[2][1], y[3][1]]])
                for half in (0, 1):
                    cd = distC(asmA(regs[half]) @ Bm)
                    for l in range(32):
                        for e in range(4): acc[l][2 * m + half][e] += cd[l][e]
        ra, re = (vptr[(t0 // 32) * BH + n], vptr[(t0 // 32) * BH + n + 1]) if len(vptr) else (0, 0)
        for r in range(ra, re):
            rec = vrec[r]; tl = rec[0] - t0; cc = rec[1] & 0xff
            if not (0 <= tl < 32) or (int(rec[1]) & 0xffffffff) >> 8 != n: continue
            v = [hb(int(rec[2]) & 0xffff), hb((int(rec[2]) >> 16) & 0xffff), hb(int(rec[3]) & 0xffff), hb((int(rec[3]) >> 16) & 0xffff)]
            for l in range(32):
                i, c = l >> 2, l & 3
                if i != cc // VP: continue
                pA = pfull[tl, 2 * c]; pB = pfull[tl, 2 * c + 1]
                for mv in (2 * (cc % VP), 2 * (cc % VP) + 1):
                    vr = v[2] if mv & 1 else v[0]; vr8 = v[3] if mv & 1 else v[1]
                    acc[l][mv][0] += pA * vr; acc[l][mv][1] += pB * vr; acc[l][mv][2] += pA * vr8; acc[l][mv][3] += pB * vr8
    write_out(out, acc, lA, lB, g, MV, lambda i, mv, e: 4 * (VP * i + (mv >> 1)) + 2 * (mv & 1) + (e >> 1))
    return out


@pytest.mark.parametrize("med3,B,H,T,D,g", [(False, 1, 2, 64, 64, 3), (True, 1, 2, 64, 64, 3),
                                            (True, 2, 1, 64, 128, 8)])
def test_mma16_path_emulation_matches_cpu_op(med3, B, H, T, D, g):
    """The v2 layout (hqmq_warp_mma16) of the F = 16 format, incl. key / value records."""
    cfg = kvq.HQMQConfig(secondary_size=96, radius_bits=4, outlier_factor=3.0 if med3 else None)
    cache = kvq.KVCache(cfg)
    k = torch.randn(B, H, T, D, dtype=torch.float16)
    v = torch.randn(B, H, T, D, dtype=torch.float16)
    k[:, :, ::5, 8:12] *= 12
    k[:, :, 2::9, 40:44] *= 15
    v[:, :, 3::7, -4:] *= 20
    v[:, :, 1::4] *= 1e-3  # small radius scales
    cache.update(k, v, 0)
    kops = cache.layers[0].key.attention_operands()
    vops = cache.layers[0].value.attention_operands()
    assert kops[0].shape[-1] == kvq.ops.hqmq_units(D, 96, 4) == {64: 16, 128: 31}[D]  # packed rows
    if med3:
        assert kops[2].shape[0] > 0 and vops[2].shape[0] > 0
    q = torch.randn(B, H * g, D, dtype=torch.float16)
    ref = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, 4, 4, D ** -0.5).float().numpy()
    for b in range(B):
        for h in range(H):
            em = emulate_v2(q.float().numpy(), kops, vops, b, h, B, H, g, D, D ** -0.5, T)
            r = ref[b, h * g:(h + 1) * g]
            err = np.linalg.norm(em - r) / np.linalg.norm(r)
            assert err < 3e-3, f"b={b} h={h}: relative error {err:.2e}"


GENERAL_CASES = [("hqmq-3.79-paper", 1, 2, 64, 64, 3, None), ("hqmq-5", 1, 2, 64, 64, 3, None),
                 ("hqmq-5", 2, 1, 96, 128, 8, None),
                 # FMT 1 / 2 layouts read with the runtime-width FMT 0 code: the same fields
                 ("hqmq-3.79-paper", 1, 1, 64, 128, 4, 0), ("hqmq-5", 1, 1, 64, 64, 2, 0),
                 # formats only FMT 0 serves: R = 12 (S = 64), R = 16 (S = 2), R = 10 (S = 200)
                 ("s64-rb5-med3", 1, 2, 64, 64, 3, None), ("s2-rb3", 1, 1, 64, 128, 5, None),
                 ("s200-rb8", 1, 1, 32, 256, 2, None)]
CUSTOM = {"s64-rb5-med3": kvq.HQMQConfig(secondary_size=64, radius_bits=5, outlier_factor=3.0),
          "s2-rb3": kvq.HQMQConfig(secondary_size=2, radius_bits=3),
          "s200-rb8": kvq.HQMQConfig(secondary_size=200, radius_bits=8)}


@pytest.mark.parametrize("preset,B,H,T,D,g,fmt", GENERAL_CASES)
def test_mma_path_emulation_matches_cpu_op(preset, B, H, T, D, g, fmt):
    cfg = CUSTOM.get(preset, preset)
    cache = kvq.KVCache(cfg)
    k = torch.randn(B, H, T, D, dtype=torch.float16)
    v = torch.randn(B, H, T, D, dtype=torch.float16)
    k[:, :, ::5, 8:12] *= 12
    k[:, :, 2::9, 40:44] *= 15
    v[:, :, 3::7, -4:] *= 20
    cache.update(k, v, 0)
    kops = cache.layers[0].key.attention_operands()
    vops = cache.layers[0].value.attention_operands()
    config = kvq.get_config(cfg) if isinstance(cfg, str) else cfg
    if config.outlier_factor is not None:
        assert kops[2].shape[0] > 0 and vops[2].shape[0] > 0
    rb, S = config.radius_bits, config.secondary_size
    rl = row_layout(D, S, rb)
    auto = hqmq_fmt(rl, rl, rb, rb, S, S)
    assert auto == {"hqmq-3.79-paper": 1, "hqmq-5": 2}.get(preset, 0)
    q = torch.randn(B, H * g, D, dtype=torch.float16)
    ref_out = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, rb, rb, D ** -0.5).float().numpy()
    for b in range(B):
        for h in range(H):
            em = emulate(q.float().numpy(), kops, vops, rb, b, h, B, H, g, D, D ** -0.5, T, fmt=fmt, seed=b * H + h)
            r = ref_out[b, h * g:(h + 1) * g]
            err = np.linalg.norm(em - r) / np.linalg.norm(r)
            assert err < 3e-3, f"b={b} h={h}: relative error {err:.2e}"


def test_emulated_layout_equals_kvq_layout():
    for D in (32, 64, 128, 256):
        for S in (1, 2, 7, 64, 86, 96, 171, 192, 200, 1000, 2048):
            for rb in range(1, 9):
                assert row_layout(D, S, rb) == kvq.ops.hqmq_row_layout(D, S, rb)
    # the compile-time layouts of FMT 1..3 hold for every S with the same (E, R)
    for S in range(86, 97):
        assert row_layout(128, S, 4) == row_layout(128, 96, 4)
    for S in range(171, 193):
        assert row_layout(64, S, 6) == row_layout(64, 192, 6)


def test_kernel_divisions_by_powers_of_9_are_exact():
    """div_pow9 (multiply-high by ceil(2^32 / 9^i)) and the mod 9 of the FMT 1..3 digit reads
    are exact for every 16-bit group value."""
    x = np.arange(1 << 16, dtype=np.uint64)
    m = {1: 477218589, 2: 53024288, 3: 5891588, 4: 654621}
    for i, mi in m.items():
        assert mi == -(-(1 << 32) // 9 ** i)
        assert np.array_equal((x * np.uint64(mi)) >> np.uint64(32), x // np.uint64(9 ** i))
    assert all(div_pow9(v, 0) == v for v in (0, 1, 65535))
    q = x
    assert np.array_equal(q - np.uint64(9) * ((q * np.uint64(477218589)) >> np.uint64(32)), q % np.uint64(9))


@pytest.mark.parametrize("D,S,rb", [(32, 1, 1), (64, 96, 4), (128, 96, 4), (256, 96, 4), (64, 192, 6), (128, 192, 6),
                                    (256, 192, 6), (128, 64, 5), (256, 2048, 8), (128, 2, 3), (64, 200, 8)])
def test_emulated_packed_reads_equal_reference(D, S, rb):
    """The emulated shared-memory reads (smem_packed_field / smem_packed_scale for every FMT that
    applies, hqmq_unpack16 for the F = 16 layout) return exactly the fields and scales the
    reference unpacks from the format text, on rows full of random fields and garbage after the
    tile."""
    g = torch.Generator().manual_seed(D + S + rb)
    C = D // 4
    dirs = torch.randint(0, 24 * S, (32, C), generator=g)
    rc = torch.randint(0, 2 ** rb, (32, C), generator=g)
    SB = ref.scale_bits(D, S, rb)
    scode = torch.randint(0, ref.max_finite_code(SB) + 1, (32,), generator=g)
    rows = ref.pack_rows(dirs, rc, scode, D, S, rb)
    fields, sc = ref.unpack_fields(rows, D, S, rb)
    assert torch.equal(fields, (dirs << rb) | rc) and torch.equal(sc, scode)
    rl = row_layout(D, S, rb)
    U = rl["units"]
    rng = np.random.default_rng(0)
    sm = smem_tile(rows.numpy(), 8, rng)
    fmts = [0] + ([hqmq_fmt(rl, rl, rb, rb, S, S)] if hqmq_fmt(rl, rl, rb, rb, S, S) else [])
    for fmt in fmts:
        got = np.array([[smem_packed_field(sm, t * U, c, rl, fmt, D) for c in range(C)] for t in range(32)])
        assert np.array_equal(got, fields.numpy()), fmt
        scl = np.array([smem_packed_scale(sm, t * U, rl, fmt, D) for t in range(32)])
        assert np.array_equal(scl, scode.numpy() << (15 - SB)), fmt
    if (D in (64, 128)) and S == 96 and rb == 4:
        words, sb = hqmq_unpack16(smem_tile(rows.numpy(), 64, rng), D)
        f16s = np.stack([words & 0xffff, words >> 16], -1).reshape(32, C)
        assert np.array_equal(f16s, fields.numpy())
        assert np.array_equal(sb, scode.numpy() << (15 - SB))
