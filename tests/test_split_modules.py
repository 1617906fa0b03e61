"""Modules split by concept keep every name at the import path callers use.

``rfmem_fast.bank`` re-exports what ``bank_snapshot``, ``bank_validate`` and ``bank_rows``
define, ``rfmem_fast.serving.mcp_server`` what ``mcp_scope``, ``mcp_tools`` and
``mcp_encoder`` define, ``rfmem_fast.filters`` what ``filters_values``, ``filters_parse``, ``filters_eval`` and
``filters_selection`` define, ``rfmem_fast.store`` what ``store_format``, ``store_files`` and
``store_read`` define, and ``rfmem_fast.encoders`` what ``encoder_passes``, ``encoder_onnx``
and ``encoder_loading`` define, and ``rfmem_fast.bench.gpu`` what ``gpu_data``, ``gpu_compare``
and ``gpu_goals`` define: the same objects (identity, not copies), so ``isinstance`` checks,
monkeypatching through either module's attribute and ``from ... import`` all agree.
"""
from __future__ import annotations

import importlib
import logging

import pytest

BANK_NAMES = {
    "rfmem_fast.bank_snapshot": ["BankSnapshot", "NO_POSITION"],
    "rfmem_fast.bank_validate": [
        "ItemId", "MAX_POSITION", "MAX_METADATA_DEPTH", "INSTANT_MIN", "INSTANT_END", "INSTANT_RANGE",
        "instants_known", "check_instant", "check_created_at", "check_threads", "check_positions",
        "_check_user", "_check_id_list", "_check_ids", "_check_texts", "_check_unicode", "_check_metadata",
        "_check_thread_pairs",
    ],
    "rfmem_fast.bank_rows": ["_UserRows"],
}

MCP_NAMES = {
    "rfmem_fast.serving.mcp_scope": ["TOKENS_ENV", "TokenMap", "McpScope", "hash_token", "scope_from_options"],
    "rfmem_fast.serving.mcp_tools": [
        "MAX_TEXTS", "MAX_TEXT", "MAX_K", "MAX_PAGE", "MAX_ID", "TextArg", "IdArg", "Meta", "ThreadArg",
        "PositionArg", "MemoryChange",
    ],
    "rfmem_fast.serving.mcp_encoder": ["EncoderLoad"],
}

FILTERS_NAMES = {
    "rfmem_fast.filters_values": [
        "CREATED_AT", "THREAD", "POSITION", "RESERVED_FIELDS", "COMPARISONS", "LOGICAL", "parse_instant",
        "_RANGES", "_FLOAT_EXACT", "_INT64_MIN", "_INT64_MAX", "_where", "_type_name", "_is_number", "_check_json",
        "_number", "_normal", "_value_key", "_LAST_UTC", "_LAST_SECOND", "_timestamp", "_string_instant",
    ],
    "rfmem_fast.filters_parse": [
        "_Cmp", "_Bool", "_parse_path", "_created_value", "_parse_value", "_parse", "_canonical",
    ],
    "rfmem_fast.filters_eval": [
        "FilterTypeError", "_Column", "_Columns", "_evaluate", "_eval_created", "_float_bound", "_int_bound",
        "_number_range", "_eval_meta",
    ],
    "rfmem_fast.filters_selection": ["RowSelection", "LIST_MAX_FRACTION"],
}

STORE_NAMES = {
    "rfmem_fast.store_format": [
        "FORMAT_NAME", "FORMAT_VERSION", "LEXICAL_FILES", "LEXICAL_TOKENIZER", "CURRENT", "MANIFEST", "DATA_FILES",
        "CREATED_FILE", "OPTIONAL_FILES", "SCAN_FILE", "SCAN_META_FILE", "THREAD_FILES", "data_files",
        "format_version_for", "_SNAP_RE", "_HEX64", "StoreContents", "StoreError", "check_format_header",
    ],
    "rfmem_fast.store_files": [
        "_CHUNK", "_NORM_TOL", "_read_bytes", "_read_small", "_parse_json", "_check_size", "_npy_header", "_read_rows",
        "_random_access", "_read_offsets", "_read_npy",
    ],
    "rfmem_fast.store_read": ["_is_key", "_load_once", "_read_threads", "_read_lexical", "read_store"],
}

ENCODER_NAMES = {
    "rfmem_fast.encoder_passes": ["PASS_LENGTH_RATIO", "_passes"],
    "rfmem_fast.encoder_onnx": ["INT8_MAX_TOKENS", "LONG_TEXT_TOKENS", "_OnnxRunner"],
    "rfmem_fast.encoder_loading": ["_HOOK_LOCK", "_quiet_weight_loading"],
}

GPU_NAMES = {
    "rfmem_fast.bench.gpu_data": ["sync", "timed", "_normalise", "DeviceBank", "device_bank", "device_queries"],
    "rfmem_fast.bench.gpu_compare": ["FaissFlat", "_cuml_kmeans"],
    "rfmem_fast.bench.gpu_goals": ["GOALS", "_best", "_meets", "goal_ratios", "plot_doc"],
}


def _same_objects(facade: str, homes: dict[str, list[str]]) -> None:
    old = importlib.import_module(facade)
    for home, names in homes.items():
        mod = importlib.import_module(home)
        for name in names:
            assert getattr(old, name) is getattr(mod, name), f"{facade}.{name} is not {home}.{name}"


