"""The package works without the compiled extension (RFMEM_NO_NATIVE=1 or no compiler).

Runs in a subprocess in which ``import rfmem_fast._native`` fails, as it does when the
extension was not built: the registry must not list "native", "auto" must pick another
backend, asking for "native" must raise a clear ValueError, and a search must work.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_package_works_without_native_extension() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        sys.modules["rfmem_fast._native"] = None  # the import now raises ImportError
        import numpy as np
        from rfmem_fast import MemoryBank, search
        from rfmem_fast.backends import available, get_backend
        out = {"available": available(), "auto": get_backend("auto").name}
        try:
            get_backend("native")
            out["native_error"] = None
        except ValueError as exc:
            out["native_error"] = str(exc)
        rng = np.random.default_rng(0)
        bank = MemoryBank(8)
        bank.add("a", rng.standard_normal((30, 8)), list(range(30)))
        res = search(bank, rng.standard_normal((4, 8)), ["a"] * 4, mode="rfmem")
        out["backend"] = res.backend
        out["ids"] = [len(res.ids_list(i)) for i in range(4)]
        print(json.dumps(out))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "native" not in out["available"]
    assert out["available"][-1] == "reference" and "torch" in out["available"]
    assert out["auto"] != "native" and out["backend"] != "native"
    assert out["native_error"] and "native" in out["native_error"]
    assert out["ids"] == [10, 10, 10, 10]
