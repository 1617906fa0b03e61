"""One loader interface for every retrieval dataset (PersonaBench, LoCoMo, LongMemEval).

A *dataset* is what :func:`rfmem_fast.evaluate_datasets.evaluate_dataset` and ``rfmem
eval`` need to score a retriever, nothing more:

* ``users``: the memory-bank tenants, each a :class:`MemoryUser` -- ``key`` (str, the
  tenant key), ``item_ids`` (list[str], n, unique within the user) and ``item_texts``
  (list[str], n, aligned with the ids); optionally ``item_threads`` / ``item_positions``
  (n entries each, or None: the items' conversation threads and their order in them,
  what ``MemoryBank.add(threads=, positions=)`` takes; a loader fills them from the
  dataset's sessions and turn order, :func:`user_threads` reads them);
* ``questions``: each a :class:`MemoryQuestion` -- ``qid`` (str), ``text`` (str, what is
  embedded), ``user_key`` (the tenant it searches), ``ground_truth`` (dataset-specific:
  what ``score`` reads), ``category`` (str, for per-category tables) and ``scored``
  (bool: False for questions the protocol keeps but does not score, e.g. PersonaBench's
  "Subjective" or LongMemEval's abstention questions);
* ``name`` (str, e.g. "locomo"; it also prefixes the embedding cache files),
  ``metric_names`` (tuple[str, ...]: the keys ``score`` returns; always holds "recall"
  and "ndcg", "recall" being the figure a table or a tuning objective reads) and
  ``score(question, retrieved, k) -> {metric: float}``: the dataset's own metric
  functions on one question's ranked ids.

:class:`MemoryDataset` is a :class:`typing.Protocol` (structural: PersonaBench's own
classes satisfy it without inheriting); :class:`Dataset` / :class:`User` /
:class:`Question` are the plain dataclasses the LoCoMo and LongMemEval loaders build.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = ["MemoryUser", "MemoryQuestion", "MemoryDataset", "User", "Question", "Dataset", "check_dataset", "user_threads"]


def user_threads(user: Any) -> tuple[list | None, list | None]:
    """(threads, positions) of a dataset user's items (``item_threads`` / ``item_positions``;
    None for a user without them, e.g. of a dataset whose items have no conversation order)."""
    return getattr(user, "item_threads", None), getattr(user, "item_positions", None)


@runtime_checkable
class MemoryUser(Protocol):
    """One tenant of a dataset: ``key`` (str), ``item_ids`` / ``item_texts`` (aligned list[str])."""

    @property
    def key(self) -> str: ...

    @property
    def item_ids(self) -> Sequence[str]: ...

    @property
    def item_texts(self) -> Sequence[str]: ...


@runtime_checkable
class MemoryQuestion(Protocol):
    """One question: ``qid``, ``text``, ``user_key``, ``ground_truth``, ``category``, ``scored``."""

    @property
    def qid(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def user_key(self) -> str: ...

    @property
    def ground_truth(self) -> Any: ...

    @property
    def category(self) -> str: ...

    @property
    def scored(self) -> bool: ...


@runtime_checkable
class MemoryDataset(Protocol):
    """A loaded dataset: ``name``, ``users``, ``questions``, ``metric_names`` and ``score``."""

    @property
    def name(self) -> str: ...

    @property
    def users(self) -> Sequence[Any]: ...

    @property
    def questions(self) -> Sequence[Any]: ...

    @property
    def metric_names(self) -> tuple[str, ...]: ...

    def score(self, question: Any, retrieved: Sequence[str], k: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class User:
    """A tenant: ``key`` (str), ``item_ids`` (list[str], n, unique), ``item_texts`` (list[str], n),
    ``item_threads`` (n str / None, or None: no thread) and ``item_positions`` (n int / None,
    or None): each item's conversation thread and its position in it."""

    key: str
    item_ids: list[str]
    item_texts: list[str]
    item_threads: list | None = None
    item_positions: list | None = None

    def __len__(self) -> int:
        """Number of items n."""
        return len(self.item_ids)


@dataclass(frozen=True)
class Question:
    """A question (see the module docstring for the fields); ``info`` holds extra loader fields."""

    qid: str
    text: str
    user_key: str
    ground_truth: Any
    category: str
    scored: bool = True
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    """A dataset built by a loader: users, questions and the metric function.

    Attributes:
        name: dataset name (str), e.g. "locomo"; prefixes the embedding cache files.
        users: list[User] in load order.
        questions: list[Question] in load order (unscored ones included).
        metric_names: keys of ``scorer``'s dict (tuple[str, ...], "recall" and "ndcg" among them).
        scorer: ``(question, retrieved ids, k) -> {metric: float}``.
        notes: what the loader did that a reader of the figures should know (e.g.
            malformed ground-truth entries it split or kept), list[str].
        stats: counts behind the notes (dict[str, int]).
    """

    name: str
    users: list[User]
    questions: list[Question]
    metric_names: tuple[str, ...]
    scorer: Callable[[Question, Sequence[str], int], dict[str, float]] = field(repr=False)
    notes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def score(self, question: Question, retrieved: Sequence[str], k: int) -> dict[str, float]:
        """The dataset's metrics of one question's ranked ids at cut-off k (``{name: float}``).

        Raises:
            ValueError / TypeError: ``k`` not an int >= 1.
        """
        return self.scorer(question, retrieved, k)

    @property
    def scored_questions(self) -> list[Question]:
        """Questions the protocol scores (``scored`` True), load order."""
        return [q for q in self.questions if q.scored]


def check_dataset(dataset: Any) -> None:
    """Check that ``dataset`` follows the interface (the users and questions it lists).

    Raises:
        TypeError: ``dataset`` lacks an attribute of :class:`MemoryDataset` (named).
        ValueError: duplicate user keys, ids and texts (or threads, positions) of different lengths, a
            question whose ``user_key`` is no user's, "recall" / "ndcg" missing from
            ``metric_names``.
    """
    for attr in ("name", "users", "questions", "metric_names", "score"):
        if not hasattr(dataset, attr):
            raise TypeError(f"dataset must have a {attr!r} attribute (see rfmem_fast.datasets.base), got {type(dataset).__name__}")
    names = tuple(dataset.metric_names)
    if "recall" not in names or "ndcg" not in names:
        raise ValueError(f"dataset.metric_names must include 'recall' and 'ndcg', got {names}")
    keys: set[str] = set()
    for u in dataset.users:
        if u.key in keys:
            raise ValueError(f"dataset {dataset.name!r}: duplicate user key {u.key!r}")
        keys.add(u.key)
        if len(u.item_ids) != len(u.item_texts):
            raise ValueError(f"dataset {dataset.name!r}: user {u.key!r} has {len(u.item_ids)} ids but {len(u.item_texts)} texts")
        for what, vals in zip(("threads", "positions"), user_threads(u)):
            if vals is not None and len(vals) != len(u.item_ids):
                raise ValueError(f"dataset {dataset.name!r}: user {u.key!r} has {len(u.item_ids)} ids but {len(vals)} {what}")
    for q in dataset.questions:
        if q.user_key not in keys:
            raise ValueError(f"dataset {dataset.name!r}: question {q.qid!r} asks user {q.user_key!r}, which has no items")
