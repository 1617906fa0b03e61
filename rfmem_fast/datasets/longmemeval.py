"""LongMemEval loader and retrieval metrics, as the authors' retrieval code defines them.

LongMemEval (Wu et al., ICLR 2025; xiaowu0162/LongMemEval). A file (``longmemeval_s.json``,
``longmemeval_m.json``, ``longmemeval_oracle.json``) is a JSON list of question objects
with ``question_id``, ``question_type``, ``question``, ``answer``, ``question_date``,
``haystack_session_ids``, ``haystack_dates``, ``haystack_sessions`` (a list of sessions,
each a list of turns ``{"role": "user" | "assistant", "content": str, "has_answer":
bool?}``) and ``answer_session_ids``.

Protocol (``src/retrieval/run_retrieval.py`` and ``src/retrieval/eval_utils.py`` of the
authors' repository, reproduced here):

* one memory-bank user per question (its own haystack), key = ``question_id``;
* **session** granularity: one item per session, text = the session's *user* turns'
  contents joined by one space; id = the session id, except that a session whose id
  contains "answer" but none of whose user turns has ``has_answer`` true gets the id
  with "answer" replaced by "noans";
* **turn** granularity: one item per *user* turn, text = its content; id =
  ``f"{session_id}_{i + 1}"`` with i the turn's index in the session (assistant turns
  counted); in a session whose id contains "answer", a turn without ``has_answer`` true
  gets the id with "answer" replaced by "noans"; its conversation thread is its session
  (the haystack session id) and its position i (``User.item_threads`` /
  ``item_positions``: the context score, docs "Conversations"); a session-level item is a
  whole session, of no thread (the haystack's sessions are separate conversations);
* ground truth = the item ids that contain "answer" (after those replacements): the
  evidence sessions, or the ``has_answer`` turns of the evidence sessions;
* metrics at k, of the ranked ids: ``recall_any`` = 1.0 if any ground-truth id is in the
  top k, ``recall_all`` = 1.0 if all are (1.0 for an empty ground truth, as Python's
  ``all([])``), ``ndcg_any`` = DCG@k / ideal DCG@k with DCG of a 0/1 relevance list
  ``r[0] + sum_{i >= 1} r[i] / log2(i + 1)`` (the authors' ``dcg``: ranks 1 and 2 both
  weigh 1) and the ideal over the whole haystack's relevances sorted;
* with turn granularity the session-level figures are also computed from the turn
  ranking (``evaluate_retrieval_turn2session``): turn ids stripped of their last
  ``_``-part, k raised until the top holds k distinct sessions (or the haystack is
  exhausted), then the metrics above on the stripped ids (``session_*`` here);
* abstention questions (``"_abs"`` in ``question_id``) are loaded but not scored
  (``scored`` False), as the authors' averages skip them.

Differences, all documented: an answer-session user turn without ``has_answer`` counts
as ``has_answer: false`` (the authors' code asserts the key); a haystack that lists the
same item id twice keeps its first occurrence (a bank holds an id once; counted in
``Dataset.stats["duplicate_items_dropped"]``); the metrics read the ranked list the
search returns (``out_k`` items), so ``session_*`` figures of a turn-level run need
``out_k`` at least the raised k (pass ``--set out_k=50`` when in doubt).

``"recall"`` of :func:`longmemeval_score` is ``recall_all`` and ``"ndcg"`` is
``ndcg_any`` (the figures the authors' ``print_retrieval_metrics.py`` prints).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .base import Dataset, Question, User

__all__ = [
    "load_longmemeval",
    "longmemeval_score",
    "evaluate_retrieval",
    "evaluate_retrieval_turn2session",
    "lme_dcg",
    "lme_ndcg",
    "session_items",
    "LMETruth",
    "GRANULARITIES",
]

#: Item granularities of the retrieval protocol.
GRANULARITIES = ("session", "turn")
_REQUIRED = ("question_id", "question_type", "question", "haystack_session_ids", "haystack_sessions")


@dataclass(frozen=True)
class LMETruth:
    """Ground truth of one LongMemEval question.

    Attributes:
        correct: ground-truth item ids (tuple[str], sorted; ids holding "answer").
        corpus_ids: every item id of the question's haystack, in order (list[str]).
        granularity: "session" or "turn".
    """

    correct: tuple[str, ...]
    corpus_ids: list[str]
    granularity: str


def lme_dcg(relevances: Sequence[float], k: int) -> float:
    """The authors' DCG@k of a relevance list: ``r[0] + sum_{i=1}^{m-1} r[i] / log2(i + 1)``, m = min(len, k).

    Args:
        relevances: relevance per rank (floats), best rank first.
        k: cut-off (int >= 1).

    Returns:
        float (0.0 for an empty list).
    """
    r = np.asarray(relevances, dtype=np.float64)[:k]
    if r.size:
        return float(r[0] + np.sum(r[1:] / np.log2(np.arange(2, r.size + 1))))
    return 0.0


def lme_ndcg(ranked: Sequence[str], correct: Sequence[str], corpus_ids: Sequence[str], k: int) -> float:
    """The authors' NDCG@k: DCG of the top k of ``ranked`` over the ideal DCG of the whole corpus.

    Args:
        ranked: ranked corpus ids (best first; may be a prefix of the full ranking).
        correct: ground-truth ids.
        corpus_ids: every corpus id (their relevances, sorted, give the ideal).
        k: cut-off (int >= 1).

    Returns:
        float in [0, 1] (0.0 when the corpus holds no relevant id).
    """
    good = set(correct)
    ideal = lme_dcg(sorted((1.0 if c in good else 0.0 for c in corpus_ids), reverse=True), k)
    if ideal == 0:
        return 0.0
    return lme_dcg([1.0 if c in good else 0.0 for c in list(ranked)[:k]], k) / ideal


def evaluate_retrieval(
    ranked: Sequence[str], correct: Sequence[str], corpus_ids: Sequence[str], k: int
) -> tuple[float, float, float]:
    """(recall_any@k, recall_all@k, ndcg_any@k) of one ranking, as ``eval_utils.evaluate_retrieval``.

    Args:
        ranked: ranked corpus ids (best first).
        correct: ground-truth ids.
        corpus_ids: every corpus id.
        k: cut-off (int >= 1).

    Returns:
        Three floats: recall_any and recall_all in {0.0, 1.0}, ndcg_any in [0, 1].

    Raises:
        TypeError / ValueError: ``k`` not an int >= 1.
    """
    from ..metrics import _check_k

    k = _check_k(k)
    top = set(list(ranked)[:k])
    recall_any = float(any(c in top for c in correct))
    recall_all = float(all(c in top for c in correct))
    return recall_any, recall_all, lme_ndcg(ranked, correct, corpus_ids, k)


def _strip_turn(doc_id: str) -> str:
    return "_".join(doc_id.split("_")[:-1])


def evaluate_retrieval_turn2session(
    ranked: Sequence[str], correct: Sequence[str], corpus_ids: Sequence[str], k: int
) -> tuple[float, float, float]:
    """Session-level (recall_any, recall_all, ndcg_any)@k of a turn ranking (``evaluate_retrieval_turn2session``).

    Turn ids lose their last ``_``-separated part; k grows (at most to
    ``len(corpus_ids) + 1``) until the top of the ranking holds k distinct sessions;
    then :func:`evaluate_retrieval` on the stripped ids at that k.

    Args, Returns, Raises: as :func:`evaluate_retrieval` (turn-level ids).
    """
    from ..metrics import _check_k

    k = _check_k(k)
    correct_s = list(dict.fromkeys(_strip_turn(x) for x in correct))
    corpus_s = [_strip_turn(x) for x in corpus_ids]
    ranked_s = [_strip_turn(str(x)) for x in ranked]
    eff = k
    while eff <= len(corpus_s) and len(set(ranked_s[:eff])) < k:
        eff += 1
    return evaluate_retrieval(ranked_s, correct_s, corpus_s, eff)


def longmemeval_score(question: Question, retrieved: Sequence[str], k: int) -> dict[str, float]:
    """LongMemEval metrics of one question at k (module docstring).

    Args:
        question: a Question whose ``ground_truth`` is an :class:`LMETruth`.
        retrieved: ranked item ids (best first).
        k: cut-off, int >= 1.

    Returns:
        ``{"recall" (= recall_all), "ndcg" (= ndcg_any), "recall_any", "recall_all",
        "ndcg_any"}`` and, for turn granularity, ``"session_recall_any"``,
        ``"session_recall_all"``, ``"session_ndcg_any"`` (floats).

    Raises:
        TypeError / ValueError: ``k`` not an int >= 1.
    """
    gt: LMETruth = question.ground_truth
    ranked = [str(x) for x in retrieved]
    ra, rl, nd = evaluate_retrieval(ranked, gt.correct, gt.corpus_ids, k)
    out = {"recall": rl, "ndcg": nd, "recall_any": ra, "recall_all": rl, "ndcg_any": nd}
    if gt.granularity == "turn":
        sa, sl, sn = evaluate_retrieval_turn2session(ranked, gt.correct, gt.corpus_ids, k)
        out.update({"session_recall_any": sa, "session_recall_all": sl, "session_ndcg_any": sn})
    return out


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def session_items(session: Sequence[Any], session_id: str, granularity: str, where: str = "session") -> tuple[list[str], list[str]]:
    """(ids, texts) of one haystack session, as the authors' ``process_item_flat_index``.

    Args:
        session: list of turns ``{"role", "content", "has_answer"?}``.
        session_id: the session's id (str).
        granularity: "session" (one item: user contents joined by " ") or "turn"
            (one item per user turn, id ``f"{session_id}_{i + 1}"``).
        where: location for error messages.

    Returns:
        (ids, texts), two aligned lists of str.

    Raises:
        ValueError: a turn that is not an object with str ``role`` and ``content``, or a
            non-bool ``has_answer`` (the message names the field); unknown granularity.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if not isinstance(session, list):
        raise _bad(where, f"must be a list of turns, got {type(session).__name__}")
    evidence = "answer" in session_id
    user_turns: list[tuple[int, str, bool]] = []
    for i, t in enumerate(session):
        if not isinstance(t, dict):
            raise _bad(f"{where}[{i}]", "a turn must be an object")
        for f in ("role", "content"):
            if not isinstance(t.get(f), str):
                raise _bad(f"{where}[{i}]", f"has no str {f!r}")
        ha = t.get("has_answer", False)
        if not isinstance(ha, bool):
            raise _bad(f"{where}[{i}]", f"'has_answer' must be true or false, got {ha!r}")
        if t["role"] == "user":
            user_turns.append((i, t["content"], ha))
    if granularity == "session":
        sid = session_id
        if evidence and not any(ha for _, _, ha in user_turns):
            sid = session_id.replace("answer", "noans")
        return [sid], [" ".join(c for _, c, _ in user_turns)]
    ids, texts = [], []
    for i, content, ha in user_turns:
        tid = f"{session_id}_{i + 1}"
        if evidence and not ha:
            tid = tid.replace("answer", "noans")
        ids.append(tid)
        texts.append(content)
    return ids, texts


