"""Where the shared data lives for the tests: $RFMEM_SHARED or ../shared beside the checkout."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def shared_dir() -> Path | None:
    """The shared folder (data/, golden/, docs/), or None when it is absent."""
    env = os.environ.get("RFMEM_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared"
    return path if path.is_dir() else None


def paused_backend(base: type, device: str):
    """An instance of backend class ``base`` whose four primitives (and probe) run with the
    host-sync counter paused: what is left counted is the search / beam driver's own
    synchronisations (set ``.counter`` to the :class:`rfmem_fast.device.HostSyncCounter`)."""

    class Paused(base):
        counter = None

        def _call(self, name, *args):
            with self.counter.paused():
                return getattr(base, name)(self, *args)

        def segmented_topk(self, *a):
            return self._call("segmented_topk", *a)

        def probe(self, *a):
            return self._call("probe", *a)

        def batched_kmeans(self, *a):
            return self._call("batched_kmeans", *a)

        def alpha_mix(self, *a):
            return self._call("alpha_mix", *a)

    return Paused(device)


def write_custom_questions(tmp_path: Path, seed: int, n: int, noise: float) -> tuple:
    """A saved two-user bank (``tmp_path/store``), ``n`` question vectors (``q.npy``: the sum of
    two of the user's items plus ``noise``) and their labels (``labels.jsonl``), the input of
    ``rfmem calibrate custom``. Returns (bank, queries [n, 12], users, label lines)."""
    import json

    import numpy as np

    from rfmem_fast import MemoryBank

    rng = np.random.default_rng(seed)
    bank = MemoryBank(12)
    for u in ("ann", "bob"):
        bank.add(u, rng.normal(size=(40, 12)), [f"{u}{i}" for i in range(40)])
    bank.save(tmp_path / "store")
    snap = bank.snapshot()
    queries, users, lines = [], [], []
    for i in range(n):
        u = ("ann", "bob")[i % 2]
        rel = rng.choice(40, 2, replace=False)
        a = snap.offsets[bank.user_index(u)]
        queries.append(snap.vectors[a + rel].sum(0) + noise * rng.normal(size=12))
        users.append(u)
        lines.append(json.dumps({"user": u, "relevant": [f"{u}{j}" for j in rel]}))
    np.save(tmp_path / "q.npy", np.array(queries))
    (tmp_path / "labels.jsonl").write_text("\n".join(lines) + "\n")
    return bank, np.array(queries), users, lines


def nudge_one_coordinate(X: np.ndarray, rng: np.random.Generator) -> None:
    """In place: one random coordinate of each float32 row moved by one ulp up or down
    (rows that tie to float rounding: the near-tie banks of the driver tests)."""
    d = X.shape[1]
    for i in range(X.shape[0]):
        j = rng.integers(0, d)
        X[i, j] = np.nextafter(X[i, j], np.float32(np.inf if rng.random() < 0.5 else -np.inf))


def on_grid(X: np.ndarray) -> np.ndarray:
    """``X`` rounded to integers (float32; an all-zero row gets a 1 in column 0): rows
    with many exactly equal scores."""
    X = np.round(X).astype(np.float32)
    X[np.all(X == 0, axis=1), 0] = 1.0
    return X


def clustered_rows(rng: np.random.Generator, n: int, d: int, kind: str) -> np.ndarray:
    """float32 [n, d] rows around 8 random centres, then per ``kind``: "gauss" as drawn,
    "dup" a third of them exact copies of 4 rows, "near" n / 8 distinct rows repeated and
    nudged by one ulp (near ties), "grid" rounded to integers (exact ties everywhere):
    the banks of the beam driver's pruning tests."""
    centres = rng.standard_normal((8, d))
    X = (centres[rng.integers(0, 8, n)] + 0.4 * rng.standard_normal((n, d))).astype(np.float32)
    if kind == "dup":
        X[rng.integers(0, n, n // 3)] = X[rng.integers(0, 4, n // 3)]
    elif kind == "near":
        X = X[rng.integers(0, n // 8, n)].copy()
        nudge_one_coordinate(X, rng)
    elif kind == "grid":
        X = on_grid(X)
    return X


def load_bench_script(name: str):
    """The module of ``bench/<name>.py`` (the benchmark scripts are not a package), loaded
    from this checkout: for the tests that run a script at tiny sizes."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
