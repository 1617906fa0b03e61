"""Quiet model loading for :class:`rfmem_fast.encoders.TextEncoder`: transformers'
"Loading weights" progress bar silenced for the loading thread only, through its tqdm
hook, which is restored afterwards (:func:`_quiet_weight_loading`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

#: serialises the install / removal of the tqdm hook (two encoders loading at once)
_HOOK_LOCK = threading.Lock()


@contextlib.contextmanager
def _quiet_weight_loading() -> Iterator[None]:
    """Silence transformers' "Loading weights" bar in the calling thread, for the block.

    transformers draws that bar with ``transformers.utils.logging.tqdm``, whose
    ``set_tqdm_hook`` (it returns the previous hook) lets a caller decide how each bar
    is made. The hook installed here makes the calling thread's bars with
    ``disable=True`` and hands every other thread's bars to the previous hook (or to
    tqdm as usual), so a model loading concurrently elsewhere keeps its bar; the
    previous hook is put back when the block ends, even on an error. With a
    transformers without ``set_tqdm_hook`` the module switch
    (``disable_progress_bar`` / ``enable_progress_bar``) is flipped for the block and
    restored to its former state. Nothing else (log levels, environment) is touched.
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a model that does not use transformers: nothing to silence
        yield
        return
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    with _HOOK_LOCK:
        if set_hook is None:  # pragma: no cover - transformers < 5
            was_on = hf_logging.is_progress_bar_enabled()
            if was_on:
                hf_logging.disable_progress_bar()
            try:
                yield
            finally:
                if was_on:
                    hf_logging.enable_progress_bar()
            return
        me = threading.get_ident()
        previous: Any = None

        def hook(factory: Any, args: tuple, kwargs: dict) -> Any:
            if threading.get_ident() == me:
                return factory(*args, **{**kwargs, "disable": True})
            if previous is not None:
                return previous(factory, args, kwargs)
            return factory(*args, **kwargs)

        previous = set_hook(hook)
        try:
            yield
        finally:
            current = set_hook(previous)
            if current is not hook:  # someone replaced ours meanwhile: keep theirs
                set_hook(current)
