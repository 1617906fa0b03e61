"""Row-wise int8 for the MiniLM encoder: what it would gain, what it costs.

The shipped int8 option (``MatMulNBits``, blocks of 16: :mod:`rfmem_fast.onnx_export`) keeps
the retrieval close to float32 but is no faster than the float32 graph from ~100 rows per
pass on, which is where a busy server's batches are (~32 questions x ~16 tokens). The int8
that *is* faster there is an integer GEMM (``MatMulInteger``: ONNX Runtime's MLAS QGEMM,
u8 x s8 with VNNI) on weights quantised per output channel and activations per row (one
scale per token: it factors out of the integer product, so an embedding still does not
depend on the other texts of its pass). This script measures, side by side in one run:

1. ``roofline``: one core's float32 GEMM rate (numpy / OpenBLAS, 1 thread, GFLOP/s) at
   the encoder's feed-forward shape (512 x 384 x 1536) and at 2048^3, and the ONNX float32
   encoder's CPU ms per PersonaBench question at 1 / 32 / 64 texts per call with the
   useful GFLOP/s that makes (MiniLM-L6: 21.2 MFLOP per token, padding not counted);
2. ``qgemm``: one linear layer in ONNX Runtime (1 thread), float32 ``MatMul`` + ``Add``
   against the row-wise int8 subgraph (per-row absmax scale, ``Round``, +128 to uint8,
   ``MatMulInteger`` with the per-channel int8 weight and zero point 128, the two scales
   and the bias), CPU microseconds per call, best of ``--reps`` with the two interleaved,
   at the encoder's three shapes (384 -> 384, 384 -> 1536, 1536 -> 384) and 16 / 512 / 1024 rows;
3. ``quality`` (unless ``--skip-quality``): the same quantisation simulated in torch in
   every ``nn.Linear`` of the float32 torch encoder (fake quantisation: the values the
   int8 graph would compute, in float32), on PersonaBench's questions (the chunks stay
   float32, as the shipped int8 option does for texts over 64 tokens): 1 - cosine to
   float32, RF-Mem Recall@10 (paper config, noise 0.0) and identical routes, for all
   layers, the attention value projections in float32, the feed-forward down-projections
   in float32, and SmoothQuant (per-input-channel scales ``max|x|^a / max|w|^(1-a)``
   moved from the activations into the weights, calibrated on 512 LoCoMo turns: another
   data set, no PersonaBench text) at ``--alphas``.

The JSON (``--out``, default ``bench/results/local/int8-rowwise.json``) holds the machine (CPU
model, SIMD flags, BLAS kernel), versions, load average before and after and the exact
command. ``PYTHONPATH=$PWD python bench/bench_int8_rowwise.py``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

#: MiniLM-L6-H384: multiply-adds per token (6 layers: Q, K, V, attention output 384 x 384;
#: feed-forward 384 x 1536 and back), attention scores not counted
MACS_PER_TOKEN = 6 * (4 * 384 * 384 + 2 * 384 * 1536)
#: the encoder's linear shapes (in, out)
SHAPES = ((384, 384), (384, 1536), (1536, 384))


def linear_model(k: int, n: int, mode: str, seed: int = 0) -> tuple[bytes, np.ndarray, np.ndarray]:
    """An ONNX graph ``Y = X @ W + b`` (X float32 [M, k]) with a random W [k, n], b [n].

    Args:
        k, n: input / output width (ints >= 1).
        mode: "float32" (``MatMul`` + ``Add``) or "rowwise" (per-row int8 activations,
            per-column int8 weights, ``MatMulInteger``: module docstring, item 2).
        seed: seed of W and b.

    Returns:
        (serialised model, W float32 [k, n], b float32 [n]).

    Raises:
        ValueError: an unknown ``mode``.
    """
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    if mode not in ("float32", "rowwise"):
        raise ValueError(f"mode must be 'float32' or 'rowwise', got {mode!r}")
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    b = (rng.standard_normal(n) * 0.01).astype(np.float32)
    inits = [nh.from_array(b, "b")]
    if mode == "float32":
        inits.append(nh.from_array(w, "W"))
        nodes = [h.make_node("MatMul", ["X", "W"], ["mm"]), h.make_node("Add", ["mm", "b"], ["Y"])]
    else:
        wq, ws = quantize_columns(w)
        inits += [nh.from_array(wq, "Wq"), nh.from_array(ws, "ws"),
                  nh.from_array(np.array([-1], np.int64), "last"), nh.from_array(np.array(1 / 127, np.float32), "inv127"),
                  nh.from_array(np.array(1e-12, np.float32), "eps"), nh.from_array(np.array(128.0, np.float32), "c128"),
                  nh.from_array(np.array(128, np.uint8), "zp")]  # fmt: skip
        nodes = [
            h.make_node("Abs", ["X"], ["xa"]),
            h.make_node("ReduceMax", ["xa", "last"], ["xm"], keepdims=1),
            h.make_node("Max", ["xm", "eps"], ["xm2"]),
            h.make_node("Mul", ["xm2", "inv127"], ["s"]),  # [M, 1]: one scale per row
            h.make_node("Div", ["X", "s"], ["xs"]),
            h.make_node("Round", ["xs"], ["xr"]),
            h.make_node("Add", ["xr", "c128"], ["xu"]),
            h.make_node("Cast", ["xu"], ["xq"], to=T.UINT8),
            h.make_node("MatMulInteger", ["xq", "Wq", "zp"], ["acc"]),
            h.make_node("Cast", ["acc"], ["accf"], to=T.FLOAT),
            h.make_node("Mul", ["accf", "s"], ["y1"]),
            h.make_node("Mul", ["y1", "ws"], ["y2"]),
            h.make_node("Add", ["y2", "b"], ["Y"]),
        ]
    graph = h.make_graph(nodes, "linear", [h.make_tensor_value_info("X", T.FLOAT, ["M", k])],
                         [h.make_tensor_value_info("Y", T.FLOAT, ["M", n])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString(), w, b


def quantize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column: (int8 [k, n], float32 scales [n]) with w ~ q * s."""
    s = np.maximum(np.abs(w).max(0), 1e-12) / 127.0
    return np.clip(np.round(w / s), -127, 127).astype(np.int8), s.astype(np.float32)


