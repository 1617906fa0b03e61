"""PersonaBench loader, as the RF-Mem reference code reads it (RFMEM_SPEC.md section 6).

Layout (``DIR`` is what the user passes; see :func:`resolve_synthetic_dir`)::

    DIR/synthetic_data/community_{c}/
        eval_info/eval_info_all.json                       [{"Name", "Eval_Info": {"qa": [...]}}]
        eval_info/qa_gt_context_all_noise_{noise}.json     [{"q_id", "segment_id": {alt: [ids]}}]
        private_data/noise_{noise}/conversation_data_all.json          [{"Name", "Data"}]
        private_data/noise_{noise}/user_ai_interaction_data_all.json   [{"Name", "Data"}]
        private_data/noise_{noise}/purchase_history_data_all.json      [{"Name", "Data"}]

Per community, the users are the first ``users_per_community`` entries of
``eval_info_all.json``. A user's memory chunks are, in this order: every entry of every
sub-conversation (``Data[i]["Conversations"][j]``), then every user-AI interaction entry,
then every purchase-history entry. Chunk text is ``json.dumps(entry, separators=(',',
':'))`` (default ``ensure_ascii=True``) after removing the keys "segment_id" and
"session" at every depth; chunk id is the entry's ``segment_id``.

Questions keep file order (communities in the order given, users in file order, each
user's ``qa`` in order) and include type "Subjective"; :attr:`PersonaBench.evaluated`
gives the questions the protocol scores (230 of 263 for the default setting).

Conversation structure (``PBUser.chunk_threads`` / ``chunk_positions``, what the context
score reads: docs "Conversations"). A chunk is a whole SESSION (every turn of it in one
text), so there is no turn order inside a chunk; the sessions themselves are ordered in
threads: the sub-conversations with one partner (``Data[i]``, thread
``"conversation/{i}"``) session after session (``Conversations[j]``, position j, in file
order, which is time order), the user-AI interaction sessions (thread
``"user_ai_interaction"``) and the purchase sessions (thread ``"purchase_history"``), each
in file order. A chunk's neighbours are thus the sessions before and after it with the same
partner, or of the same kind.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "PBUser",
    "PBQuestion",
    "PersonaBench",
    "load_personabench",
    "resolve_synthetic_dir",
    "noise_tag",
    "strip_keys",
    "chunk_text",
    "REMOVED_KEYS",
    "SUBJECTIVE",
    "PRIVATE_FILES",
]

#: Keys removed at every depth before a session entry is serialised.
REMOVED_KEYS: tuple[str, ...] = ("segment_id", "session")
#: Question type the protocol does not score.
SUBJECTIVE = "Subjective"
#: Private-data files in chunk order (the first one holds sub-conversations).
PRIVATE_FILES: tuple[str, ...] = (
    "conversation_data_all",
    "user_ai_interaction_data_all",
    "purchase_history_data_all",
)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class PBUser:
    """One PersonaBench user and their memory chunks (RFMEM_SPEC.md section 6).

    Attributes:
        community: community index (int, 0 or 1 in eval_data_v1).
        name: the user's name as in ``eval_info_all.json`` (str).
        chunk_ids: segment ids, one per chunk, unique within the user (list[str], n).
        chunk_texts: chunk texts, aligned with ``chunk_ids`` (list[str], n).
        chunk_threads: each chunk's thread (list[str], n; module docstring), or None.
        chunk_positions: each chunk's session index in its thread (list[int], n), or None.
    """

    community: int
    name: str
    chunk_ids: list[str]
    chunk_texts: list[str]
    chunk_threads: list[str] | None = None
    chunk_positions: list[int] | None = None

    @property
    def key(self) -> str:
        """Memory-bank tenant key ``f"{community}/{name}"`` (str)."""
        return f"{self.community}/{self.name}"

    def __len__(self) -> int:
        """Number of chunks n."""
        return len(self.chunk_ids)

    # the loader interface of rfmem_fast.datasets.base (MemoryUser)
    @property
    def item_ids(self) -> list[str]:
        """The chunk ids (``chunk_ids``; :class:`rfmem_fast.datasets.base.MemoryUser`)."""
        return self.chunk_ids

    @property
    def item_texts(self) -> list[str]:
        """The chunk texts (``chunk_texts``; :class:`rfmem_fast.datasets.base.MemoryUser`)."""
        return self.chunk_texts

    @property
    def item_threads(self) -> list[str] | None:
        """The chunks' threads (``chunk_threads``; :func:`rfmem_fast.datasets.base.user_threads`)."""
        return self.chunk_threads

    @property
    def item_positions(self) -> list[int] | None:
        """The chunks' positions in their threads (``chunk_positions``)."""
        return self.chunk_positions


