"""LoCoMo loader, turn-level retrieval protocol (``shared/data/locomo/SOURCE.md``).

LoCoMo ("Evaluating Very Long-Term Conversational Memory of LLM Agents", ACL 2024;
snap-research/locomo, CC BY-NC 4.0). ``DIR`` holds one JSON file per conversation
(``26.json``, ...), each with ``speaker_a``, ``speaker_b``, ``session_N_date_time``
and ``session_N`` (a list of turns ``{speaker, dia_id, text, [img_url, blip_caption,
query]}``) for N = 1, 2, ..., and ``qa`` (a list of ``{question, answer, evidence:
[dia_id, ...], category}``).

Protocol:

* one memory bank user per conversation, its key the file stem (e.g. "26");
* one item per turn, sessions in N order and turns in file order, id = ``dia_id``,
  text ``"[{session_N_date_time}] {speaker}: {text}"`` plus ``" [shares
  {blip_caption}]"`` when the turn has a ``blip_caption`` (it shares an image); its
  conversation thread is its session (``"session_N"``) and its position the turn's index
  in the session (``User.item_threads`` / ``item_positions``: the context score,
  docs "Conversations");
* questions of category 5 (adversarial) and those with no evidence are left out (760
  questions in the five development conversations); question category = ``str(category)``;
* Recall@k = |top-k ids ∩ evidence| / |evidence| (evidence as a set), averaged over
  questions; NDCG@k = DCG / IDCG with DCG = sum over top-k positions i (0-based) holding
  an evidence id of 1 / log2(i + 2) and IDCG = sum_{i < min(|evidence|, k)} 1 / log2(i + 2).

Malformed evidence (a few entries of the published files): every evidence string is
split on ";" and "," and each part stripped (``"D8:6; D9:17"`` -> ``{"D8:6", "D9:17"}``;
empty parts dropped). An id that is not among the conversation's turns (e.g. "D10:19"
in a session that has fewer turns, "D:11:26", "D") *stays* in the evidence set: no
retriever can return it, so it counts as missed. The loader counts both cases
(``Dataset.stats``: "evidence_split" strings split, "evidence_absent" ids absent) and
says so in ``Dataset.notes``.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

from .base import Dataset, Question, User

__all__ = ["load_locomo", "locomo_turn_text", "parse_evidence", "locomo_score", "ADVERSARIAL", "LOCOMO_METRICS"]

#: Category of the adversarial questions (no answer), left out by the protocol.
ADVERSARIAL = 5
#: Metric names of :func:`locomo_score`.
LOCOMO_METRICS = ("recall", "ndcg")
_SESSION = re.compile(r"session_(\d+)")


def locomo_turn_text(turn: dict[str, Any], date: str) -> str:
    """Item text of one turn: ``"[{date}] {speaker}: {text}"`` + ``" [shares {blip_caption}]"`` if present.

    Args:
        turn: a turn object (``speaker``, ``text``, optional ``blip_caption``).
        date: the session's ``session_N_date_time`` (str).

    Returns:
        The text (str).

    Raises:
        KeyError: the turn lacks ``speaker`` or ``text``.
    """
    text = f"[{date}] {turn['speaker']}: {turn['text']}"
    cap = turn.get("blip_caption")
    if cap:
        text += f" [shares {cap}]"
    return text


def parse_evidence(evidence: Sequence[Any]) -> tuple[list[str], int]:
    """Evidence ids of one question, malformed entries split.

    Each entry is turned into a str, split on ";" and ",", each part stripped, empty
    parts dropped; the order of first appearance is kept and repeats removed.

    Args:
        evidence: the question's ``evidence`` list.

    Returns:
        (ids, n_split): the ids (list[str]) and how many entries held more than one id.
    """
    out: dict[str, None] = {}
    n_split = 0
    for e in evidence:
        parts = [p.strip() for p in re.split(r"[;,]", str(e))]
        parts = [p for p in parts if p]
        if len(parts) > 1:
            n_split += 1
        for p in parts:
            out.setdefault(p, None)
    return list(out), n_split


def locomo_score(question: Question, retrieved: Sequence[str], k: int) -> dict[str, float]:
    """Recall@k and NDCG@k of one LoCoMo question (the module's definitions).

    Args:
        question: a :class:`~rfmem_fast.datasets.base.Question` whose ``ground_truth`` is
            its evidence ids (list[str], non-empty).
        retrieved: ranked ids (best first); only the first k count.
        k: cut-off, int >= 1.

    Returns:
        ``{"recall": float in [0, 1], "ndcg": float in [0, 1]}`` (0.0 for an empty evidence).

    Raises:
        TypeError / ValueError: ``k`` not an int >= 1.
    """
    from ..metrics import _check_k

    k = _check_k(k)
    ev = set(question.ground_truth)
    if not ev:
        return {"recall": 0.0, "ndcg": 0.0}
    top = [str(x) for x in list(retrieved)[:k]]
    recall = len(set(top) & ev) / len(ev)
    seen: set[str] = set()
    dcg = 0.0
    for i, x in enumerate(top):
        if x in ev and x not in seen:
            dcg += 1.0 / math.log2(i + 2)
            seen.add(x)
    idcg = sum(1.0 / math.log2(i + 2) for i in range(min(len(ev), k)))
    return {"recall": recall, "ndcg": dcg / idcg}


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"{str(path)!r}: {what}")


def _conversation(path: Path) -> tuple[User, list[Question], dict[str, int]]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise _bad(path, f"top level must be an object, got {type(doc).__name__}")
    if "qa" not in doc or not isinstance(doc["qa"], list):
        raise _bad(path, "no 'qa' list (expected a LoCoMo conversation file)")
    user = path.stem
    sessions = sorted((int(m.group(1)), key) for key in doc if (m := _SESSION.fullmatch(key)))
    if not sessions:
        raise _bad(path, "no 'session_N' lists (expected a LoCoMo conversation file)")
    ids: list[str] = []
    texts: list[str] = []
    threads: list[str] = []
    positions: list[int] = []
    seen: set[str] = set()
    for n, key in sessions:
        turns = doc[key]
        if not isinstance(turns, list):
            raise _bad(path, f"{key!r} must be a list of turns, got {type(turns).__name__}")
        if not turns:
            continue
        date_key = f"{key}_date_time"
        if not isinstance(doc.get(date_key), str):
            raise _bad(path, f"{key!r} has turns but no str {date_key!r}")
        for j, t in enumerate(turns):
            for field in ("speaker", "dia_id", "text"):
                if not isinstance(t, dict) or not isinstance(t.get(field), str):
                    raise _bad(path, f"{key}[{j}] has no str {field!r}")
            if t["dia_id"] in seen:
                raise _bad(path, f"duplicate dia_id {t['dia_id']!r} in {key}")
            seen.add(t["dia_id"])
            ids.append(t["dia_id"])
            texts.append(locomo_turn_text(t, doc[date_key]))
            threads.append(key)
            positions.append(j)
    stats = {"evidence_split": 0, "evidence_absent": 0, "left_out_adversarial": 0, "left_out_no_evidence": 0}
    questions: list[Question] = []
    for i, q in enumerate(doc["qa"]):
        if not isinstance(q, dict):
            raise _bad(path, f"qa[{i}] must be an object")
        for field in ("question", "category"):
            if field not in q:
                raise _bad(path, f"qa[{i}] has no {field!r}")
        if not isinstance(q["question"], str):
            raise _bad(path, f"qa[{i}] 'question' must be a str")
        if q["category"] == ADVERSARIAL:
            stats["left_out_adversarial"] += 1
            continue
        raw = q.get("evidence") or []
        if not isinstance(raw, list):
            raise _bad(path, f"qa[{i}] 'evidence' must be a list of dia_ids, got {type(raw).__name__}")
        ev, n_split = parse_evidence(raw)
        if not ev:
            stats["left_out_no_evidence"] += 1
            continue
        stats["evidence_split"] += n_split
        stats["evidence_absent"] += sum(1 for e in ev if e not in seen)
        questions.append(
            Question(
                qid=f"{user}/{i}", text=q["question"], user_key=user, ground_truth=ev, category=str(q["category"]),
                info={"answer": q.get("answer"), "evidence_raw": list(raw), "qa_index": i},
            )  # fmt: skip
        )
    return User(key=user, item_ids=ids, item_texts=texts, item_threads=threads, item_positions=positions), questions, stats


def load_locomo(data_dir: str | os.PathLike[str], conversations: Sequence[str] | None = None) -> Dataset:
    """Load LoCoMo conversations under the turn-level protocol of the module docstring.

    Args:
        data_dir: a folder of conversation files ``*.json`` (e.g. ``shared/data/locomo``),
            or one such file.
        conversations: file stems to load (e.g. ["26", "30"]), in that order; default
            every ``*.json`` of the folder, sorted by name.

    Returns:
        :class:`~rfmem_fast.datasets.base.Dataset` named "locomo": one user per
        conversation (key = file stem), questions in file order per conversation
        (``ground_truth`` = evidence ids, ``category`` = str(category), ``info`` =
        answer / raw evidence / index in ``qa``), ``stats`` and ``notes`` on the
        evidence repairs.

    Raises:
        FileNotFoundError: ``data_dir`` missing, holding no ``*.json``, or a requested
            conversation file missing.
        ValueError: a file that is not valid JSON or lacks a field of the format (the
            message names the file and the field); duplicate dia_ids.
    """
    base = Path(os.fspath(data_dir)).expanduser()
    if base.is_file():
        files = [base]
    elif base.is_dir():
        if conversations is None:
            files = sorted(base.glob("*.json"))
        else:
            files = [base / f"{c}.json" for c in conversations]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"LoCoMo conversation file not found: {str(f)!r}")
        if not files:
            raise FileNotFoundError(f"data_dir {str(base)!r} holds no LoCoMo conversation files (*.json)")
    else:
        raise FileNotFoundError(f"data_dir {str(base)!r} does not exist (expected a folder of LoCoMo *.json files)")
    users, questions = [], []
    totals: dict[str, int] = {}
    for f in files:
        u, qs, st = _conversation(f)
        users.append(u)
        questions += qs
        for key, v in st.items():
            totals[key] = totals.get(key, 0) + v
    notes = [
        f"left out {totals['left_out_adversarial']} adversarial (category 5) and {totals['left_out_no_evidence']} "
        "evidence-less questions",
    ]
    if totals["evidence_split"]:
        notes.append(f"{totals['evidence_split']} evidence entries held several ids (split on ';' / ',')")
    if totals["evidence_absent"]:
        notes.append(f"{totals['evidence_absent']} evidence ids are no turn of their conversation (kept: they count as missed)")
    return Dataset(name="locomo", users=users, questions=questions, metric_names=LOCOMO_METRICS, scorer=locomo_score,
                   notes=notes, stats=totals)  # fmt: skip
