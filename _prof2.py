import numpy as np, time, torch
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
wl = synthetic_bank(1, 4096, SyntheticSpec(dim=384), seed=0)
be = get_backend("native"); view = be.view(wl.bank)
Q, _, _ = wl.queries(50, seed=1); Qt = torch.from_numpy(Q); seg = torch.zeros(1, dtype=torch.int64)
for k in (10, 32, 64, 128, 256):
    ts=[]
    for i in range(50):
        t=time.perf_counter(); be.probe(view, Qt[i:i+1], seg, k, 10, 20.0, "mean"); ts.append(time.perf_counter()-t)
    print(k, np.median(ts)*1e3)