@dataclass(frozen=True)
class PBQuestion:
    """One PersonaBench question with its ground truth (RFMEM_SPEC.md section 6).

    Attributes:
        community: community index (int).
        user: the asking user's name (str).
        q_id: question id from ``eval_info_all.json`` (str; unique per community, not
            across communities).
        question: the question text (str).
        type: e.g. "Basic information", "Preference", "Social", "Subjective".
        difficulty: "easy" or "hard".
        answer: the reference answer as stored (str, int, list, ... or None).
        gt_segment_ids: ``{answer alternative: [segment ids]}`` from
            ``qa_gt_context_all_noise_{noise}.json``.
    """

    community: int
    user: str
    q_id: str
    question: str
    type: str
    difficulty: str
    answer: Any
    gt_segment_ids: dict[str, list[str]]

    @property
    def user_key(self) -> str:
        """Memory-bank tenant key of the asking user, ``f"{community}/{user}"``."""
        return f"{self.community}/{self.user}"

    @property
    def is_evaluated(self) -> bool:
        """False for type "Subjective" (not scored by the protocol), else True."""
        return self.type != SUBJECTIVE

    @property
    def category(self) -> str:
        """Protocol category, see :func:`rfmem_fast.metrics.question_category`."""
        from rfmem_fast.metrics import question_category

        return question_category(self.type, self.difficulty)

    # the loader interface of rfmem_fast.datasets.base (MemoryQuestion)
    @property
    def qid(self) -> str:
        """Question id unique across communities: ``f"{community}/{q_id}"``."""
        return f"{self.community}/{self.q_id}"

    @property
    def text(self) -> str:
        """The question text (``question``)."""
        return self.question

    @property
    def ground_truth(self) -> dict[str, list[str]]:
        """``gt_segment_ids``: ``{answer alternative: [segment ids]}``."""
        return self.gt_segment_ids

    @property
    def scored(self) -> bool:
        """``is_evaluated``: False for type "Subjective"."""
        return self.is_evaluated


@dataclass(frozen=True)
class PersonaBench:
    """A loaded PersonaBench split (RFMEM_SPEC.md section 6).

    Attributes:
        users: users in load order (communities as requested, file order within).
        questions: all questions in file order, "Subjective" ones included.
        noise: the noise level loaded (float, e.g. 0.0).
    """

    users: list[PBUser]
    questions: list[PBQuestion]
    noise: float
    _by_key: dict[str, PBUser] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_key: dict[str, PBUser] = {}
        for u in self.users:
            if u.key in by_key:
                raise ValueError(f"duplicate user key {u.key!r}")
            by_key[u.key] = u
        object.__setattr__(self, "_by_key", by_key)

    # the loader interface of rfmem_fast.datasets.base (MemoryDataset)
    @property
    def name(self) -> str:
        """Dataset name "personabench" (also the prefix of its embedding cache files)."""
        return "personabench"

    @property
    def metric_names(self) -> tuple[str, ...]:
        """("recall", "ndcg"): what :meth:`score` returns."""
        return ("recall", "ndcg")

    def score(self, question: PBQuestion, retrieved: Sequence[str], k: int) -> dict[str, float]:
        """Recall@k and NDCG@k of one question, best over ground-truth combinations
        (:func:`rfmem_fast.metrics.recall_ndcg_at_k`).

        Args:
            question: a :class:`PBQuestion` (its ``gt_segment_ids``).
            retrieved: ranked segment ids (best first), list[str].
            k: cut-off, int >= 1.

        Returns:
            ``{"recall": float, "ndcg": float}``.

        Raises:
            ValueError / TypeError: ``k`` not an int >= 1.
        """
        from rfmem_fast.metrics import recall_ndcg_at_k

        r, n = recall_ndcg_at_k([str(x) for x in retrieved], question.gt_segment_ids, k)
        return {"recall": r, "ndcg": n}

    @property
    def evaluated(self) -> list[PBQuestion]:
        """Questions the protocol scores: all but type "Subjective" (file order)."""
        return [q for q in self.questions if q.is_evaluated]

    def user(self, key: str) -> PBUser:
        """The user with tenant key ``key`` (``f"{community}/{name}"``).

        Raises:
            KeyError: if no loaded user has that key.
        """
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"no user {key!r}; loaded: {sorted(self._by_key)}") from None

    def questions_of(self, key: str) -> list[PBQuestion]:
        """Questions (all types, file order) asked by the user with tenant key ``key``."""
        return [q for q in self.questions if q.user_key == key]