def rowwise_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, saturate: bool = False) -> np.ndarray:
    """What the "rowwise" graph computes, in numpy (exact integers, float32 scaling).

    Args:
        x: float32 [m, k] activations; w: float32 [k, n] weights; b: float32 [n] bias.
        saturate: model ONNX Runtime's AVX2 u8 x s8 kernel (CPUs without VNNI / AMX:
            ``rfmem_fast.encoders.int8_dot()`` False): ``vpmaddubsw`` adds each pair of
            products of the uint8 activation (+128) and the int8 weight in int16 with
            saturation, so a pair beyond 32767 is clipped before the int32 sum (then the
            zero point's 128 * column sum is taken off). False: the exact integer product,
            what VNNI / AMX kernels compute.

    Returns:
        float32 [m, n].
    """
    wq, ws = quantize_columns(w)
    s = (np.maximum(np.abs(x).max(1, keepdims=True), np.float32(1e-12)) * np.float32(1 / 127)).astype(np.float32)
    xq = np.clip(np.round(x / s), -128, 127).astype(np.int64)
    wi = wq.astype(np.int64)
    if saturate:
        u = xq + 128
        if u.shape[1] % 2:  # an odd k: the kernel's last pair has a zero partner
            u, wi = np.pad(u, ((0, 0), (0, 1))), np.pad(wi, ((0, 1), (0, 0)))
        pairs = u[:, 0::2, None] * wi[None, 0::2] + u[:, 1::2, None] * wi[None, 1::2]  # [m, k/2, n]
        acc = np.clip(pairs, -32768, 32767).sum(1) - 128 * wi.sum(0)
    else:
        acc = xq @ wi
    return (acc.astype(np.float32) * s * ws + b).astype(np.float32)


def session(model: bytes) -> Any:
    """A one-thread ONNX Runtime CPU session of ``model``."""
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = 1, 1
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])