def test_bank_names_are_the_objects_of_their_concept_modules():
    _same_objects("rfmem_fast.bank", BANK_NAMES)
    from rfmem_fast import BankSnapshot, MemoryBank
    from rfmem_fast.bank import COMPACT_MIN_DEAD
    from rfmem_fast.bank_layout import log

    assert MemoryBank.__module__ == "rfmem_fast.bank" and BankSnapshot.__module__ == "rfmem_fast.bank_snapshot"
    assert COMPACT_MIN_DEAD == 64
    assert log is logging.getLogger("rfmem_fast.bank")  # the warnings of load() keep their logger


def test_bank_validation_messages_name_the_argument():
    """The checks answer with the same words wherever they are imported from."""
    from rfmem_fast.bank import _check_metadata, check_instant, check_positions

    with pytest.raises(ValueError, match=r"created_at\[2\]: 1774747800000 .* divide by 1000"):
        check_instant(1774747800000.0, "created_at[2]")
    with pytest.raises(TypeError, match=r"positions\[1\] must be an int >= 0"):
        check_positions([0, 1.0], 2)
    with pytest.raises(ValueError, match=r"metadata\[0\] nests deeper than 64 levels"):
        deep: dict = {}
        cur = deep
        for _ in range(70):
            cur["a"] = {}
            cur = cur["a"]
        _check_metadata([deep], 1)


def test_mcp_server_names_are_the_objects_of_their_concept_modules():
    pytest.importorskip("mcp")
    _same_objects("rfmem_fast.serving.mcp_server", MCP_NAMES)
    from rfmem_fast.serving import mcp_server

    assert set(mcp_server.__all__) == {"TOKENS_ENV", "TokenMap", "McpScope", "hash_token", "scope_from_options",
                                       "create_server", "create_http_app", "serve_mcp", "EncoderLoad"}
    for name in mcp_server.__all__:
        assert hasattr(mcp_server, name), name


def test_filters_names_are_the_objects_of_their_concept_modules():
    _same_objects("rfmem_fast.filters", FILTERS_NAMES)
    from rfmem_fast import filters

    assert set(filters.__all__) == {
        "COMPARISONS", "CREATED_AT", "LIST_MAX_FRACTION", "LOGICAL", "POSITION", "RESERVED_FIELDS", "THREAD",
        "Filter", "FilterTypeError", "RowSelection", "check_filters", "compile_filters", "parse_filter",
        "parse_instant",
    }
    for name in filters.__all__:
        assert hasattr(filters, name), name
    assert filters.Filter.__module__ == "rfmem_fast.filters"
    assert filters.RowSelection.__module__ == "rfmem_fast.filters_selection"
    with pytest.raises(ValueError, match=r"filters\['score'\]\['\$foo'\]: unknown operator '\$foo'"):
        filters.parse_filter({"score": {"$foo": 1}})


def test_store_names_are_the_objects_of_their_concept_modules(tmp_path, monkeypatch):
    _same_objects("rfmem_fast.store", STORE_NAMES)
    import numpy as np

    from rfmem_fast import MemoryBank, StoreError, store

    assert set(store.__all__) == {"StoreError", "StoreContents", "write_store", "read_store", "FORMAT_VERSION",
                                  "FORMAT_NAME"}
    assert StoreError is store.StoreError and store.write_store.__module__ == "rfmem_fast.store"
    stages: list[str] = []
    monkeypatch.setattr(store, "_hook", stages.append)  # the testing hook stays on rfmem_fast.store
    bank = MemoryBank(4)
    bank.add("u", np.eye(4, dtype=np.float32)[:2], ["a", "b"])
    bank.save(tmp_path / "s")
    assert stages[-2:] == ["before_commit", "after_commit"] and "file:vectors.npy" in stages
    got = store.read_store(tmp_path / "s")
    assert got.item_ids.tolist() == ["a", "b"] and np.array_equal(got.vectors, np.eye(4, dtype=np.float32)[:2])
    with pytest.raises(StoreError, match="no store here"):
        store.read_store(tmp_path / "none")


def test_encoder_names_are_the_objects_of_their_concept_modules(monkeypatch):
    """No model is loaded: the option rules answer from this module's ``native_bf16``."""
    _same_objects("rfmem_fast.encoders", ENCODER_NAMES)
    from rfmem_fast import encoders

    for name in encoders.__all__:
        assert hasattr(encoders, name), name
    assert encoders.TextEncoder.__module__ == "rfmem_fast.encoders"
    assert (encoders.INT8_MAX_TOKENS, encoders.LONG_TEXT_TOKENS, encoders.PASS_LENGTH_RATIO) == (64, 128, 0.75)
    for native in (True, False):  # patched where callers patch it: the rules that read it see it
        monkeypatch.setattr(encoders, "native_bf16", lambda device="cpu", n=native: n)
        assert encoders.resolve_long_texts("auto", "onnx") == ("torch" if native else "onnx")
        if native:  # (without it resolve_dtype asks torch about the device)
            assert encoders.resolve_dtype("auto", "cpu") == "bfloat16"


def test_gpu_bench_names_are_the_objects_of_their_concept_modules():
    pytest.importorskip("torch")
    _same_objects("rfmem_fast.bench.gpu", GPU_NAMES)
    from rfmem_fast.bench import gpu

    for name in ("BudgetExceeded", "Deadline", "GpuBenchSettings", "GpuBench", "bank_supports_dtype", "_err"):
        assert getattr(gpu, name).__module__ == "rfmem_fast.bench.gpu", name
    got = gpu.goal_ratios({"kmeans": {"problems": [{"m": 8, "results": [
        {"system": "torch", "total_s": 0.5}, {"kind": "cuml", "total_s": 10.0}]}]}}, ["torch"])
    assert got["batched_kmeans_over_cuml_per_problem"]["value"] == 20.0
    assert got["batched_kmeans_over_cuml_per_problem"]["meets_goal"] is True