# --------------------------------------------------------------------------- helpers


def strip_keys(obj: Any, keys: Iterable[str] = REMOVED_KEYS) -> Any:
    """Copy of a JSON value with the given dict keys removed at every depth.

    Dicts keep their key order; lists are walked element by element; other values are
    returned as is. The input is not modified. Spec: RFMEM_SPEC.md section 6.
    """
    drop = frozenset(keys)

    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items() if k not in drop}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    return walk(obj)


def chunk_text(entry: Mapping[str, Any]) -> str:
    """Chunk text of one session entry: ``json.dumps(strip_keys(entry),
    separators=(',', ':'))`` with the default ``ensure_ascii=True``.

    Spec: RFMEM_SPEC.md section 6.
    """
    return json.dumps(strip_keys(entry), separators=(",", ":"))


def noise_tag(noise: float) -> str:
    """Folder/file tag of a noise level: ``f"{float(noise)}"`` ("0.0", "0.3", ...).

    Raises:
        TypeError: if ``noise`` is not a real number (bool refused).
        ValueError: if ``noise`` is negative, NaN or infinite.
    """
    if isinstance(noise, bool) or not isinstance(noise, (int, float)):
        try:
            import numpy as np

            ok = isinstance(noise, (np.integer, np.floating))
        except ImportError:  # pragma: no cover
            ok = False
        if not ok:
            raise TypeError(f"noise must be a float such as 0.0, got {noise!r}")
    value = float(noise)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"noise must be a finite float >= 0, got {noise!r}")
    return f"{value}"


def resolve_synthetic_dir(data_dir: str | os.PathLike[str]) -> Path:
    """Find the ``synthetic_data`` folder from what the user gave.

    Accepted, tried in this order: ``DIR/synthetic_data``, ``DIR`` itself (when it holds
    ``community_*`` folders), ``DIR/eval_data_v1/synthetic_data``.

    Returns:
        The resolved folder holding ``community_{c}`` (Path).

    Raises:
        FileNotFoundError: if none of these exists, naming the paths tried.
    """
    base = Path(os.fspath(data_dir)).expanduser()
    candidates = [base / "synthetic_data", base, base / "eval_data_v1" / "synthetic_data"]
    for cand in candidates:
        if cand.is_dir() and any(p.is_dir() for p in cand.glob("community_*")):
            return cand.resolve()
    tried = ", ".join(repr(str(c)) for c in candidates)
    raise FileNotFoundError(
        f"no PersonaBench data under {str(base)!r}: expected a 'synthetic_data' folder "
        f"holding community_0, community_1, ... (tried {tried})"
    )


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"PersonaBench file not found: {str(path)!r}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc


def _bad(path: Path, what: str) -> ValueError:
    return ValueError(f"{str(path)!r}: {what}")


def _require(obj: Any, key: str, path: Path, where: str) -> Any:
    if not isinstance(obj, dict):
        raise _bad(path, f"{where} must be an object, got {type(obj).__name__}")
    if key not in obj:
        raise _bad(path, f"{where} has no key {key!r}")
    return obj[key]


def _require_list(obj: Any, path: Path, where: str) -> list[Any]:
    if not isinstance(obj, list):
        raise _bad(path, f"{where} must be a list, got {type(obj).__name__}")
    return obj


def _available(folder: Path, prefix: str, suffix: str = "") -> list[str]:
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        name = p.name
        if name.startswith(prefix) and name.endswith(suffix):
            out.append(name[len(prefix) : len(name) - len(suffix) if suffix else None])
    return sorted(out)