def bench_qgemm(rows: list[int], reps: int) -> list[dict[str, Any]]:
    """Item 2 of the module docstring: one dict per (shape, rows)."""
    out = []
    for k, n in SHAPES:
        sess = {m: session(linear_model(k, n, m)[0]) for m in ("float32", "rowwise")}
        _, w, b = linear_model(k, n, "float32")
        for m in rows:
            x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
            calls = max(3, int(3e7 / (m * k * n)))
            best = {name: float("inf") for name in sess}
            for _ in range(reps):
                for name, s in sess.items():  # interleaved
                    t = time.process_time()
                    for _ in range(calls):
                        s.run(None, {"X": x})
                    best[name] = min(best[name], (time.process_time() - t) / calls)
            y, ref = sess["rowwise"].run(None, {"X": x})[0], x @ w + b
            cell = {"in": k, "out": n, "rows": m, "float32_us": 1e6 * best["float32"], "rowwise_us": 1e6 * best["rowwise"],
                    "speedup": best["float32"] / best["rowwise"],
                    "rel_err_vs_float32": float(np.abs(y - ref).max() / np.abs(ref).max())}  # fmt: skip
            out.append(cell)
            print(f"  {k:4d} -> {n:4d}, {m:4d} rows: float32 {cell['float32_us']:8.0f} us, row-wise int8 "
                  f"{cell['rowwise_us']:8.0f} us ({cell['speedup']:.2f}x)", flush=True)
    return out


