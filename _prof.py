import sys; sys.argv=['x']
import numpy as np, time, cProfile, pstats
sys.path.insert(0, 'bench')
import bench_hybrid as bh
from rfmem_fast import RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
rng = np.random.default_rng(0); vocab = bh._vocab(30000)
wl = synthetic_bank(4, 4096, SyntheticSpec(dim=384), seed=2)
tx = bh.zipf_texts(4*4096, 60, vocab, 1.07, rng)
bank = bh.with_texts(wl, tx)
snap = bank.snapshot(); users = list(bank.users)
qu = [users[int(j)] for j in rng.integers(4, size=256)]
rows = np.array([snap.offsets[bank.user_index(u)] for u in qu]) + rng.integers(4096, size=256)
Qb = snap.vectors[rows] + 0.05*rng.normal(size=(256,384)).astype(np.float32)
qtb = [" ".join(tx[int(r)].split()[:3]) + " " + e for r, e in zip(rows, bh.zipf_texts(256, 5, vocab, 1.07, rng))]
be = get_backend("native")
c = RFMemConfig(**bh.FUSIONS["convex_max"])
search(bank, Qb, qu, c, mode="dense", backend=be, query_texts=qtb)
cProfile.run('search(bank, Qb, qu, c, mode="dense", backend=be, query_texts=qtb)', '/tmp/prof')
pstats.Stats('/tmp/prof').sort_stats("tottime").print_stats(25)
S = sys.modules["rfmem_fast.search"]
orig = S.exact_pair_scores
cnt=[]
def wrap(X,Q,qi,r,m):
    cnt.append(r.shape[0]); return orig(X,Q,qi,r,m)
S.exact_pair_scores = wrap
search(bank, Qb, qu, c, mode="dense", backend=be, query_texts=qtb)
print("survivors", cnt)
r = search(bank, Qb[:5], qu[:5], RFMemConfig(out_k=64, probe_k=64), mode="dense", backend=be)
print(r.scores[:, [0, 9, 63]])
