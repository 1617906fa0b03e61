"""The forward passes of an encode call, shared by the torch and the ONNX runtimes
(:class:`rfmem_fast.encoders.TextEncoder`): the texts tokenised with the model's own
``preprocess``, sorted by token count and cut into passes of similar lengths, each padded
to its own longest text (:func:`_passes`, :data:`PASS_LENGTH_RATIO`).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

#: a forward pass (torch and ONNX) holds texts with at least this fraction of the tokens
#: of its longest one (fewer start a new pass: less padding, :func:`_passes`)
PASS_LENGTH_RATIO = 0.75


def _passes(st_model: Any, items: list[str], batch_size: int,
            split_at: int | None = None) -> Iterator[tuple[np.ndarray, dict[str, Any], bool]]:
    """The forward passes that embed ``items``, shared by the torch and the ONNX paths.

    The texts are tokenised with the model's own ``preprocess`` (its ids, truncation
    and padding), ``max(1024, 16 * batch_size)`` texts at a time (bounded memory
    for long lists), sorted by token count, longest first, and cut into passes of at
    most ``batch_size`` texts, a new pass starting where a text has fewer than
    :data:`PASS_LENGTH_RATIO` times the tokens of the pass's first (longest) one, or,
    with ``split_at``, where the texts fall to ``split_at`` tokens or fewer (a pass
    holds texts of one side only). Each pass is padded to its own longest text (right
    padding: the columns past it are dropped). Padding changes nothing but float
    rounding (cosine > 0.99999 between a text alone and in a batch); it only costs
    time, which this saves: 64 PersonaBench questions padded to the longest of them
    (85 tokens; 15.6 on average) are ~4x the tokens (torch bfloat16, one core of an
    Intel Xeon with AMX: 6.5 ms of CPU per question in one pass, 2.2-2.7 in passes
    cut this way).

    Args:
        st_model: the ``SentenceTransformer``.
        items: n >= 1 str.
        batch_size: the most texts per pass (int >= 1).
        split_at: None, or a token count (int) the passes do not straddle.

    Yields:
        ``(rows, features, long)``: ``rows`` int64 ``[m]``, the indices into ``items``
        of the pass's texts; ``features`` the model's input dict for them (2-D tensors
        ``[m, width]`` sliced from ``preprocess``; other entries as ``preprocess`` gave
        them); ``long`` whether they have more than ``split_at`` tokens (False without).
    """
    import torch

    block = max(1024, 16 * batch_size)
    for b0 in range(0, len(items), block):
        feats = st_model.preprocess(items[b0:b0 + block])
        mask = feats["attention_mask"]
        lengths = mask.sum(dim=1).numpy()
        n = len(lengths)
        right_padded = n == 0 or mask.shape[1] == 0 or bool(torch.all(mask[:, 0] == 1))
        order = np.argsort(-lengths, kind="stable")
        start = 0
        while start < n:
            first = int(lengths[order[start]])
            long = split_at is not None and first > split_at
            stop = start + 1
            while (stop < n and stop - start < batch_size and lengths[order[stop]] >= PASS_LENGTH_RATIO * first
                   and (not long or lengths[order[stop]] > split_at)):
                stop += 1
            rows = order[start:stop]
            width = max(first, 1) if right_padded else mask.shape[1]
            picked = torch.from_numpy(rows)
            yield b0 + rows, {k: (v[picked, :width].contiguous() if isinstance(v, torch.Tensor) and v.ndim == 2 else v)
                              for k, v in feats.items()}, long
            start = stop