def bench_roofline(questions: list[str], reps: int) -> dict[str, Any]:
    """Item 1 of the module docstring."""
    from bench_encoder_precision import cpu_ms_per_text
    from threadpoolctl import threadpool_info, threadpool_limits

    from rfmem_fast.encoders import TextEncoder

    res: dict[str, Any] = {"sgemm_gflops": {}, "blas": [(i.get("internal_api"), i.get("architecture")) for i in threadpool_info()]}
    with threadpool_limits(1):
        for m, k, n in ((512, 384, 1536), (2048, 2048, 2048)):
            a, bm = np.random.rand(m, k).astype(np.float32), np.random.rand(k, n).astype(np.float32)
            best = float("inf")
            for _ in range(reps):
                t = time.process_time()
                for _ in range(5):
                    a @ bm
                best = min(best, (time.process_time() - t) / 5)
            res["sgemm_gflops"][f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e9
    enc = TextEncoder(show_progress=False, backend="onnx", dtype="float32", num_threads=1, batch_size=64)
    lens = np.array([len(enc._model.tokenizer(q)["input_ids"]) for q in questions])
    res["tokens_per_question_mean"] = float(lens.mean())
    res["encoder"] = []
    timed = questions[:256]
    enc.encode(timed[:64])  # warm-up
    for call in (1, 32, 64):
        cpu_ms, _ = cpu_ms_per_text(enc, timed, call, reps)
        gf = 2 * MACS_PER_TOKEN * float(lens[: len(timed)].mean()) / cpu_ms / 1e6
        res["encoder"].append({"texts_per_call": call, "cpu_ms_per_question": cpu_ms, "useful_gflops": gf})
        print(f"  ONNX float32, {call:2d} questions per call: {cpu_ms:.2f} ms CPU per question = {gf:.1f} useful GFLOP/s",
              flush=True)
    print(f"  one core's SGEMM (OpenBLAS, 1 thread): {res['sgemm_gflops']}", flush=True)
    return res


def bench_quality(alphas: list[float], data_dir: Path, locomo_dir: Path) -> list[dict[str, Any]]:
    """Item 3 of the module docstring."""
    import torch
    from bench_encoder_backends import _retrieval

    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.encoders import TextEncoder
    from rfmem_fast.evaluate import run_personabench

    data = load_personabench(data_dir, noise=0.0)
    questions = [q.question for q in data.questions]
    chunks = [t for u in data.users for t in u.chunk_texts]
    enc = TextEncoder(show_progress=False, dtype="float32", backend="torch")
    q0, x0 = enc.encode(questions), enc.encode(chunks)
    ref: dict[str, Any] = {}
    base = _retrieval(run_personabench, data_dir, enc, questions, chunks, q0, x0, ref)["rfmem"]["recall@10"]
    linears = [(n, m) for n, m in enc._model.named_modules() if isinstance(m, torch.nn.Linear)]
    forward = {n: m.forward for n, m in linears}

    turns = []
    for f in sorted(glob.glob(str(locomo_dir / "*.json"))):
        doc = json.loads(Path(f).read_text(encoding="utf-8"))
        turns += [t["text"] for k, v in doc.items() if k.startswith("session_") and isinstance(v, list)
                  for t in v if isinstance(t, dict) and t.get("text")]  # fmt: skip
    calib = [turns[i] for i in np.random.default_rng(0).choice(len(turns), min(512, len(turns)), replace=False)]
    amax: dict[str, Any] = {}

    def hook(name: str) -> Any:
        def f(mod: Any, inp: Any, out: Any) -> None:
            a = inp[0].detach().abs().reshape(-1, inp[0].shape[-1]).amax(0)
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return f

    hooks = [m.register_forward_hook(hook(n)) for n, m in linears]
    enc.encode(calib)
    for hk in hooks:
        hk.remove()

    def fake(m: Any, smooth: Any) -> Any:
        w = m.weight.data * smooth  # [out, in]; smooth = 1 or the SmoothQuant scales
        ws = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0
        wq = torch.round(w / ws).clamp(-127, 127) * ws

        def f(x: Any) -> Any:
            x = x / smooth
            s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
            return torch.nn.functional.linear(torch.round(x / s).clamp(-128, 127) * s, wq, m.bias)
        return f

    def is_ffn_down(n: str) -> bool:
        return n.endswith(".output.dense") and ".attention." not in n

    variants: list[tuple[str, float | None, Any]] = [
        ("every linear", None, lambda n: False),
        ("value projections float32", None, lambda n: n.endswith("attention.self.value")),
        ("feed-forward down float32", None, is_ffn_down),
    ] + [(f"SmoothQuant alpha {a}", a, lambda n: False) for a in alphas]
    out = []
    for name, alpha, keep in variants:
        for n, m in linears:
            if keep(n):
                m.forward = forward[n]
                continue
            smooth = 1.0
            if alpha is not None:
                smooth = amax[n].clamp_min(1e-5) ** alpha / m.weight.data.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
            m.forward = fake(m, smooth)
        try:
            q = enc.encode(questions)
        finally:
            for n, m in linears:
                m.forward = forward[n]
        cos = (q * q0).sum(1)
        cell = _retrieval(run_personabench, data_dir, enc, questions, chunks, q, x0, ref)
        row = {"variant": name, "one_minus_cos_mean": float(1 - cos.mean()), "cos_min": float(cos.min()),
               "rfmem_recall10": cell["rfmem"]["recall@10"], "recall10_delta_points": 100 * (cell["rfmem"]["recall@10"] - base),
               "identical_routes": cell["identical_routes"]}  # fmt: skip
        out.append(row)
        print(f"  {name:28s} 1-cos mean {row['one_minus_cos_mean']:.1e}, cos min {row['cos_min']:.5f}, RF-Mem "
              f"Recall@10 {row['recall10_delta_points']:+.2f} points, routes identical {row['identical_routes']:.4f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from rfmem_fast.bench.cli import _loadavg, versions
    from rfmem_fast.bench.workloads import default_personabench_dir
    from rfmem_fast.evaluate import machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "int8-rowwise.json"))
    p.add_argument("--reps", type=int, default=5, help="repetitions per timing cell (best of; default 5)")
    p.add_argument("--rows", default="16,512,1024", help="rows per linear call in the qgemm part (default 16,512,1024)")
    p.add_argument("--alphas", default="0.5,0.8", help="SmoothQuant migration strengths (default 0.5,0.8)")
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: the shared data)")
    p.add_argument("--locomo", default=None, help="LoCoMo folder for the calibration turns (default: the shared data)")
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1:
        p.error(f"--rows must be a comma list of ints >= 1, got {args.rows!r}")
    data_dir = Path(args.data) if args.data else default_personabench_dir()
    import onnxruntime

    doc: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine_info(),
                           "versions": {**versions(), "onnxruntime": onnxruntime.__version__},
                           "load": {"loadavg_start": _loadavg()}, "settings": vars(args)}  # fmt: skip
    from bench_encoder_backends import cpu_flags

    doc["machine"]["simd"] = cpu_flags()
    print("qgemm: one linear layer, ONNX Runtime, 1 thread", flush=True)
    doc["qgemm"] = bench_qgemm(rows, args.reps)
    if not args.skip_roofline:
        from rfmem_fast.datasets import load_personabench

        print("roofline", flush=True)
        qs = [q.question for q in load_personabench(data_dir, noise=0.0).questions]
        doc["roofline"] = bench_roofline(qs, args.reps)
    if not args.skip_quality:
        locomo = Path(args.locomo) if args.locomo else data_dir.parents[1] / "locomo"
        print("quality: fake-quantised torch float32 encoder on PersonaBench questions", flush=True)
        doc["quality"] = bench_quality([float(a) for a in args.alphas.split(",") if a.strip()], data_dir, locomo)
    doc["load"]["loadavg_end"] = _loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
