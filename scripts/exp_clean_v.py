"""Experiment (not product): which part of the CT prefill's V cleaning moves its time with the true length?

Variants of csrc/prefill_sm90.cu:clean_v_ct, each built from a patched copy of csrc (DHP_CSRC):
  cur      the earlier form: select of the store address (tile row past the length, else a 1 KB scratch)
  product  the tree's form: the whole tile rewritten in place, loads in batches of 4
  rmw8     the same, batches of 8
(run 1, H200: cur +0.075 % t -36; one load-store chain per piece -0.014 % t +10.5 at +15 % time;
 no V cleaning at all -0.047 % t +13.7: the residue is the masked values, not the addresses)
Each variant: G4 prefill chunk B4 q64 L4096 strict consecutive, short vs long (graph replay), and the
outputs of short/long saved to compare bits across variants.
"""
import json, os, re, shutil, subprocess, sys
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out")) / "exp"
REPO = Path(__file__).resolve().parents[1]
SAMPLES = os.environ.get("EXP_SAMPLES", "100000")
VARIANTS = os.environ.get("EXP_VARIANTS", "cur,product,rmw8").split(",")
PAIRS = os.environ.get("EXP_PAIRS", "short:long")

CLEAN_OLD = """      const uint64_t dst = select_u64(t * kCols + row >= w.seq_len, tile + idx * 16, scratch + ((idx * 16) & 1023));
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);"""
LOOP = """    uint4* tile = reinterpret_cast<uint4*>(smem_ptr + L::kOffV + s * kTileBytes);
    for (int it = 0; it < kPieces; it += kCleanBatch) {
      uint4 v[kCleanBatch];
#pragma unroll
      for (int c = 0; c < kCleanBatch; ++c) v[c] = tile[(it + c) * kCleanThreads + tid];
#pragma unroll
      for (int c = 0; c < kCleanBatch; ++c) {
        const int idx = (it + c) * kCleanThreads + tid;  // 16-byte piece: [half][row][8 pieces]
        const int row = (idx / 8) % kRows;
        const uint32_t keep = 0u - static_cast<uint32_t>(t * kCols + row < w.seq_len);  // ~0u real, 0 padding
        tile[idx] = make_uint4(v[c].x & keep, v[c].y & keep, v[c].z & keep, v[c].w & keep);
      }
    }"""
# the earlier form (select of the store address: tile or a 1 KB scratch after the barriers)
CUR = """    const uint64_t tile = reinterpret_cast<uint64_t>(smem_ptr + L::kOffV + s * kTileBytes);
    const uint64_t scratch = reinterpret_cast<uint64_t>(smem_ptr + L::kOffBar + 128 + kRunBytesScratchGap);
#pragma unroll 8
    for (int it = 0; it < kPieces; ++it) {
      const int idx = it * kCleanThreads + tid;
      const int row = (idx / 8) % kRows;
""" + CLEAN_OLD + """
    }"""
PATCHES = {
    "product": [],
    "cur": [(LOOP, CUR), ("static constexpr int kOffRun = kOffBar + 128;", "static constexpr int kOffRun = kOffBar + 128 + 1024;"),
            ("constexpr int kCleanBatch = 4;", "constexpr int kCleanBatch = 4;\nconstexpr int kRunBytesScratchGap = 0;")],
    "rmw8": [("constexpr int kCleanBatch = 4;", "constexpr int kCleanBatch = 8;")],
}

SNIP = r'''
import torch, sys
from dhp_backend.audit import classes
shape = classes.Shape(batch=4, bucket=4096, q_len=64, policy="strict", layout="consecutive")
shared = {}
res = {}
for c in ("short", "long"):
    x = classes.make_inputs(shape, c, device="cuda", shared=shared)
    o = classes.empty_out(x)
    classes.launch(x, o)
    torch.cuda.synchronize()
    res[c] = o.cpu()
torch.save(res, sys.argv[1])
'''


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    src = (REPO / "csrc" / "prefill_sm90.cu").read_text()
    table = []
    for v in VARIANTS:
        d = Path(f"/tmp/csrc_{v}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(REPO / "csrc", d)
        text = src
        for old, new in PATCHES[v]:
            assert old in text, (v, old[:60])
            text = text.replace(old, new)
        (d / "prefill_sm90.cu").write_text(text)
        env = dict(os.environ, DHP_CSRC=str(d), DHP_CUDA_CACHE=f"/tmp/cuda_cache_{v}", PYTHONPATH=str(REPO))
        vd = OUT / v
        vd.mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-c", SNIP, str(vd / "out.pt")], env=env, capture_output=True, text=True)
        print(v, "outputs:", "ok" if r.returncode == 0 else r.stderr[-2000:], flush=True)
        cmd = [sys.executable, "-m", "dhp_backend.cli", "audit", "timing", "--modes", "graph", "--no-control",
               "--samples", SAMPLES, "--reported-samples", SAMPLES, "--steps", "prefill", "--lengths", "4096",
               "--policies", "strict", "--layouts", "consecutive", "--pairs", PAIRS, "--report-dir", str(vd),
               "--merge", "", "--json"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        (vd / "log.txt").write_text(r.stderr)
        print(r.stderr[-1500:], flush=True)
        try:
            rows = json.loads((vd / "g4-latest.json").read_text())["rows"]
        except Exception as e:  # noqa: BLE001
            print(v, "no report:", e)
            continue
        for row in rows:
            table.append((v, row.get("pair"), row.get("diff_pct"), row.get("t"), row.get("mean_us"), row.get("n_per_class"), row.get("verdict")))
    import torch
    base = OUT / "product" / "out.pt"
    if base.exists():
        b = torch.load(base)
        for v in VARIANTS:
            p = OUT / v / "out.pt"
            if p.exists():
                o = torch.load(p)
                print(v, "bits equal to product:", {c: bool(torch.equal(o[c].view(torch.int16), b[c].view(torch.int16)))
                                                for c in b})
    print("variant | pair | diff % | t | mean us | n | verdict")
    for t in table:
        print(" | ".join(str(x) for x in t))


if __name__ == "__main__":
    main()