def load_longmemeval(path: str | os.PathLike[str], granularity: str = "session", limit: int | None = None) -> Dataset:
    """Load a LongMemEval file (``longmemeval_s.json`` / ``_m`` / ``_oracle``) for retrieval.

    Args:
        path: the JSON file (a list of question objects, module docstring).
        granularity: "session" (one item per session) or "turn" (one per user turn).
        limit: load only the first ``limit`` questions (int >= 1; None: all).

    Returns:
        :class:`~rfmem_fast.datasets.base.Dataset` named "longmemeval": one user per
        question (key ``question_id``, items its haystack), questions with
        ``ground_truth`` an :class:`LMETruth`, ``category`` = ``question_type``,
        ``scored`` False for abstention questions, ``info`` = answer, question_date,
        answer_session_ids.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: not valid JSON, not a list, a question lacking a required field
            (``question_id``, ``question_type``, ``question``, ``haystack_session_ids``,
            ``haystack_sessions``) or with a field of the wrong type or length (the
            message names the question and the field), a repeated ``question_id``, a
            question with an empty haystack; bad ``granularity`` or ``limit``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    p = Path(os.fspath(path)).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"LongMemEval file not found: {str(p)!r} (expected e.g. longmemeval_s.json)")
    try:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(p)!r} is not valid JSON: {exc}") from exc
    if not isinstance(doc, list):
        raise ValueError(f"{str(p)!r}: top level must be a list of question objects, got {type(doc).__name__}")
    users: list[User] = []
    questions: list[Question] = []
    stats = {"abstention": 0, "duplicate_items_dropped": 0, "no_ground_truth": 0}
    seen_q: set[str] = set()
    for n, e in enumerate(doc[:limit] if limit else doc):
        where = f"{str(p)!r} entry {n}"
        if not isinstance(e, dict):
            raise _bad(where, "must be an object")
        for f in _REQUIRED:
            if f not in e:
                raise _bad(where, f"has no {f!r}")
        qid = e["question_id"]
        if not isinstance(qid, str):
            raise _bad(where, "'question_id' must be a str")
        where = f"{str(p)!r} question {qid!r}"
        if qid in seen_q:
            raise _bad(where, "repeated 'question_id'")
        seen_q.add(qid)
        for f in ("question_type", "question"):
            if not isinstance(e[f], str):
                raise _bad(where, f"{f!r} must be a str")
        sids, sessions = e["haystack_session_ids"], e["haystack_sessions"]
        if not isinstance(sids, list) or not all(isinstance(s, str) for s in sids):
            raise _bad(where, "'haystack_session_ids' must be a list of str")
        if not isinstance(sessions, list) or len(sessions) != len(sids):
            raise _bad(where, f"'haystack_sessions' must be a list as long as 'haystack_session_ids' ({len(sids)})")
        dates = e.get("haystack_dates")
        if dates is not None and (not isinstance(dates, list) or len(dates) != len(sids)):
            raise _bad(where, f"'haystack_dates' must be a list as long as 'haystack_session_ids' ({len(sids)})")
        ids: list[str] = []
        texts: list[str] = []
        threads: list[str] = []
        positions: list[int] = []
        have: set[str] = set()
        for j, (sid, sess) in enumerate(zip(sids, sessions)):
            s_ids, s_texts = session_items(sess, sid, granularity, f"{where} haystack_sessions[{j}]")
            for i, t in zip(s_ids, s_texts):
                if i in have:
                    stats["duplicate_items_dropped"] += 1
                    continue
                have.add(i)
                ids.append(i)
                texts.append(t)
                if granularity == "turn":  # (the turn's index in the session: the id's last "_" part, minus 1)
                    threads.append(sid)
                    positions.append(int(i.rsplit("_", 1)[1]) - 1)
        if not ids:
            raise _bad(where, f"its haystack has no user turn (granularity {granularity!r})")
        correct = tuple(sorted(i for i in ids if "answer" in i))
        scored = "_abs" not in qid
        stats["abstention"] += not scored
        stats["no_ground_truth"] += scored and not correct
        users.append(User(key=qid, item_ids=ids, item_texts=texts, item_threads=threads or None,
                          item_positions=positions or None))  # fmt: skip
        questions.append(
            Question(
                qid=qid, text=e["question"], user_key=qid, ground_truth=LMETruth(correct, ids, granularity),
                category=e["question_type"], scored=scored,
                info={"answer": e.get("answer"), "question_date": e.get("question_date"),
                      "answer_session_ids": e.get("answer_session_ids"), "granularity": granularity},
            )  # fmt: skip
        )
    if not questions:
        raise ValueError(f"{str(p)!r}: no question")
    names = ("recall", "ndcg", "recall_any", "recall_all", "ndcg_any")
    if granularity == "turn":
        names += ("session_recall_any", "session_recall_all", "session_ndcg_any")
    notes = [f"granularity {granularity}; {stats['abstention']} abstention questions loaded but not scored"]
    if stats["duplicate_items_dropped"]:
        notes.append(f"{stats['duplicate_items_dropped']} repeated item ids dropped (first occurrence kept)")
    if stats["no_ground_truth"]:
        notes.append(f"{stats['no_ground_truth']} scored questions have no ground-truth item (recall_all counts 1)")
    return Dataset(name="longmemeval", users=users, questions=questions, metric_names=names, scorer=longmemeval_score,
                   notes=notes, stats=stats)  # fmt: skip