def _by_name(path: Path) -> dict[str, Any]:
    """``{Name: Data}`` of one private-data file (a list of {"Name", "Data"})."""
    data = _require_list(_load_json(path), path, "top level")
    out: dict[str, Any] = {}
    for i, rec in enumerate(data):
        name = _require(rec, "Name", path, f"entry {i}")
        if not isinstance(name, str):
            raise _bad(path, f"entry {i} 'Name' must be a str")
        out[name] = _require(rec, "Data", path, f"entry {i}")  # last one wins, as reference
    return out


def _session_entries(kind: str, data: Any, path: Path, user: str) -> list[tuple[dict[str, Any], str, int]]:
    """(entry, thread, position) of every session entry of one user in one private-data file
    (the module docstring's threads)."""
    where = f"Data of {user!r}"
    items = _require_list(data, path, where)
    if kind != "conversation_data_all":
        for j, e in enumerate(items):
            if not isinstance(e, dict):
                raise _bad(path, f"{where}[{j}] must be an object")
        thread = kind.replace("_data_all", "")
        return [(e, thread, j) for j, e in enumerate(items)]
    entries: list[tuple[dict[str, Any], str, int]] = []
    for j, sub in enumerate(items):
        convs = _require_list(
            _require(sub, "Conversations", path, f"{where}[{j}]"),
            path,
            f"{where}[{j}]['Conversations']",
        )
        for m, e in enumerate(convs):
            if not isinstance(e, dict):
                raise _bad(path, f"{where}[{j}]['Conversations'][{m}] must be an object")
            entries.append((e, f"conversation/{j}", m))
    return entries


def _gt_lookup(path: Path) -> dict[str, dict[str, list[str]]]:
    data = _require_list(_load_json(path), path, "top level")
    out: dict[str, dict[str, list[str]]] = {}
    for i, rec in enumerate(data):
        q_id = _require(rec, "q_id", path, f"entry {i}")
        seg = _require(rec, "segment_id", path, f"entry {i} (q_id {q_id!r})")
        if not isinstance(seg, dict):
            raise _bad(path, f"q_id {q_id!r}: 'segment_id' must be an object")
        gt: dict[str, list[str]] = {}
        for alt, ids in seg.items():
            if not isinstance(ids, list) or not all(isinstance(s, str) for s in ids):
                raise _bad(path, f"q_id {q_id!r}: alternative {alt!r} must list str ids")
            gt[str(alt)] = list(ids)
        if str(q_id) in out:
            raise _bad(path, f"duplicate q_id {q_id!r}")
        out[str(q_id)] = gt
    return out


# --------------------------------------------------------------------------- loader


