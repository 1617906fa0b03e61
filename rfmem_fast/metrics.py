"""Retrieval metrics of the PersonaBench protocol (RFMEM_SPEC.md section 6).

The ground truth of one question is a mapping ``{answer alternative: [segment ids]}``.
A question is answered by *one id per alternative*: the cartesian product of the
alternatives' id lists (``itertools.product``) gives every acceptable combination, each
taken as a set. Recall@k and NDCG@k are computed against each combination and the
best value over the combinations is kept (recall and NDCG maximised independently),
exactly as the PersonaBench evaluator used by the RF-Mem reference code does.

Per-category aggregation (:func:`aggregate`) follows the same evaluator: the category
is type + difficulty for "Preference" questions and type + "easy" otherwise, plus an
"Overall" entry. Questions of type "Subjective" are *not* scored by the protocol; the
caller must drop them before calling :func:`aggregate` (see
``rfmem_fast.datasets.personabench.PersonaBench.evaluated``).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Iterable, Mapping, Sequence

__all__ = [
    "recall_at_k",
    "ndcg_at_k",
    "recall_ndcg_at_k",
    "question_category",
    "aggregate",
    "OVERALL",
]

#: Key of the all-questions entry returned by :func:`aggregate`.
OVERALL = "Overall"


def _check_k(k: int) -> int:
    """Return ``k`` as an int, or raise TypeError / ValueError naming ``k``."""
    if isinstance(k, bool):
        raise TypeError(f"k must be an int >= 1, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"k must be an int >= 1, got {k!r} ({type(k).__name__})") from None
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return k


def _combo_scores(retrieved_k: Sequence[str], combo: set[str], k: int) -> tuple[float, float]:
    """Recall and NDCG of the top-k list ``retrieved_k`` against one ground-truth set."""
    if not combo:
        return 0.0, 0.0
    recall = len(set(retrieved_k) & combo) / len(combo)
    # DCG counts every position whose id is in the combo (a duplicated retrieved id
    # counts at each of its positions, as in the reference evaluator).
    dcg = 0.0
    for i, seg in enumerate(retrieved_k):
        if seg in combo:
            dcg += 1.0 / math.log2(i + 2)
    idcg = 0.0
    for i in range(min(len(combo), k)):
        idcg += 1.0 / math.log2(i + 2)
    ndcg = dcg / idcg if idcg > 0 else 0.0
    return recall, ndcg


def recall_ndcg_at_k(
    retrieved: Sequence[str], gt: Mapping[str, Sequence[str]], k: int
) -> tuple[float, float]:
    """Recall@k and NDCG@k of one question, best over ground-truth combinations.

    Implements RFMEM_SPEC.md section 6 (the PersonaBench evaluator).

    Args:
        retrieved: ranked segment ids (best first), any length; only ``retrieved[:k]``
            is used. Duplicates are allowed (recall counts a set, DCG every position).
        gt: ``{answer alternative: [segment ids]}``. The combinations are the
            cartesian product of the alternatives' lists, each taken as a set. An
            alternative with an empty list yields no combination at all.
        k: cutoff, an int >= 1.

    Returns:
        ``(recall, ndcg)``, two floats, each the maximum over the combinations
        (taken independently). Both lie in [0, 1] when ``retrieved[:k]`` has no
        duplicates; a duplicated relevant id adds DCG at each of its positions (as
        the reference does), so NDCG can then exceed 1. An empty ``gt`` (or no combination) gives
        ``(0.0, 0.0)``; an empty combination scores 0.

    Raises:
        ValueError: if ``k < 1`` (message names ``k``).
        TypeError: if ``k`` is not an integer (bool refused; numpy ints accepted).
    """
    k = _check_k(k)
    if not gt:
        return 0.0, 0.0
    top = list(retrieved[:k])
    best_recall, best_ndcg = 0.0, 0.0
    for combo in itertools.product(*gt.values()):
        recall, ndcg = _combo_scores(top, set(combo), k)
        if recall > best_recall:
            best_recall = recall
        if ndcg > best_ndcg:
            best_ndcg = ndcg
    return best_recall, best_ndcg


def recall_at_k(retrieved: Sequence[str], gt: Mapping[str, Sequence[str]], k: int) -> float:
    """Recall@k of one question: max over ground-truth combinations of
    ``|set(retrieved[:k]) & combo| / |combo|``.

    Implements RFMEM_SPEC.md section 6. Arguments, return range and errors as in
    :func:`recall_ndcg_at_k` (returns its first element).
    """
    return recall_ndcg_at_k(retrieved, gt, k)[0]


def ndcg_at_k(retrieved: Sequence[str], gt: Mapping[str, Sequence[str]], k: int) -> float:
    """NDCG@k of one question: max over ground-truth combinations of DCG / IDCG, with
    ``DCG = sum_{i: retrieved[:k][i] in combo} 1/log2(i+2)`` and
    ``IDCG = sum_{i < min(|combo|, k)} 1/log2(i+2)`` (0 when IDCG is 0).

    Implements RFMEM_SPEC.md section 6. Arguments, return range and errors as in
    :func:`recall_ndcg_at_k` (returns its second element).
    """
    return recall_ndcg_at_k(retrieved, gt, k)[1]


def question_category(type: str, difficulty: str) -> str:  # noqa: A002 - protocol name
    """Category label of a question, as the PersonaBench evaluator forms it.

    ``"_".join(type.split(" ") + d.split(" "))`` where ``d = difficulty`` when
    ``type == "Preference"`` and ``d = "easy"`` otherwise, e.g.
    ``("Basic information", "hard") -> "Basic_information_easy"``,
    ``("Preference", "hard") -> "Preference_hard"``, ``("Social", "easy") ->
    "Social_easy"``. Implements RFMEM_SPEC.md section 6.

    Args:
        type: the question type (str).
        difficulty: the question difficulty (str; ignored unless type is "Preference").

    Returns:
        The category string.

    Raises:
        TypeError: if ``type`` or ``difficulty`` is not a str.
    """
    if not isinstance(type, str) or not isinstance(difficulty, str):
        raise TypeError(
            f"type and difficulty must be str, got {type!r} and {difficulty!r}"
        )
    d = difficulty if type == "Preference" else "easy"
    return "_".join(type.split(" ") + d.split(" "))


def aggregate(rows: Iterable[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Mean recall and NDCG per category and overall (RFMEM_SPEC.md section 6).

    The caller must already have dropped the questions of type "Subjective" (the
    protocol does not score them; ``PersonaBench.evaluated`` gives the scored ones).

    Args:
        rows: iterable of ``(category, recall, ndcg)``, e.g. category from
            :func:`question_category` and the two values from :func:`recall_ndcg_at_k`.

    Returns:
        ``{category: {"recall": mean, "ndcg": mean, "count": n}}`` with categories in
        first-seen order, followed by ``"Overall"`` over all rows. Means are unrounded
        floats; ``count`` is the number of rows (an int). No rows gives
        ``{"Overall": {"recall": 0.0, "ndcg": 0.0, "count": 0}}``.

    Raises:
        ValueError: if a row does not have three fields, a category is not a str, or
            a value is not a finite number; or if a category is named "Overall".
    """
    sums: dict[str, list[float]] = {}
    tot = [0.0, 0.0, 0]
    for row in rows:
        try:
            cat, rec, nd = row
        except (TypeError, ValueError):
            raise ValueError(f"each row must be (category, recall, ndcg), got {row!r}") from None
        if not isinstance(cat, str):
            raise ValueError(f"category must be a str, got {cat!r}")
        if cat == OVERALL:
            raise ValueError(f"category name {OVERALL!r} is reserved")
        try:
            rec_f, nd_f = float(rec), float(nd)
        except (TypeError, ValueError):
            raise ValueError(f"recall and ndcg must be numbers, got {row!r}") from None
        if not (math.isfinite(rec_f) and math.isfinite(nd_f)):
            raise ValueError(f"recall and ndcg must be finite, got {row!r}")
        acc = sums.setdefault(cat, [0.0, 0.0, 0])
        acc[0] += rec_f
        acc[1] += nd_f
        acc[2] += 1
        tot[0] += rec_f
        tot[1] += nd_f
        tot[2] += 1

    def _means(acc: list[float]) -> dict[str, float]:
        n = int(acc[2])
        if n == 0:
            return {"recall": 0.0, "ndcg": 0.0, "count": 0}
        return {"recall": acc[0] / n, "ndcg": acc[1] / n, "count": n}

    out = {cat: _means(acc) for cat, acc in sums.items()}
    out[OVERALL] = _means(tot)
    return out
