"""Where the shared data lives for the tests: $RFMEM_SHARED or ../shared beside the checkout."""
from __future__ import annotations

import os
from pathlib import Path


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