def load_personabench(
    data_dir: str | os.PathLike[str],
    noise: float = 0.0,
    communities: Sequence[int] = (0, 1),
    users_per_community: int = 3,
) -> PersonaBench:
    """Load PersonaBench users, chunks and questions as the RF-Mem reference does.

    Spec: RFMEM_SPEC.md section 6 (the default arguments give the reference setting:
    6 users, 263 questions, 230 evaluated).

    Args:
        data_dir: folder holding ``synthetic_data/`` (or ``synthetic_data`` itself, or
            a folder holding ``eval_data_v1/synthetic_data``).
        noise: noise level (float >= 0); selects ``noise_{noise}`` folders/files, the
            tag formatted as ``f"{float(noise)}"`` ("0.0", "0.3", ...).
        communities: community indices to load, in order (ints >= 0, no repeats).
        users_per_community: how many users (the first ones of
            ``eval_info_all.json``) per community, int >= 1.

    Returns:
        :class:`PersonaBench` with ``users`` (chunk ids/texts per user),
        ``questions`` (file order, "Subjective" included) and ``noise``.

    Raises:
        FileNotFoundError: data folder, community folder or a required file missing;
            for an unknown noise level the message lists the available levels.
        ValueError: a file is not valid JSON or lacks a required key / has a wrong
            shape (the message names the file); a question has no ground-truth entry
            in the ground-truth file (e.g. users beyond the third, which the
            distributed data does not cover); duplicate segment ids within one user;
            bad ``users_per_community`` or ``communities``.
        TypeError: ``noise`` is not a number.
    """
    tag = noise_tag(noise)
    if isinstance(users_per_community, bool) or not isinstance(users_per_community, int):
        raise TypeError(f"users_per_community must be an int >= 1, got {users_per_community!r}")
    if users_per_community < 1:
        raise ValueError(f"users_per_community must be >= 1, got {users_per_community}")
    comms = list(communities)
    for c in comms:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"communities must be ints >= 0, got {communities!r}")
    if len(set(comms)) != len(comms):
        raise ValueError(f"communities must not repeat, got {communities!r}")

    root = resolve_synthetic_dir(data_dir)
    users: list[PBUser] = []
    questions: list[PBQuestion] = []
    for c in comms:
        cdir = root / f"community_{c}"
        if not cdir.is_dir():
            have = _available(root, "community_")
            raise FileNotFoundError(
                f"community {c} not found: no folder {str(cdir)!r} (available: {have})"
            )
        eval_dir = cdir / "eval_info"
        priv_dir = cdir / "private_data" / f"noise_{tag}"
        gt_path = eval_dir / f"qa_gt_context_all_noise_{tag}.json"
        if not priv_dir.is_dir() or not gt_path.is_file():
            levels = sorted(
                set(_available(cdir / "private_data", "noise_"))
                & set(_available(eval_dir, "qa_gt_context_all_noise_", ".json")),
                key=lambda s: (float(s) if _is_float(s) else math.inf, s),
            )
            raise FileNotFoundError(
                f"noise level {tag} not available for community {c} under {str(cdir)!r} "
                f"(missing {str(priv_dir if not priv_dir.is_dir() else gt_path)!r}); "
                f"available noise levels: {levels}"
            )

        info_path = eval_dir / "eval_info_all.json"
        info = _require_list(_load_json(info_path), info_path, "top level")
        gt_all = _gt_lookup(gt_path)
        private = {kind: (priv_dir / f"{kind}.json") for kind in PRIVATE_FILES}
        lookups = {kind: _by_name(p) for kind, p in private.items()}

        for ui, rec in enumerate(info[:users_per_community]):
            name = _require(rec, "Name", info_path, f"entry {ui}")
            if not isinstance(name, str):
                raise _bad(info_path, f"entry {ui} 'Name' must be a str")
            qa = _require_list(
                _require(
                    _require(rec, "Eval_Info", info_path, f"entry {ui} ({name!r})"),
                    "qa",
                    info_path,
                    f"{name!r} Eval_Info",
                ),
                info_path,
                f"{name!r} Eval_Info['qa']",
            )

            ids: list[str] = []
            texts: list[str] = []
            threads: list[str] = []
            positions: list[int] = []
            seen: dict[str, str] = {}
            for kind in PRIVATE_FILES:
                if name not in lookups[kind]:
                    continue  # no chunks from this file
                path = private[kind]
                for e, thread, position in _session_entries(kind, lookups[kind][name], path, name):
                    if "segment_id" not in e:
                        raise _bad(path, f"a session entry of {name!r} has no 'segment_id'")
                    sid = e["segment_id"]
                    if not isinstance(sid, str):
                        raise _bad(path, f"segment_id {sid!r} of {name!r} must be a str")
                    if sid in seen:
                        raise ValueError(
                            f"duplicate segment id {sid!r} for user {name!r} "
                            f"(community {c}) in {str(path)!r} (first seen in "
                            f"{seen[sid]!r})"
                        )
                    seen[sid] = str(path)
                    ids.append(sid)
                    texts.append(chunk_text(e))
                    threads.append(thread)
                    positions.append(position)
            users.append(PBUser(community=c, name=name, chunk_ids=ids, chunk_texts=texts, chunk_threads=threads,
                                chunk_positions=positions))  # fmt: skip

            for qi, q in enumerate(qa):
                where = f"{name!r} qa[{qi}]"
                q_id = str(_require(q, "q_id", info_path, where))
                fields = {k: _require(q, k, info_path, where) for k in ("question", "type", "difficulty")}
                for k, v in fields.items():
                    if not isinstance(v, str):
                        raise _bad(info_path, f"{where} {k!r} must be a str")
                if q_id not in gt_all:
                    raise _bad(
                        gt_path,
                        f"no ground truth for q_id {q_id!r} (user {name!r}, community {c})",
                    )
                questions.append(
                    PBQuestion(
                        community=c,
                        user=name,
                        q_id=q_id,
                        question=fields["question"],
                        type=fields["type"],
                        difficulty=fields["difficulty"],
                        answer=q.get("answer"),
                        gt_segment_ids={a: list(v) for a, v in gt_all[q_id].items()},
                    )
                )
    return PersonaBench(users=users, questions=questions, noise=float(noise))


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True
