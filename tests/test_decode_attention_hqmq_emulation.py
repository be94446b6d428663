"""Lane-level emulation of the CUDA tensor-core path of kvq.decode_attention_hqmq
(hqmq_warp_mma in include/kvq/attention/decode_attention_hqmq.cuh) on the CPU: the K/V
A-fragment permutations, the lane-pair exchange of V halves, the movmatrix P^T operand, the
per-lane online softmax and the Med3x record paths, with the standard mma.m16n8k16 fragment
layouts and fp16 rounding of every mma operand.  One warp walks every full 32-token tile of
one (b, h).  The result must match the CPU op, so a layout slip in the kernel's design shows
up here in CI (the kernel itself only runs on the GPU machine).  Keep in sync with the kernel.
"""
import numpy as np
import pytest
import torch

import kvquant_ext as kvq

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
def field(row, chunk, F):
    bit=chunk*F; w=bit>>5; o=bit&31
    v=int(row[w]) & 0xffffffff
    if w+1 < len(row): v |= (int(row[w+1]) & 0xffffffff) << 32
    return (v>>o) & ((1<<F)-1)
def hb(x): return float(np.array([x],np.uint16).view(np.float16)[0])

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


def emulate(q, kops, vops, RB, b, h, B, H, g, D, scale, T):
    out=np.zeros((g,D))
    kc,ks,ksec,krec,kptr=[t.numpy() for t in kops]; vc,vs,vsec,vrec,vptr=[t.numpy() for t in vops]
    S=ksec.shape[1]; F=int(np.ceil(np.log2(24*S)))+RB; maxq=(1<<RB)-1; C=D//4; NK=MV=D//16; BH=B*H; n=b*H+h
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
        krows=kc[b,h,t0:t0+32]; vrows=vc[b,h,t0:t0+32]
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
                        f=field(krows[16*mt+i+8*hh],4*kk+c,F); d=min(f>>RB,24*S-1); rc=f&maxq; cw=cbk[d]
                        a[hh]=[f16(cw[0]*rc),f16(cw[1]*rc)]; a[2+hh]=[f16(cw[2]*rc),f16(cw[3]*rc)]
                    regs.append(a)
                Cm=asmA(regs)@Bm
                for l in range(32):
                    for e in range(4): sc[l][mt][e]+=distC(Cm)[l][e]
        for l in range(32):
            i,c=l>>2,l&3
            for mt in range(2):
                for hh in range(2):
                    stp=np.float32(ks[b,h,t0+16*mt+i+8*hh])*np.float32(1/maxq)
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
                        f=field(vrows[tl],cv,F); d=min(f>>RB,24*S-1); rc=f&maxq; cw=cbv[d]
                        rs=f16(rc*np.float32(vs[b,h,t0+tl])*np.float32(1/maxq))
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


def emulate_v2(q, kops, vops, b, h, B, H, g, D, scale, T):
    """hqmq_warp_mma16 (F = 16, b_r = 4, D = 64 / 128): chunk NK c + kk in k-step kk of lane quad
    c; PV m-tiles 2m / 2m + 1 = elements (0, 1) / (2, 3) of chunk VP i + m in rows i / i + 8;
    codeword byte offsets (w >> 1) & 0x7ff8 / (w >> 17) & 0x7ff8 into 4096-entry codebooks
    (K x 2^15, V x 16/15, entries past 24 S clamped); K rcodes as fp16 subnormals rcode 2^-24,
    V as fp16(rcode / 16 x scale); per-word bit operations as in the kernel."""
    assert D in (64, 128)
    out = np.zeros((g, D))
    kc, ks, ksec, krec, kptr = [t.numpy() for t in kops]
    vc, vs, vsec, vrec, vptr = [t.numpy() for t in vops]
    S = ksec.shape[1]; W = D // 8; NK = MV = D // 16; VP = D // 32; BH = B * H; n = b * H + h
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
        krows = kc[b, h, t0:t0 + 32].astype(np.int64) & 0xffffffff
        vrows = vc[b, h, t0:t0 + 32].astype(np.int64) & 0xffffffff
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
                    stp = np.float32(ks[b, h, t0 + 16 * mt + i + 8 * hh])
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
                        rs = hmul(r16, np.float32(np.float16(vs[b, h, t0 + tl])))
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
    assert kops[0].shape[-1] == D // 8  # F = 16
    if med3:
        assert kops[3].shape[0] > 0 and vops[3].shape[0] > 0
    q = torch.randn(B, H * g, D, dtype=torch.float16)
    ref = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, 4, 4, D ** -0.5).float().numpy()
    for b in range(B):
        for h in range(H):
            em = emulate_v2(q.float().numpy(), kops, vops, b, h, B, H, g, D, D ** -0.5, T)
            r = ref[b, h * g:(h + 1) * g]
            err = np.linalg.norm(em - r) / np.linalg.norm(r)
            assert err < 3e-3, f"b={b} h={h}: relative error {err:.2e}"


@pytest.mark.parametrize("preset,B,H,T,D,g", [("hqmq-3.79-paper", 1, 2, 64, 64, 3), ("hqmq-5", 1, 2, 64, 64, 3),
                                              ("hqmq-5", 2, 1, 96, 128, 8)])
def test_mma_path_emulation_matches_cpu_op(preset, B, H, T, D, g):
    cache = kvq.KVCache(preset)
    k = torch.randn(B, H, T, D, dtype=torch.float16)
    v = torch.randn(B, H, T, D, dtype=torch.float16)
    k[:, :, ::5, 8:12] *= 12
    k[:, :, 2::9, 40:44] *= 15
    v[:, :, 3::7, -4:] *= 20
    cache.update(k, v, 0)
    kops = cache.layers[0].key.attention_operands()
    vops = cache.layers[0].value.attention_operands()
    if preset == "hqmq-5":
        assert kops[3].shape[0] > 0 and vops[3].shape[0] > 0
    q = torch.randn(B, H * g, D, dtype=torch.float16)
    rb = kvq.get_config(preset).radius_bits
    ref = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, rb, rb, D ** -0.5).float().numpy()
    for b in range(B):
        for h in range(H):
            em = emulate(q.float().numpy(), kops, vops, rb, b, h, B, H, g, D, D ** -0.5, T)
            r = ref[b, h * g:(h + 1) * g]
            err = np.linalg.norm(em - r) / np.linalg.norm(r)
            assert err < 3e-3, f"b={b} h={h}: relative error {err:.2e}"
